"""A filter of settled prompts as a callback: stop training on prompts the policy always or never solves.

GRPO learns nothing from a group whose completions all pass or all fail (equal rewards, zero
advantages), yet such a group still costs its backward and, with a KL penalty, pulls toward the
reference. :class:`SettledPromptFilter` (first named ``DifficultyCurriculum``) remembers, per
prompt, the pass rate of each of its last ``window`` groups and drops the prompts whose remembered
groups all passed or all failed, through the RL loop's ``on_rewards_end`` filter (rl_loop.py). Add
it from a config::

    trainer:
      callbacks:
        - class_path: forge_lightning.callbacks.SettledPromptFilter
          init_args: {window: 4, min_visits: 2, threshold: 0.5}

What dropping means: the prompt is still sampled and scored (the filter runs after
the rewards), and only left out of this step's loss, at zero weight (``train/groups_filtered``
counts it). That is exact and cheap to resume, and its visit is still recorded, so a prompt the
policy starts to get wrong (or right) comes back. Saving the generation too would take a data
hook (a sampler that skips prompts), which the loop hooks do not offer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from forge_lightning._moved import renamed
from forge_lightning.callbacks.rl_loop import RLLoopCallback
from forge_lightning.rollout.sources import TrainingBatch


class SettledPromptFilter(RLLoopCallback):
    """Drops, from each batch, the prompts whose last ``window`` groups all passed or all failed.

    A completion passes when its reward is above ``threshold``; a group's pass rate is the share
    of its ``G`` completions that passed. A prompt is dropped when it has at least ``min_visits``
    remembered groups and their pass rates are all 1 or all 0. The decision reads the visits
    before this one (the batch's own rewards are then recorded, dropped or not), so every rank
    decides from the same history.

    The history is every rank's: each batch's keys and pass rates are gathered over the ranks
    (the ranks' batches must hold as many prompts, as the datamodule's sampler makes them), so
    the state rank zero saves in the checkpoint is every rank's, and a resumed fit drops what the
    uninterrupted one would.

    Args:
        window: the groups remembered per prompt (the latest ones), at least 1.
        min_visits: remembered groups before a prompt may be dropped, from 1 to ``window``.
        threshold: a completion whose reward is above it passes.
        key: a row field that names the prompt (an id column); None: the prompt itself (its
            text, or its chat messages), hashed.
    """

    def __init__(
        self, window: int = 4, min_visits: int = 2, threshold: float = 0.5, key: str | None = None
    ) -> None:
        if window < 1:
            raise ValueError(f"SettledPromptFilter: window must be at least 1, got {window}")
        if not 1 <= min_visits <= window:
            raise ValueError(
                f"SettledPromptFilter: min_visits must be from 1 to window={window}, got {min_visits}"
            )
        self.window, self.min_visits, self.threshold, self.key = window, min_visits, threshold, key
        self.history: dict[int, list[float]] = {}  # prompt key -> pass rates of its latest groups

    @property
    @override
    def state_key(self) -> str:
        """Its settings in the key of its checkpoint state, so that two filters keep theirs apart;
        under the name it was first saved with, so that a checkpoint of then resumes its history."""
        settings = dict(
            window=self.window, min_visits=self.min_visits, threshold=self.threshold, key=self.key
        )
        name = "DifficultyCurriculum" if type(self) is SettledPromptFilter else type(self).__qualname__
        return f"{name}{settings}"

    @override
    def on_rewards_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rewards: Tensor, batch: TrainingBatch
    ) -> Tensor | None:
        keys = prompt_keys(batch, self.key)  # (P,) int64
        rates = (rewards.detach().view(len(keys), -1) > self.threshold).float().mean(dim=1)  # (P,)
        keep = torch.tensor([not self.settled(k) for k in keys.tolist()], dtype=torch.bool)
        if trainer.world_size > 1:  # every rank's visits, rank zero's first, on every rank
            keys = pl_module.all_gather(keys.to(pl_module.device)).reshape(-1).cpu()
            rates = pl_module.all_gather(rates.to(pl_module.device)).reshape(-1).cpu()
        for k, rate in zip(keys.tolist(), rates.tolist()):
            self.visit(k, rate)
        return keep

    def settled(self, key: int) -> bool:
        """Whether the prompt's remembered groups (at least ``min_visits``) all passed or all failed."""
        rates = self.history.get(key, [])
        return len(rates) >= self.min_visits and (
            all(r == 1.0 for r in rates) or all(r == 0.0 for r in rates)
        )

    def visit(self, key: int, rate: float) -> None:
        """Remember a group's pass rate for the prompt ``key``, forgetting all but the latest ``window``."""
        self.history[key] = [*self.history.get(key, []), rate][-self.window :]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {int(k): list(v) for k, v in state_dict["history"].items()}


def prompt_keys(batch: TrainingBatch, field: str | None = None) -> Tensor:
    """A stable 64-bit key per prompt of ``batch`` ``(P,)`` int64: a hash of its row's ``field``,
    or of the prompt itself; the same in every process (Python's ``hash`` of a str is not)."""
    if field is not None and field not in batch.batch_kwargs:
        raise KeyError(f"key={field!r} is not a field of the batch's rows: {sorted(batch.batch_kwargs)}")
    values = batch.prompts if field is None else batch.batch_kwargs[field]
    keys = []
    for value in values:
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(keys, dtype=torch.int64)


__getattr__ = renamed(__name__, {"DifficultyCurriculum": "SettledPromptFilter"})
