"""Held-out accuracy of an async run on a rollout server (notebooks/arithmetic.ipynb, *On a rollout
server*): greedy ``forge-lightning validate`` on the 200 held-out problems at 96 new tokens, in this
process (validation samples with the in-process engine), its answers under
``evals/seed<S>_heldout_96/validation/`` beside this file and one line appended to ``evals.jsonl``, as
``../small/evals.jsonl`` records the sync runs':

    OMP_NUM_THREADS=2 python notebooks/figures/arithmetic/servers/evaluate.py SEED

It reads ``runs/ad_async_s<SEED>/final``. Run from the repository root.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # heldout.py, beside this folder
from heldout import evaluate  # noqa: E402

seed = sys.argv[1]
record = evaluate(Path("notebooks/figures/arithmetic/servers"), f"runs/ad_async_s{seed}/final", seed)
print(json.dumps(record))
