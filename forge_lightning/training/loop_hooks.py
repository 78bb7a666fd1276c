"""Loop hooks: what the training step tells whoever watches it, and the one place it may be told
to train less.

The step (training/step.py) calls its context's :class:`LoopHooks` at three points of a batch:
``rollouts_end`` once the batch's rollout is in, ``rewards_end`` once it is scored, and
``advantages_end`` once its advantages are made. Only ``rewards_end`` may filter: it returns a keep
mask over the batch's groups, ``(P,)`` bool, or None to keep them all. A dropped group is trained
as if its prompt were not in the batch (:func:`kept_groups`, the path dynamic sampling's dropped
groups take): no policy or KL weight, out of the loss's normaliser, no backward of its own.

On the Lightning side each hook is a callback's (callbacks/rl_loop.py); :class:`NoHooks` is
the context's own when no Trainer runs the step (``StepContext.one_process``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.rollout.types import Rollout


class LoopHooks(Protocol):
    """What the step calls at the end of a batch's rollout, rewards and advantages.

    ``filters`` says whether ``rewards_end`` may return a keep mask; it must be the same on every
    rank (the step then adds one reduce per backward pass, so that a rank that trains fewer
    micro-batches joins the others' all-reduces with zero-weight backwards)."""

    @property
    def filters(self) -> bool: ...

    def rollouts_end(self, rollout: Rollout, batch: TrainingBatch) -> None:
        """The batch's rollout, sampled (``batch.prompts`` and its row fields alongside); read only."""
        ...

    def rewards_end(self, rewards: Tensor, batch: TrainingBatch) -> Tensor | None:
        """The batch's rewards ``(P*G,)``, as scored (before any KL is taken from them); returns a keep mask
        ``(P,)`` bool over its groups, or None to train them all."""
        ...

    def advantages_end(self, advantages: Tensor, batch: TrainingBatch) -> None:
        """The batch's advantages ``(P*G,)``, every group's, zero where ``rewards_end`` dropped
        the group (it is not trained); read only."""
        ...


class NoHooks:
    """No one watches: every hook does nothing and nothing is filtered."""

    filters = False

    def rollouts_end(self, rollout: Rollout, batch: TrainingBatch) -> None:
        pass

    def rewards_end(self, rewards: Tensor, batch: TrainingBatch) -> Tensor | None:
        return None

    def advantages_end(self, advantages: Tensor, batch: TrainingBatch) -> None:
        pass


def checked_keep(keep: Tensor | None, num_prompts: int, where: str) -> Tensor | None:
    """``keep`` as a ``(P,)`` bool mask (None as it is); ValueError naming ``where`` (the hook
    that returned it) for any other shape or dtype."""
    if keep is None:
        return None
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.shape != (num_prompts,):
        shown = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, Tensor) else type(keep).__name__
        raise ValueError(
            f"{where} returned {shown}: a keep mask is a bool tensor of shape ({num_prompts},), "
            "one entry per prompt of the batch (its group of completions), or None to keep them all"
        )
    return keep


def kept_groups(
    keep: Tensor | None, rollout: Rollout, rewards: Tensor, advantages: Tensor
) -> tuple[Rollout, Tensor, Tensor]:
    """The rollout, rewards ``(P*G,)`` and advantages ``(P*G,)`` of the groups where ``keep``
    ``(P,)`` is True; all of them when ``keep`` is None."""
    if keep is None:
        return rollout, rewards, advantages
    keep = keep.to(rollout.prompt_ids.device)
    rows = keep.repeat_interleave(rollout.group_size).to(rewards.device)  # (P*G,)
    return rollout.select_groups(keep), rewards[rows], advantages[rows.to(advantages.device)]


def zero_dropped(keep: Tensor | None, advantages: Tensor, group_size: int) -> Tensor:
    """``advantages`` ``(P*G,)`` with the dropped groups' zeroed (a new tensor; the same one when
    nothing is dropped)."""
    if keep is None:
        return advantages
    rows = keep.to(advantages.device).repeat_interleave(group_size)  # (P*G,)
    return torch.where(rows, advantages, torch.zeros_like(advantages))
