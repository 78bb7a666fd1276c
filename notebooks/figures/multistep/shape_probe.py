"""How often a model's samples solve one problem shape, sampled as the chains stage samples.

The train problems of one template (``multistep_mixed``'s train part, in the order the chains stage
meets them: its prompts are drawn by ``data.seed``, 42 for every ``--seed_everything``), 16
samples each at temperature 1.0, 64 new tokens, the recipe's system message and the plain
calculator. Appends one JSON line to shape_probe.jsonl beside this file: the right samples of
each problem, the groups with a right one (those give GRPO a gradient), the chains steps at which
the stage meets those problems, and three samples:

    OMP_NUM_THREADS=1 python notebooks/figures/multistep/shape_probe.py MODEL TEMPLATE [N]

MODEL is a run's ``final/`` folder (or ``embedded``); N the first N such problems the stage meets
(all of those in its 60 steps by default). Run from the repository root.
"""

import json
import sys
import time
from pathlib import Path

import torch
import yaml
from forge_lightning.sampling import SamplingParams

from forge_lightning import GRPOLightningModule
from forge_lightning.data.arithmetic import generate
from forge_lightning.data.epoch_sampler import EpochShuffleSampler
from forge_lightning.rewards import GSM8KAnswerReward

torch.set_num_threads(1)
torch.manual_seed(0)
GROUP, STEPS, PROMPTS_PER_STEP = 16, 60, 4
model, template = sys.argv[1], sys.argv[2]
config = yaml.safe_load(Path("configs/multistep_cpu.yaml").read_text())
train = generate(seed=0, variant="multistep_mixed")["train"]
order = list(EpochShuffleSampler(len(train), seed=42, shuffle=True))[: STEPS * PROMPTS_PER_STEP]
met = [(i // PROMPTS_PER_STEP + 1, train[j]) for i, j in enumerate(order) if train[j].template == template]
met = met[: int(sys.argv[3])] if len(sys.argv) > 3 else met
problems = [p for _, p in met]
m = GRPOLightningModule(
    model=model,
    calculator="plain",
    max_tool_calls=4,
    system_prompt=config["model"]["system_prompt"],
    max_new_tokens=64,
    kl_beta=0.0,
)
m.configure_model()
start = time.time()
rollout = m.episodes(
    m.model, [p.question for p in problems], SamplingParams(64, temperature=1.0), group_size=GROUP
)
scores = GSM8KAnswerReward()(
    [p.question for p in problems for _ in range(GROUP)],
    rollout.completions,
    references=[str(p.answer) for p in problems for _ in range(GROUP)],
).scores
right = [int(sum(scores[i : i + GROUP])) for i in range(0, len(scores), GROUP)]
out = {
    "model": model,
    "template": template,
    "chains_steps": [step for step, _ in met],
    "right_per_problem": right,
    "groups_with_a_right_answer": sum(r > 0 for r in right),
    "samples": len(scores),
    "seconds": round(time.time() - start, 1),
    "examples": rollout.completions[:3],
}
print(json.dumps(out))
with open(Path(__file__).with_name("shape_probe.jsonl"), "a") as f:
    f.write(json.dumps(out) + "\n")
