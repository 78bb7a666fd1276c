"""Cheap probes before any multi-step run: one system message (and model) on the ``multistep``
variant's dev part, sampled as a training step samples, to see whether GRPO would get a signal.

16 dev problems (seed 0) x 8 samples at temperature 0.8 (or another), 160 new tokens, the plain calculator.
Appends one JSON line to probe.jsonl beside this file: the mean reward, the groups with at least
one right answer (those give GRPO a gradient), calls per sample, and one sample:

    OMP_NUM_THREADS=1 python notebooks/figures/multistep/probe.py PROMPT [MODEL [TEMPERATURE]]

PROMPT is a key of SYSTEM below; MODEL is ``embedded`` (default) or a run's ``final/`` folder;
TEMPERATURE 0.8 by default.
Run from the repository root.
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
TOM = (
    "Problem: Tom buys 23 boxes with 4 pens in each box. He gives 15 pens away. How many pens does he have?\n"
)
SYSTEM = {
    # configs/calculator_cpu.yaml's: a two-step worked example, one calculation a line.
    "calc": (
        "Solve the problem with one short calculation per line, then end with the line Answer: <number>. "
        "Write each calculation as an expression followed by =, and a calculator writes the result for "
        "you. Example:\n" + TOM + "23 * 4 = 92\n92 - 15 = 77\nAnswer: 77"
    ),
    # A three-step example, and the rule that every number of the problem is used.
    "chain": (
        "Solve the problem with one short calculation per line, then end with the line Answer: <number>. "
        "Write each calculation as an expression followed by =, and a calculator writes the result for "
        "you. Use every number in the problem. Example:\n"
        "Problem: Tom buys 23 boxes with 4 pens in each box. He gives 15 pens away and then finds 8 more "
        "pens. How many pens does he have?\n23 * 4 = 92\n92 - 15 = 77\n77 + 8 = 85\nAnswer: 85"
    ),
    # Three worked examples, one of each way results combine (a sum then a product, two products
    # then their sum, a product then a difference), in stories none of the task's templates tells.
    "fewshot": (
        "Solve the problem with one short calculation per line, then end with the line Answer: <number>. "
        "Write each calculation as an expression followed by =, and a calculator writes the result for "
        "you. Examples:\n"
        "Problem: A bus makes 14 trips in the morning and 11 trips in the afternoon. It carries 30 people "
        "on each trip. How many people does it carry?\n14 + 11 = 25\n25 * 30 = 750\nAnswer: 750\n\n"
        "Problem: A shop sells 7 shirts for 12 dollars each and 5 hats for 9 dollars each. How many "
        "dollars does the shop get?\n7 * 12 = 84\n5 * 9 = 45\n84 + 45 = 129\nAnswer: 129\n\n"
        + TOM
        + "23 * 4 = 92\n92 - 15 = 77\nAnswer: 77"
    ),
    # The whole problem as one expression: one call.
    "compound": (
        "Write the whole problem as one expression with parentheses, followed by =, and a calculator "
        "writes the result for you. Then end with the line Answer: <number>. Example:\n"
        + TOM
        + "23 * 4 - 15 = 77\nAnswer: 77"
    ),
}
prompt, model = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "embedded")
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.8
problems = generate(seed=0, variant="multistep")["dev"][:16]
m = GRPOLightningModule(
    model=model,
    calculator="plain",
    max_tool_calls=4,
    system_prompt=SYSTEM[prompt],
    max_new_tokens=160,
    kl_beta=0.0,
)
m.configure_model()
start = time.time()
rollout = m.episodes(
    m.model, [p.question for p in problems], SamplingParams(160, temperature=temperature), group_size=8
)
scores = GSM8KAnswerReward()(
    [p.question for p in problems for _ in range(8)],
    rollout.completions,
    references=[str(p.answer) for p in problems for _ in range(8)],
).scores
calls = rollout.tool_stats["tool_calls"]
out = {
    "prompt": prompt,
    "model": model,
    "temperature": temperature,
    "samples": len(rollout.completions),
    "seconds": round(time.time() - start, 1),
    "accuracy": sum(scores) / len(scores),
    "groups_with_a_right_answer": sum(any(scores[i : i + 8]) for i in range(0, len(scores), 8)),
    "calls_per_sample": float(calls.float().mean()),
    "samples_with_two_calls": int((calls >= 2).sum()),
    "example": rollout.completions[0],
    "right_by_template": {
        t: sum(s for p, s in zip([p for p in problems for _ in range(8)], scores) if p.template == t)
        for t in dict.fromkeys(p.template for p in problems)
    },
    "system_prompt": SYSTEM[prompt],
}
print(json.dumps(out))
with open(Path(__file__).with_name("probe.jsonl"), "a") as f:
    f.write(json.dumps(out) + "\n")
