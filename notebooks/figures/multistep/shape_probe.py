"""How often a model's samples solve one problem shape, sampled as the chains stage samples.

The train problems of one template (the chains stage's train part, in the order the stage meets
them: its prompts are drawn by ``data.seed``, the data module's default for every
``--seed_everything``), sampled as configs/multistep_cpu.yaml's chains stage samples (its group
size, temperature and new tokens), with the recipe's system message and the plain calculator.
Appends one JSON line to shape_probe.jsonl beside this file: the right samples of each problem,
the groups with a right one (those give GRPO a gradient), the chains steps at which the stage
meets those problems, and three samples:

    OMP_NUM_THREADS=1 python notebooks/figures/multistep/shape_probe.py MODEL TEMPLATE [N]

MODEL is a run's ``final/`` folder (or ``embedded``); N the first N such problems the stage meets
(all of those in its steps by default). Run from the repository root.
"""

import inspect
import json
import sys
import time
from pathlib import Path

import torch
import yaml
from forge_lightning.sampling import SamplingParams

from forge_lightning import GRPOLightningModule
from forge_lightning.data import GSM8KDataModule
from forge_lightning.data.arithmetic import generate
from forge_lightning.data.epoch_sampler import EpochShuffleSampler
from forge_lightning.rewards import GSM8KAnswerReward

torch.set_num_threads(1)
torch.manual_seed(0)
model, template = sys.argv[1], sys.argv[2]
config = yaml.safe_load(Path("configs/multistep_cpu.yaml").read_text())
[chains] = [stage for stage in config["stages"] if stage["name"] == "chains"]
sampling = {**config["model"], **chains.get("model", {})}
GROUP, TEMPERATURE, NEW_TOKENS = sampling["group_size"], sampling["temperature"], sampling["max_new_tokens"]
STEPS, PROMPTS_PER_STEP = chains["trainer"]["max_steps"], config["data"]["prompts_per_step"]
variant = chains.get("data", {}).get("task_variant", config["data"]["task_variant"])
data_seed = inspect.signature(GSM8KDataModule).parameters["seed"].default
train = generate(seed=0, variant=variant)["train"]
order = list(EpochShuffleSampler(len(train), seed=data_seed, shuffle=True))[: STEPS * PROMPTS_PER_STEP]
met = [(i // PROMPTS_PER_STEP + 1, train[j]) for i, j in enumerate(order) if train[j].template == template]
met = met[: int(sys.argv[3])] if len(sys.argv) > 3 else met
problems = [p for _, p in met]
m = GRPOLightningModule(
    model=model,
    calculator="plain",
    max_tool_calls=4,
    system_prompt=config["model"]["system_prompt"],
    max_new_tokens=NEW_TOKENS,
    kl_beta=0.0,
)
m.configure_model()
start = time.time()
rollout = m.episodes(
    m.model,
    [p.question for p in problems],
    SamplingParams(NEW_TOKENS, temperature=TEMPERATURE),
    group_size=GROUP,
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
