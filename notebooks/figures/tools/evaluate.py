"""Held-out evaluations of the calculator runs of notebooks/tools.ipynb: greedy ``forge-lightning validate`` of one model
under one config, its answers copied to ``evals/<label>.jsonl`` beside this file and the command
recorded in ``evals.jsonl`` (notebooks/tools.ipynb reads both):

    OMP_NUM_THREADS=1 python notebooks/figures/tools/evaluate.py LABEL MODEL [tools|no_tools] [EXTRA FLAGS...]

``tools``: configs/calculator_cpu.yaml (B's system message and the calculator); ``no_tools``: with
configs/ablations/calculator_no_tools.yaml after it (A's system message, no calculator). MODEL is
``embedded`` or a run's ``final/`` folder. Run from the repository root.
"""

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "tools": ["--config", "configs/calculator_cpu.yaml"],
    "no_tools": [
        "--config",
        "configs/calculator_cpu.yaml",
        "--config",
        "configs/ablations/calculator_no_tools.yaml",
    ],
}

DEFAULTS = {"--data.val_part": "heldout", "--data.val_max_samples": "200", "--data.val_batch_size": "50"}

label, model, setup, *extra = sys.argv[1:]
# EXTRA FLAGS replace the defaults of the same name: the command recorded gives each flag once.
flags = {**DEFAULTS, "--model.model": model, **dict(zip(extra[::2], extra[1::2]))}
with tempfile.TemporaryDirectory() as out:
    command = ["forge-lightning", "validate", *CONFIGS[setup], *(w for pair in flags.items() for w in pair)]
    done = subprocess.run([*command, "--trainer.default_root_dir", out], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    (answers,) = Path(out, "validation").glob("*.jsonl")
    (HERE / "evals").mkdir(exist_ok=True)
    shutil.copy(answers, HERE / "evals" / f"{label}.jsonl")
rows = [json.loads(line) for line in (HERE / "evals" / f"{label}.jsonl").read_text().splitlines()]
record = {"label": label, "command": shlex.join(command), "problems": len(rows)}
record["accuracy"] = sum(r["correct"] for r in rows) / len(rows)
with open(HERE / "evals.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
