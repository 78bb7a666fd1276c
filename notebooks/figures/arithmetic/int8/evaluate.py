"""Held-out accuracy of an int8 run's final weights (notebooks/arithmetic.ipynb, *A low-precision
sampler*): greedy ``forge-lightning validate`` on the 200 held-out problems at 96 new tokens, in
float32 (the config takes no sampler), its answers under ``evals/seed<S>_heldout_96/validation/`` beside this
file and one line appended to ``evals.jsonl``, as ``../small/evals.jsonl`` records the float32 runs':

    OMP_NUM_THREADS=1 python notebooks/figures/arithmetic/int8/evaluate.py SEED

It reads ``runs/arith_int8_<SEED>/final``. Run from the repository root.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # heldout.py, beside this folder
from heldout import evaluate  # noqa: E402

seed = sys.argv[1]
record = evaluate(Path("notebooks/figures/arithmetic/int8"), f"runs/arith_int8_{seed}/final", seed)
print(json.dumps(record))
