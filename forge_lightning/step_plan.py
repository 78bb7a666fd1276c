"""Step plans: what a training batch trains, and after which of its backward passes the optimizer steps.

The module holds one plan, chosen once from its settings (:func:`step_plan`). :class:`StepPlan`
is plain accumulation (the optimizer steps every ``gradient_accumulation_steps`` batches and at an
epoch's end) with ``num_iterations`` passes over each rollout (mu, each ending a step).
:class:`DynamicSamplingPlan` trains the informative groups only and steps once enough are gathered
over the ranks (DAPO; see sampling_rounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from forge_lightning.grpo import informative_groups
from forge_lightning.optim import total_optimizer_steps
from forge_lightning.rollout import Rollout
from forge_lightning.sampling_rounds import SamplingRounds


@dataclass(frozen=True)
class PlanSettings:
    group_size: int
    gradient_accumulation_steps: int
    num_iterations: int
    dynamic_sampling: bool
    max_sampling_rounds: int


def plan_settings(hp: Any) -> PlanSettings:
    return PlanSettings(
        group_size=hp.group_size,
        gradient_accumulation_steps=hp.gradient_accumulation_steps,
        num_iterations=hp.num_iterations,
        dynamic_sampling=hp.dynamic_sampling,
        max_sampling_rounds=hp.max_sampling_rounds,
    )


def accumulation_boundary(batch_idx: int, accumulation: int, num_training_batches: int | float) -> bool:
    """Whether batch ``batch_idx`` ends an accumulation: each ``accumulation``-th, and the epoch's last."""
    last = batch_idx + 1 == num_training_batches
    return (batch_idx + 1) % accumulation == 0 or last


@dataclass
class BatchPlan:
    """What one batch trains: ``rollout`` (the batch's, or its kept groups) with its
    ``advantages``, and one entry per backward pass over it: whether the optimizer steps after it."""

    rollout: Rollout
    advantages: Tensor
    passes: list[bool]

    @property
    def stepped(self) -> bool:
        return any(self.passes)


class StepPlan:
    """Plain accumulation, ``num_iterations`` passes per rollout (mu > 1 needs accumulation 1)."""

    def __init__(self, settings: PlanSettings) -> None:
        self.settings = settings

    def plan(
        self, rollout: Rollout, rewards: Tensor, advantages: Tensor, batch_idx: int, trainer: Any
    ) -> BatchPlan:
        s = self.settings
        batches = trainer.num_training_batches
        stepped = accumulation_boundary(batch_idx, s.gradient_accumulation_steps, batches)
        return BatchPlan(rollout, advantages, [stepped] * s.num_iterations)  # always stepped, when mu > 1

    def backward_calls_missing(self, made: int, trainer: Any, device: torch.device) -> int:
        """Zero-weight backward calls this rank must add to match the others' all-reduces: none,
        every rank trains the same micro-batches."""
        return 0

    def step_ended(self) -> dict[str, float]:
        """The finished optimizer step's counts, for the metrics (taken or skipped)."""
        return {}

    def total_steps(self, trainer: Any) -> int:
        """Optimizer steps of the whole fit (the schedule's length)."""
        s = self.settings
        accumulation, mu = s.gradient_accumulation_steps, s.num_iterations
        return total_optimizer_steps(trainer, accumulation, mu, s.dynamic_sampling)


class DynamicSamplingPlan(StepPlan):
    """Train on the informative groups only, stepping once the rounds of the step gathered enough."""

    def __init__(self, settings: PlanSettings) -> None:
        super().__init__(settings)
        self.rounds = SamplingRounds(settings.max_sampling_rounds)  # the rounds of the step

    def plan(
        self, rollout: Rollout, rewards: Tensor, advantages: Tensor, batch_idx: int, trainer: Any
    ) -> BatchPlan:
        s = self.settings
        keep = informative_groups(rewards, s.group_size)  # (P,)
        kept = advantages.view(-1, s.group_size)[keep].reshape(-1)
        last = batch_idx + 1 == trainer.num_training_batches
        target = trainer.world_size * keep.numel() * s.gradient_accumulation_steps
        stepped = self.rounds.add_round(keep, trainer.strategy, target=target, last_batch=last)
        return BatchPlan(rollout.select_groups(keep), kept, [stepped])

    def backward_calls_missing(self, made: int, trainer: Any, device: torch.device) -> int:
        if trainer.world_size == 1:
            return 0
        return self.rounds.backward_calls_missing(made, trainer.strategy, device)

    def step_ended(self) -> dict[str, float]:
        return self.rounds.pop()


def step_plan(settings: PlanSettings) -> StepPlan:
    """The plan the settings name."""
    return DynamicSamplingPlan(settings) if settings.dynamic_sampling else StepPlan(settings)
