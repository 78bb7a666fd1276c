"""Held-out accuracy of a trained arithmetic run, for the evaluation scripts of
notebooks/arithmetic.ipynb (``int8/evaluate.py``, ``servers/evaluate.py``): greedy
``forge-lightning validate`` of ``configs/arithmetic_cpu.yaml`` on the 200 held-out problems at 96
new tokens, its answers under ``<folder>/evals/seed<S>_heldout_96/validation/`` and one line
appended to ``<folder>/evals.jsonl``, as ``small/evals.jsonl`` records the sync runs'.
"""

import json
import shlex
import subprocess
import time
from pathlib import Path


def evaluate(folder: Path, model: str, seed: str) -> dict:
    """Evaluate ``model`` (a run's ``final/`` folder) and record it as seed ``seed``'s in ``folder``."""
    label = f"seed{seed}_heldout_96"
    out = folder / "evals" / label
    command = [
        *("forge-lightning", "validate", "--config", "configs/arithmetic_cpu.yaml"),
        *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
        *("--trainer.default_root_dir", str(out)),
        *("--model.model", model, "--data.val_part", "heldout"),
        *("--data.val_max_samples", "200", "--data.val_batch_size", "100", "--model.max_new_tokens", "96"),
    ]
    start = time.time()
    subprocess.run(command, check=True, capture_output=True)
    seconds = round(time.time() - start, 1)
    (answers,) = (out / "validation").glob("*.jsonl")  # validate-<model>.jsonl
    rows = [json.loads(line) for line in answers.read_text().splitlines() if line.strip()]
    record = {
        "label": label,
        "val/accuracy": sum(r["correct"] for r in rows) / len(rows),
        "val/completion_length": sum(r["completion_length"] for r in rows) / len(rows),
        "val/truncated_fraction": sum(r["truncated"] for r in rows) / len(rows),
        "problems": len(rows),
        "seconds": seconds,
        "command": shlex.join(command),
    }
    with open(folder / "evals.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record
