"""Step plans: what a training batch trains, and after which of its backward passes the optimizer steps.

The module holds one plan, chosen once from its settings (:func:`step_plan`). :class:`StepPlan`
is plain accumulation (the optimizer steps every ``accumulation`` batches and at an epoch's end)
with ``passes`` passes over each rollout (mu, each ending a step), and with ``shares`` S > 1 one
batch's generation split into S optimizer steps (:func:`generation_shares`).
:class:`DynamicSamplingPlan` trains the informative groups only and steps once enough are
gathered over the ranks (DAPO; see training/dynamic_sampling.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from forge_lightning.grpo import informative_groups
from forge_lightning.rollout.sources import accumulation_boundary
from forge_lightning.rollout.types import Rollout
from forge_lightning.run.fit import FitShape
from forge_lightning.training.context import StepContext
from forge_lightning.training.dynamic_sampling import SamplingRounds
from forge_lightning.training.optim import total_optimizer_steps


@dataclass(frozen=True)
class Pass:
    """One backward pass of a batch: over its prompts ``groups`` (a slice of the prompts; None:
    all of them), then an optimizer step when ``step_after``."""

    groups: slice | None
    step_after: bool

    def rows(self, group_size: int) -> slice:
        """The completion rows of the pass's prompts."""
        if self.groups is None:
            return slice(None)
        return slice(self.groups.start * group_size, self.groups.stop * group_size)


@dataclass
class BatchPlan:
    """What one batch trains: ``rollout`` (the batch's, or its kept groups) with its
    ``advantages``, and its backward passes in order (each over all or a share of its prompts)."""

    rollout: Rollout
    advantages: Tensor
    passes: list[Pass]

    @property
    def stepped(self) -> bool:
        return any(p.step_after for p in self.passes)

    @property
    def steps(self) -> int:
        """The optimizer steps the batch takes."""
        return sum(p.step_after for p in self.passes)


def generation_shares(num_prompts: int, steps: int, accumulation: int) -> list[Pass]:
    """The passes of one generation of ``num_prompts`` prompts for ``steps`` optimizer steps of
    ``accumulation`` shares each: ``steps x accumulation`` shares of whole groups, in prompt order,
    as even as the count allows (a smaller last batch gives smaller shares), the optimizer
    stepping after every ``accumulation``-th."""
    shares = steps * accumulation
    if num_prompts < shares:
        raise unsplittable(f"a batch of {num_prompts} prompt(s)", steps, accumulation, PROMPTS_FIX)
    base, extra = divmod(num_prompts, shares)
    passes, start = [], 0
    for i in range(shares):
        stop = start + base + (i < extra)
        passes.append(Pass(slice(start, stop), (i + 1) % accumulation == 0))
        start = stop
    return passes


PROMPTS_FIX = (
    "set data.prompts_per_step (the training DataLoader's batch_size) to at least {shares}, best a "
    "multiple of it (each share then holds prompts_per_step / {shares} prompts)"
)


def unsplittable(what: str, steps: int, accumulation: int, fix: str) -> ValueError:
    """The error for ``what`` (a batch) holding fewer prompts than the ``steps x accumulation``
    shares of a generation; ``fix`` names the setting to change (``{shares}`` filled in)."""
    shares = steps * accumulation
    return ValueError(
        f"{what} cannot be split into steps_per_generation={steps} optimizer steps of "
        f"gradient_accumulation_steps={accumulation} share(s) each: {fix.format(shares=shares)}"
    )


def check_batch_sizes(fit: FitShape, steps: int, accumulation: int, steps_per_batch: int) -> None:
    """Refuse, when a fit starts (before any generation), a datamodule whose training batches the
    run reaches cannot be split into ``steps x accumulation`` shares: its ``prompts_per_step``, or
    the epoch's smaller last batch (``train_size`` prompts, each rank taking its share). A loader
    of one's own is checked at its first such batch (generation_shares)."""
    size, rows, shares = fit.prompts_per_batch, fit.train_size, steps * accumulation
    if not isinstance(size, int):
        return
    if size < shares:
        raise unsplittable(f"data.prompts_per_step={size}", steps, accumulation, PROMPTS_FIX)
    if not isinstance(rows, int) or not rows:
        return
    rows = math.ceil(rows / fit.world_size)  # each rank's (EpochShuffleSampler pads)
    per_epoch, last = math.ceil(rows / size), rows % size
    reached = fit.step_limit is None or fit.step_limit > (per_epoch - 1) * steps_per_batch
    if last and last < shares and reached:
        fix = (
            f"set data.max_samples so that the training prompts ({rows} per rank) are a multiple "
            f"of prompts_per_step {size} (or leave at least {{shares}} over)"
        )
        raise unsplittable(f"the epoch's last batch holds {last} prompt(s) and", steps, accumulation, fix)


def take_share(part: Pass, rollout: Rollout, advantages: Tensor, *per_row: Tensor | None) -> tuple[Any, ...]:
    """The rollout, advantages and per-completion tensors (``None`` stays None) of ``part``'s prompts."""
    if part.groups is None:
        return (rollout, advantages, *per_row)
    keep = torch.zeros(rollout.prompt_ids.shape[0], dtype=torch.bool, device=rollout.prompt_ids.device)
    keep[part.groups] = True
    rows = part.rows(rollout.group_size)
    return (rollout.select_groups(keep), advantages[rows], *(None if t is None else t[rows] for t in per_row))


