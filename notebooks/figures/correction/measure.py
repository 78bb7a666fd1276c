"""How far the sampler's log-probs are from the trainer's here, as (R) logs them: short runs of
configs/arithmetic_cpu.yaml with ``rollout_correction: mask``, each run's training log copied to
``<label>.jsonl`` beside this file and its command recorded in ``runs.jsonl``
(notebooks/throughput.ipynb tables ``train/sampler_kl`` and the correction metrics from them):

    python notebooks/figures/correction/measure.py [LABEL ...]

- ``async_lag0``: the async worker at max_staleness 0: its generate scores against the trainer's
  recomputation on the same weights (fp32, CPU);
- ``sync_hf``: HF generate's own scores against the trainer's, in one process;
- ``sync_top_p``: the same at top_p 0.9: the sampler's truncated distribution against the whole one;
- ``async_lag1``: the worker at max_staleness 1: a rollout of the weights one step older.

Run from the repository root; each run's folder is deleted once its log is copied.
"""

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = [
    "forge-lightning",
    "fit",
    "--config",
    "configs/arithmetic_cpu.yaml",
    "--trainer.max_steps",
    "5",
    "--trainer.limit_val_batches",
    "0",
    "--trainer.enable_checkpointing",
    "false",
    "--checkpoint",
    "null",
    "--hf_checkpoint",
    "null",
    "--data.prompts_per_step",
    "2",
    "--model.rollout_correction",
    "mask",
]
RUNS = {
    "async_lag0": ["--model.rollout_mode", "async", "--model.max_staleness", "0"],
    "sync_hf": [],
    "sync_top_p": ["--model.top_p", "0.9"],
    "async_lag1": ["--model.rollout_mode", "async", "--model.max_staleness", "1"],
}

for label in sys.argv[1:] or list(RUNS):
    root = Path("runs") / f"correction_{label}"
    shutil.rmtree(root, ignore_errors=True)
    command = [*BASE, *RUNS[label], "--trainer.default_root_dir", str(root)]
    started = time.time()
    subprocess.run(command, check=True)
    shutil.copy(root / "training_log.jsonl", HERE / f"{label}.jsonl")
    line = {"label": label, "command": shlex.join(command), "wall_s": round(time.time() - started, 1)}
    with open(HERE / "runs.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")
    shutil.rmtree(root)
