"""Changes made to a run's learning rate and KL weight midway (a CollapseGuard's, after a rollback).

They are state, not settings: the run's hyperparameters stay as they were given (so a resume's
check of its settings against the checkpoint's is untouched), and the factors travel in the
checkpoint beside them (``forge_adjustments``), so that ``--ckpt_path last`` trains on with them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from forge_lightning.grpo import LossSettings
from forge_lightning.training.optim import set_last_lr

CHECKPOINT_KEY = "forge_adjustments"


@dataclass(frozen=True)
class Adjustments:
    """Factors on the run's settings, from the step they were made on: the peak learning rate is
    the set rate x ``lr_scale`` (the schedule keeps its shape), the KL weight the set one x
    ``kl_beta_scale`` (a weight of 0 stays 0: no reference was set up for it)."""

    lr_scale: float = 1.0
    kl_beta_scale: float = 1.0

    def then(self, lr_scale: float, kl_beta_scale: float) -> Adjustments:
        """These adjustments followed by another one: the factors multiply."""
        return Adjustments(self.lr_scale * lr_scale, self.kl_beta_scale * kl_beta_scale)

    def loss(self, given: LossSettings) -> LossSettings:
        """The loss settings to train with: ``given`` (the hyperparameters') with the KL weight scaled."""
        return (
            given if self.kl_beta_scale == 1.0 else replace(given, kl_beta=given.kl_beta * self.kl_beta_scale)
        )

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Adjustments:
        """The adjustments a checkpoint holds; none (all factors 1) for one that holds none."""
        return cls(**(state or {}))


def scale_learning_rate(scheduler: Any, factor: float) -> list[float]:
    """Multiply the learning rate of ``scheduler``'s optimizer by ``factor`` from now on: each
    parameter group's rate and the schedule's peak (``base_lrs``, ``initial_lr``), so that every
    later step of a warmup, cosine or constant schedule is ``factor`` times what it would have been.
    Returns the rates the optimizer now uses."""
    groups = scheduler.optimizer.param_groups
    for i, group in enumerate(groups):
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
        scheduler.base_lrs[i] = scheduler.base_lrs[i] * factor
    rates = [group["lr"] for group in groups]
    set_last_lr(scheduler, rates)
    return rates