def mean_stats(passes: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The loss statistics of several passes (a generation's shares): each key's mean over the
    passes that trained something; one pass's own statistics as they are."""
    if len(passes) == 1:
        return passes[0]
    trained = [p for p in passes if all(v.numel() for v in p.values())]
    if not trained:
        return passes[-1]
    return {key: torch.stack([p[key] for p in trained]).mean() for key in trained[0]}


class StepPlan:
    """Plain accumulation over ``accumulation`` batches, ``passes`` passes over each rollout (mu;
    more than one needs accumulation 1), and with ``shares`` S > 1 each batch's generation split
    into S optimizer steps."""

    dynamic = False  # whether a batch trains its informative groups only

    def __init__(self, accumulation: int, passes: int = 1, shares: int = 1) -> None:
        self.accumulation, self.passes, self.shares = accumulation, passes, shares

    @property
    def steps_per_batch(self) -> int:
        """S x mu: the optimizer steps each batch takes when S > 1 (with S = 1, accumulation decides)."""
        return self.shares * self.passes

    def plan(
        self, rollout: Rollout, rewards: Tensor, advantages: Tensor, batch_idx: int, context: StepContext
    ) -> BatchPlan:
        if self.shares > 1:  # the whole generation, its steps repeated mu times
            shares = generation_shares(rollout.prompt_ids.shape[0], self.shares, self.accumulation)
            return BatchPlan(rollout, advantages, shares * self.passes)
        batches = context.num_training_batches
        stepped = accumulation_boundary(batch_idx, self.accumulation, batches)
        return BatchPlan(rollout, advantages, [Pass(None, stepped)] * self.passes)  # mu > 1: stepped

    def check_fit(self, fit: FitShape) -> None:
        """With S > 1 a batch takes S x mu optimizer steps at once, and a callback that looks at
        the step after each batch sees only every (S x mu)-th: refuse step cadences that are not
        multiples of it, naming each (reports to the loggers need none: they come at the first
        batch at or past each multiple of their cadence), and data whose batches cannot be split
        into the generation's shares (check_batch_sizes). Called when the fit starts."""
        if self.shares == 1:
            return
        k = self.steps_per_batch
        check_batch_sizes(fit, self.shares, self.accumulation, k)
        wrong = [f"trainer.max_steps={fit.max_steps}"] if fit.step_limit and fit.step_limit % k else []
        wrong += [str(cadence) for cadence in fit.step_cadences if cadence.every % k]
        if wrong:
            raise ValueError(
                f"steps_per_generation={self.shares} x num_iterations={self.passes} takes {k} "
                f"optimizer steps in each batch, so step cadences must be multiples of {k}: "
                f"{', '.join(wrong)} (from the command line: --trainer.max_steps, "
                "--checkpoint.every_n_train_steps, --hf_checkpoint.save_steps)"
            )

    def backward_calls_missing(self, made: int, context: StepContext) -> int:
        """Zero-weight backward calls this rank must add to match the others' all-reduces: none,
        every rank trains the same micro-batches."""
        return 0

    def step_ended(self) -> dict[str, float]:
        """The finished optimizer step's counts, for the metrics (taken or skipped)."""
        return {}

    def total_steps(self, fit: FitShape) -> int:
        """Optimizer steps of the whole fit (the schedule's length)."""
        if self.shares > 1:  # every batch takes S x mu steps, its accumulation inside it
            return total_optimizer_steps(fit, 1, self.steps_per_batch, self.dynamic)
        return total_optimizer_steps(fit, self.accumulation, self.passes, self.dynamic)


class DynamicSamplingPlan(StepPlan):
    """Train on the informative groups only, stepping once the rounds of the step gathered enough."""

    dynamic = True

    def __init__(self, accumulation: int, passes: int, shares: int, max_rounds: int) -> None:
        super().__init__(accumulation, passes, shares)
        self.rounds = SamplingRounds(max_rounds)  # the rounds of the step

    def plan(
        self, rollout: Rollout, rewards: Tensor, advantages: Tensor, batch_idx: int, context: StepContext
    ) -> BatchPlan:
        group = rollout.group_size
        keep = informative_groups(rewards, group)  # (P,)
        kept = advantages.view(-1, group)[keep].reshape(-1)
        last = batch_idx + 1 == context.num_training_batches
        target = context.world_size * keep.numel() * self.accumulation
        stepped = self.rounds.add_round(keep, context.reduce, target=target, last_batch=last)
        return BatchPlan(rollout.select_groups(keep), kept, [Pass(None, stepped)])

    def backward_calls_missing(self, made: int, context: StepContext) -> int:
        if context.world_size == 1:
            return 0
        return self.rounds.backward_calls_missing(made, context.reduce, context.device)

    def step_ended(self) -> dict[str, float]:
        return self.rounds.pop()


def step_plan(accumulation: int, passes: int, shares: int, max_rounds: int | None) -> StepPlan:
    """The plan for ``accumulation`` batches per optimizer step, ``passes`` over each rollout,
    ``shares`` optimizer steps per generation, and dynamic sampling's ``max_rounds`` (None: off)."""
    if max_rounds is None:
        return StepPlan(accumulation, passes, shares)
    return DynamicSamplingPlan(accumulation, passes, shares, max_rounds)
