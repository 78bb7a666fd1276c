"""Before any tool run: how often the untrained embedded model calls the calculator, per style.

8 dev problems of the arithmetic task's ``calc`` variant (seed 0) x 8 samples at temperature 0.8,
128 new tokens, each style with a system message that shows a worked call. Appends one JSON line
per style to probe.jsonl beside this file:

    OMP_NUM_THREADS=1 python notebooks/figures/tools/probe.py plain
    OMP_NUM_THREADS=1 python notebooks/figures/tools/probe.py annotation
"""

import json
import sys
import time
from pathlib import Path

import torch
from forge_lightning.sampling import SamplingParams

from forge_lightning import GRPOLightningModule
from forge_lightning.data.arithmetic import generate
from forge_lightning.rewards import GSM8KAnswerReward

torch.set_num_threads(1)
SYSTEM = {
    "annotation": (
        "Solve the problem step by step. For every calculation, write <<expression= and a calculator "
        "writes the result and >> for you. Example: 23 * 4 = <<23*4=92>>92. End with '#### ' and the answer."
    ),
    "plain": (
        "Solve the problem step by step. Write every calculation as an expression followed by =, and a "
        "calculator writes the result. Example: 23 * 4 = 92. End with '#### ' and the answer."
    ),
}
style = sys.argv[1]
probs = generate(seed=0, variant="calc")["dev"][:8]
m = GRPOLightningModule(
    model="embedded", calculator=style, system_prompt=SYSTEM[style], max_new_tokens=128, kl_beta=0.0
)
m.configure_model()
t = time.time()
r = m.episodes(m.model, [p.question for p in probs], SamplingParams(128, temperature=0.8), group_size=8)
acc = GSM8KAnswerReward()(
    [p.question for p in probs for _ in range(8)],
    r.completions,
    references=[str(p.answer) for p in probs for _ in range(8)],
)
out = {
    "style": style,
    "samples": len(r.completions),
    "seconds": time.time() - t,
    "with_call": int((r.tool_stats["tool_calls"] > 0).sum()),
    "calls": int(r.tool_stats["tool_calls"].sum()),
    "errors": int(r.tool_stats["tool_errors"].sum()),
    "correct": float(sum(acc.scores)),
    "example": r.completions[0],
}
out["system_prompt"] = SYSTEM[style]
print(json.dumps(out))
with open(Path(__file__).with_name("probe.jsonl"), "a") as f:
    f.write(json.dumps(out) + "\n")
