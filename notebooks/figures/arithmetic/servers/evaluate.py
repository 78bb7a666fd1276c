"""Held-out accuracy of an async run on a rollout server (notebooks/arithmetic.ipynb, *On a rollout
server*): greedy ``forge-lightning validate`` on the 200 held-out problems at 96 new tokens, in this
process (validation samples with the in-process engine), its answers under
``evals/seed<S>_heldout_96/validation/`` beside this file and one line appended to ``evals.jsonl``, as
``../small/evals.jsonl`` records the sync runs':

    OMP_NUM_THREADS=2 python notebooks/figures/arithmetic/servers/evaluate.py SEED

It reads ``runs/ad_async_s<SEED>/final``. Run from the repository root.
"""

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

seed = sys.argv[1]
label = f"seed{seed}_heldout_96"
out = Path("notebooks/figures/arithmetic/servers/evals") / label
command = [
    *("forge-lightning", "validate", "--config", "configs/arithmetic_cpu.yaml", "--trainer.logger", "false"),
    *("--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out)),
    *("--model.model", f"runs/ad_async_s{seed}/final", "--data.val_part", "heldout"),
    *("--data.val_max_samples", "200", "--data.val_batch_size", "100", "--model.max_new_tokens", "96"),
]
start = time.time()
subprocess.run(command, check=True, capture_output=True)
seconds = round(time.time() - start, 1)
(answers,) = (out / "validation").glob("*.jsonl")  # validate-<model>.jsonl
answers = answers.read_text().splitlines()
rows = [json.loads(line) for line in answers if line.strip()]
record = {
    "label": label,
    "val/accuracy": sum(r["correct"] for r in rows) / len(rows),
    "val/completion_length": sum(r["completion_length"] for r in rows) / len(rows),
    "val/truncated_fraction": sum(r["truncated"] for r in rows) / len(rows),
    "problems": len(rows),
    "seconds": seconds,
    "command": shlex.join(command),
}
with open("notebooks/figures/arithmetic/servers/evals.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
