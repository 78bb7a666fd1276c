"""The padding of the loss's forwards on configs/arithmetic_cpu.yaml's real length mix: the run's
first steps under one micro-batch setting, ``perf/padding_fraction`` of each step read from its
TensorBoard events and appended as one line to ``padding_cpu.jsonl`` beside this file
(notebooks/throughput.ipynb tables it):

    OMP_NUM_THREADS=1 python notebooks/figures/bench/padding.py LABEL STEPS [FLAGS...]

FLAGS go to ``forge-lightning fit`` after the config, e.g. ``--model.train_micro_batch_tokens
1536``. Every setting samples the same completions at step 1 (same seed); later steps follow
each run's own updates, which the micro-batching changes only to float tolerance. Run from the
repository root.
"""

import datetime
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

HERE = Path(__file__).resolve().parent
label, steps, *flags = sys.argv[1:]
command = [
    *("forge-lightning", "fit", "--config", "configs/arithmetic_cpu.yaml", "--trainer.max_steps", steps),
    *("--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false", "--checkpoint", "null"),
    *flags,
]
with tempfile.TemporaryDirectory() as out:
    done = subprocess.run([*command, "--trainer.default_root_dir", out], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    (folder,) = Path(out, "tensorboard").glob("version_*")
    events = EventAccumulator(str(folder))
    events.Reload()
    tags = ("perf/padding_fraction", "train/completion_length")
    series = {tag: [e.value for e in events.Scalars(tag)] for tag in tags}
record = {
    "label": label,
    "date": datetime.date.today().isoformat(),
    "command": shlex.join(command),
    "padding_fraction": series["perf/padding_fraction"],
    "completion_length": series["train/completion_length"],
}
with open(HERE / "padding_cpu.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
