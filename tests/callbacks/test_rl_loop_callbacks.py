"""The RL loop hooks on the Lightning side: a trainer's RLLoopCallbacks, called in its order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from forge_lightning.callbacks import RLLoopCallback
from forge_lightning.callbacks.rl_loop import TrainerHooks
from forge_lightning.rollout.sources import TrainingBatch

BATCH = TrainingBatch(["p", "q", "r"], {}, 0)  # three prompts, G = 2
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # (P*G,)


class Keeps(RLLoopCallback):
    def __init__(self, name: str, keep: list[bool] | None, heard: list[tuple]) -> None:
        self.name, self.keep, self.heard = name, keep, heard

    def on_rollouts_end(self, trainer, pl_module, rollout, batch):
        self.heard.append((self.name, "rollouts_end", trainer, pl_module, rollout, batch))

    def on_rewards_end(self, trainer, pl_module, rewards, batch):
        self.heard.append((self.name, "rewards_end", trainer, pl_module, rewards, batch))
        return None if self.keep is None else torch.tensor(self.keep)

    def on_advantages_end(self, trainer, pl_module, advantages, batch):
        self.heard.append((self.name, "advantages_end", trainer, pl_module, advantages, batch))


class Reads(RLLoopCallback):
    """Overrides no filter: the hooks then do not filter."""

    def on_advantages_end(self, trainer, pl_module, advantages, batch):
        self.advantages = advantages


def hooks_of(*callbacks: Callback) -> TrainerHooks:
    return TrainerHooks(SimpleNamespace(callbacks=list(callbacks)), pl_module="the module")


def test_each_hook_calls_every_loop_callback_in_the_trainers_order_and_ands_their_masks():
    heard: list[tuple] = []
    hooks = hooks_of(
        Keeps("a", [True, False, True], heard), Callback(), Keeps("b", [True, True, False], heard)
    )
    trainer, rollout, advantages = hooks.trainer, object(), torch.zeros(6)
    assert hooks.filters
    hooks.rollouts_end(rollout, BATCH)
    keep = hooks.rewards_end(REWARDS, BATCH)
    hooks.advantages_end(advantages, BATCH)
    assert keep.tolist() == [True, False, False]
    assert [(name, hook) for name, hook, *_ in heard] == [
        (name, hook) for hook in ("rollouts_end", "rewards_end", "advantages_end") for name in "ab"
    ]
    assert all(t is trainer and m == "the module" and b is BATCH for _, _, t, m, _, b in heard)
    assert [h[4] for h in heard] == [rollout, rollout, REWARDS, REWARDS, advantages, advantages]


def test_callbacks_that_only_read_or_return_none_filter_nothing():
    reads = Reads()
    hooks = hooks_of(reads, Callback())
    assert not hooks.filters
    assert hooks.rewards_end(REWARDS, BATCH) is None
    hooks.advantages_end(torch.ones(6), BATCH)
    assert reads.advantages.tolist() == [1.0] * 6
    assert hooks_of(Keeps("a", None, [])).rewards_end(REWARDS, BATCH) is None


def test_a_callbacks_keep_mask_of_the_wrong_shape_names_the_callback():
    with pytest.raises(ValueError, match=r"Keeps.on_rewards_end returned torch.bool \(2,\)"):
        hooks_of(Keeps("a", [True, False], [])).rewards_end(REWARDS, BATCH)
