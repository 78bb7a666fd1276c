"""RL loop hooks as Lightning callback hooks: a curriculum or a filter is a callback, not a fork.

A callback subclasses :class:`RLLoopCallback` and overrides any of its three hooks, which the
training step calls (training/step.py, through the context's :class:`TrainerHooks`) once per
trained batch, inside ``training_step``, in this order and on every rank:

- ``on_rollouts_end(trainer, pl_module, rollout, batch)``: the batch's sampled rollout.
- ``on_rewards_end(trainer, pl_module, rewards, batch)``: its rewards ``(P*G,)``, as scored. The
  one hook that may filter: it returns a keep mask ``(P,)`` bool over the batch's prompts (each a
  group of ``G`` completions), or None to keep them all. Several callbacks' masks are and-ed. A
  dropped group is trained as if its prompt were not in the batch: no policy or KL weight, out of
  the loss's normaliser; its rewards still count in the step's reward metrics, and the step
  counts the dropped groups in ``train/groups_filtered``. Each rank drops its own; a rank left
  with fewer micro-batches makes zero-weight backwards, so that every rank joins as many of DDP's
  all-reduces (the rule dynamic sampling follows).
- ``on_advantages_end(trainer, pl_module, advantages, batch)``: its advantages ``(P*G,)``, made
  of every group's rewards (the batch's std, where the advantages take it, is over the dropped groups too),
  then zero for the groups dropped.

``batch`` is the :class:`~forge_lightning.rollout.sources.TrainingBatch` the rollout came from: its
``prompts``, its rows' other fields (``batch_kwargs``) and ``batch_idx``. A hook reads its
tensors and never changes them in place. A callback that filters on what it saw before keeps that
in ``state_dict``/``load_state_dict``, so that a resumed fit filters as the uninterrupted one
would (Lightning saves rank zero's: keep it the same on every rank, e.g. with
``pl_module.all_gather``). Where one generation is split into S > 1 optimizer steps, a batch
must keep at least S x (batches per step) groups (its generation's shares).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.rollout.types import Rollout
from forge_lightning.training.loop_hooks import checked_keep


class RLLoopCallback(Callback):
    """A Lightning callback with the RL loop's hooks; each does nothing until overridden."""

    def on_rollouts_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollout: Rollout, batch: TrainingBatch
    ) -> None:
        """The batch's rollout, sampled: read only."""

    def on_rewards_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rewards: Tensor, batch: TrainingBatch
    ) -> Tensor | None:
        """The batch's rewards ``(P*G,)``: a keep mask ``(P,)`` bool over its groups, or None (all)."""
        return None

    def on_advantages_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, advantages: Tensor, batch: TrainingBatch
    ) -> None:
        """The batch's advantages ``(P*G,)`` (zero for the groups dropped): read only."""


class TrainerHooks:
    """The context's loop hooks in a fit (training/loop_hooks.py's LoopHooks): each calls that
    hook of every :class:`RLLoopCallback` of ``trainer``, in the trainer's callback order."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.pl_module = trainer, pl_module
        self.callbacks: Sequence[RLLoopCallback] = [
            c for c in trainer.callbacks if isinstance(c, RLLoopCallback)
        ]

    @property
    def filters(self) -> bool:
        """Whether a callback overrides ``on_rewards_end`` (every rank holds the same callbacks)."""
        return any(type(c).on_rewards_end is not RLLoopCallback.on_rewards_end for c in self.callbacks)

    def rollouts_end(self, rollout: Rollout, batch: TrainingBatch) -> None:
        for callback in self.callbacks:
            callback.on_rollouts_end(self.trainer, self.pl_module, rollout, batch)

    def rewards_end(self, rewards: Tensor, batch: TrainingBatch) -> Tensor | None:
        keep: Tensor | None = None
        num_prompts = len(batch.prompts)
        for callback in self.callbacks:
            returned = callback.on_rewards_end(self.trainer, self.pl_module, rewards, batch)
            mask = checked_keep(returned, num_prompts, f"{type(callback).__name__}.on_rewards_end")
            if mask is not None:
                keep = mask if keep is None else keep & mask.to(keep.device)
        return keep

    def advantages_end(self, advantages: Tensor, batch: TrainingBatch) -> None:
        for callback in self.callbacks:
            callback.on_advantages_end(self.trainer, self.pl_module, advantages, batch)
