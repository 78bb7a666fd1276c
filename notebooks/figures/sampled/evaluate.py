"""Sampled held-out evaluations of (Q): ``forge-lightning validate`` of one model under
configs/arithmetic_cpu.yaml on the 200 held-out problems, greedy and 16 samples per problem at
temperature 0.8; the answers file is copied to ``evals/<label>.jsonl`` beside this file and the
command and its wall time are recorded in ``evals.jsonl`` (notebooks/sampled.ipynb reads both and
computes every metric from the answers):

    OMP_NUM_THREADS=1 python notebooks/figures/sampled/evaluate.py LABEL MODEL [EXTRA FLAGS...]

MODEL is ``embedded`` (the base model) or a run's ``final/`` folder. Run from the repository root.
"""

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

label, model, *extra = sys.argv[1:]
with tempfile.TemporaryDirectory() as out:
    command = [
        "forge-lightning",
        "validate",
        "--config",
        "configs/arithmetic_cpu.yaml",
        "--model.model",
        model,
        "--data.val_part",
        "heldout",
        "--data.val_max_samples",
        "200",
        "--data.val_batch_size",
        "25",
        "--model.val_num_generations",
        "16",
        "--model.val_temperature",
        "0.8",
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run([*command, "--trainer.default_root_dir", out], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    (answers,) = Path(out, "validation").glob("*.jsonl")
    (HERE / "evals").mkdir(exist_ok=True)
    shutil.copy(answers, HERE / "evals" / f"{label}.jsonl")
rows = [json.loads(line) for line in (HERE / "evals" / f"{label}.jsonl").read_text().splitlines()]
record = {"label": label, "command": shlex.join(command), "problems": len(rows), "seconds": round(seconds, 1)}
record["greedy_accuracy"] = sum(r["correct"] for r in rows) / len(rows)
with open(HERE / "evals.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
