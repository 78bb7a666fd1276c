"""One optimizer step of the tiny module per loss type under DDP, one prompt per rank; rank 0
saves the step's gradient (after DDP's all-reduce, before the optimizer) to ``OUT/<loss>.pt``.
With ``dynamic``, one step with dynamic sampling where the ranks gather their informative groups
in different rounds (rank 0's first prompt is uninformative), saved to ``OUT/dynamic.pt``. With
``tools``, one step of calculator rollouts where rank 0's completions take up to three rounds and
rank 1's one (helpers.engines.CalculatorCalls), saved to ``OUT/tools-<loss>.pt``. The default mode also
runs each loss type with ``steps_per_generation`` 2 on two prompts per rank (the rank's record
first, then another), saving the first of its two steps' gradients to ``OUT/spg-<loss>.pt``, and
``grpo`` with micro-batches by a token budget under which rank 0 makes 2 and rank 1 makes 4
(``OUT/tokens-grpo.pt``). With ``levers``, one step per set of algorithm levers in ``LEVERS``
(each lever in one of them: advantage estimators, loss types, the entropy bonus, the KL in the
reward), saved to ``OUT/lever-<name>.pt``. With ``curriculum``, one step under a
SettledPromptFilter that remembers rank 0's prompt as always solved: rank 0 drops its one group
and trains nothing, rank 1 its own; saved to ``OUT/curriculum.pt``, with each rank's curriculum
history after the step in ``OUT/curriculum-history-<rank>.pt``.

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/helpers/ddp_gradients.py OUT ROOT [dynamic|tools|levers|curriculum]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from forge_lightning.callbacks.settled_prompt_filter import SettledPromptFilter, prompt_keys
from forge_lightning.data.datamodule import collate_records
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.run.process_group import release_process_group
from helpers.engines import CalculatorCalls, FixedCompletions
from helpers.gradients import exact_settings, gradient_spy, other_reference

RECORDS = [{"prompt": "ab"}, {"prompt": "abc d"}]
# The second prompt of each rank's generation with steps_per_generation 2 (trained in step 2).
LATER_RECORDS = [{"prompt": "bb a"}, {"prompt": "cab"}]
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "forge")
TOOL_SETTINGS = dict(calculator="annotation", max_new_tokens=24, group_size=3)
# Rank r trains on records r and r + 2 (its own loader, no DistributedSampler): rank 0 on p0 (flat),
# then p2; rank 1 on p1, then p3.
DYNAMIC_RECORDS = [{"prompt": f"p{i}", "kind": "flat" if i == 0 else "live"} for i in range(4)]
# Every algorithm lever, two runs holding them all (a run of its own each would triple the time).
LEVERS = {
    "reinforce_pp-cispo-entropy": {
        "advantage_estimator": "reinforce_pp",
        "advantage_scale": "none",
        "loss_type": "cispo",
        "entropy_coef": 0.1,
    },
    "rloo-sapo-kl_in_reward": {"advantage_estimator": "rloo", "loss_type": "sapo", "kl_in_reward": True},
}


def flat_or_live(prompts: list[str], responses: list[str], kind: list[str]) -> list[float]:
    """0 for every completion of a "flat" prompt (an uninformative group), 0/1 alternating otherwise."""
    return [0.0 if k == "flat" else float(i % 2) for i, k in enumerate(kind)]


def main(out: Path, root: Path, mode: str = "") -> None:
    rank = int(os.environ["RANK"])
    if mode == "dynamic":
        runs = [("dynamic", DYNAMIC_RECORDS[rank::2], {"reward": flat_or_live, "dynamic_sampling": True})]
    elif mode == "curriculum":
        runs = [("curriculum", RECORDS[rank::2], {})]
    elif mode == "levers":
        runs = [(f"lever-{name}", RECORDS[rank::2], settings) for name, settings in LEVERS.items()]
    elif mode == "tools":
        runs = [
            (f"tools-{loss}", RECORDS[rank::2], {"loss_type": loss, **TOOL_SETTINGS})
            for loss in ("grpo", "dapo")
        ]
    else:
        runs = [(loss, RECORDS[rank::2], {"loss_type": loss}) for loss in LOSS_TYPES]
        generation = [RECORDS[rank], LATER_RECORDS[rank]]
        runs += [
            (f"spg-{loss}", generation, {"loss_type": loss, "steps_per_generation": 2}) for loss in LOSS_TYPES
        ]
        runs += [("tokens-grpo", RECORDS[rank::2], {"loss_type": "grpo", "train_micro_batch_tokens": 12})]
    for name, records, settings in runs:
        steps = settings.get("steps_per_generation", 1)
        pl.seed_everything(1)
        grpo = GRPOLightningModule(**exact_settings(**settings))
        if mode == "tools":
            grpo.engine = CalculatorCalls(grpo.tokenizer)
        else:
            grpo.engine = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
        grads: list[torch.Tensor] = []
        curriculum = [solved_first_prompt()] if mode == "curriculum" else []
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root / name,
            callbacks=[other_reference(), gradient_spy(grads), *curriculum],
            use_distributed_sampler=False,  # each rank's records are fixed above
        )
        trainer.fit(grpo, DataLoader(records, batch_size=steps, collate_fn=collate_records))
        if trainer.is_global_zero:
            first_step = grads[: len(grads) // steps]
            torch.save(first_step, out / f"{name}.pt")
        for callback in curriculum:
            torch.save(callback.history, out / f"curriculum-history-{rank}.pt")


def solved_first_prompt() -> SettledPromptFilter:
    """A curriculum that remembers one group of ``RECORDS[0]``'s prompt, every completion passing."""
    curriculum = SettledPromptFilter(window=2, min_visits=1)
    key = int(prompt_keys(TrainingBatch([RECORDS[0]["prompt"]], {}, 0))[0])
    curriculum.load_state_dict({"history": {key: [1.0]}})
    return curriculum


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:])
    release_process_group()  # else a rank may abort at exit (run/process_group.py)
