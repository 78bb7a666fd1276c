"""The training report: each optimizer step's metrics, and every ``report_every`` steps what the
loggers get (the window of steps since the previous report).

:class:`StepReporter` keeps the running state (the window, the completion tokens trained so far,
which checkpoints keep) next to the :class:`~forge_lightning.reporting.metrics.RunningMetrics` it pops; the
module sends what it returns to ``self.log`` and the loggers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from forge_lightning.reporting.metrics import (
    RunningMetrics,
    StepRecord,
    batch_metrics,
    logged_name,
    window_values,
)

if TYPE_CHECKING:
    from forge_lightning.rollout.sources import TrainingBatch


class StepReporter:
    """The optimizer steps' logged metrics and the reports to the loggers.

    The cadence is a RewardLogger's ``logging_steps`` when one hands it over
    (``module.report_every``), so that its JSONL and every logger hold the same values at the same
    steps; else the trainer's ``log_every_n_steps``, counted in optimizer steps.
    """

    def __init__(self, metrics: RunningMetrics) -> None:
        self.metrics = metrics
        self.every: int | None = None
        self.tokens_trained = 0.0  # train/num_tokens, kept in checkpoints
        self.window: list[dict[str, float]] = []  # logged steps since the last report

    def record(
        self,
        item: TrainingBatch,
        rewards: Tensor,
        components: dict[str, Tensor],
        stats: dict[str, Tensor],
        steps: int,
        global_step: int,
        log_every_n_steps: int,
        phases: dict[str, float],
    ) -> StepRecord:
        """One training batch: its values tracked (batch_metrics); after the ``steps`` optimizer
        steps it took (if any, ``global_step`` the count after them) their metrics (step) and, at a
        reporting step, the report; all in the batch's record. ``phases``: the batch's seconds per
        phase (empty when not timed)."""
        rollout = item.rollout
        for key, value in batch_metrics(rollout, rewards, components, stats, phases).items():
            self.metrics.update(key, value)
        logged = self.step() if steps else {}
        report = self.report(global_step, log_every_n_steps, steps) if steps else {}
        return StepRecord.of(global_step, item.prompts, rollout, rewards, logged, phases, components, report)

    def step(self) -> dict[str, float]:
        """At an optimizer step: its metrics (means over its batches, reduced across ranks) under
        their logged names, with the completion tokens trained so far (summed over every rank)."""
        logged = {logged_name(k): v for k, v in self.metrics.pop().items()}
        self.tokens_trained += logged.get("train/num_tokens", 0.0)
        logged["train/num_tokens"] = self.tokens_trained
        self.window.append(logged)
        return logged

    def report(self, global_step: int, log_every_n_steps: int, steps: int = 1) -> dict[str, float]:
        """At a reporting step, the window's values (window_values), and a new window; else empty.
        A batch that took ``steps`` optimizer steps (its generation's shares) reports when it
        reached or passed a multiple of the cadence."""
        every = self.every if self.every is not None else max(log_every_n_steps, 1)
        if global_step // every == (global_step - steps) // every:
            return {}
        report, self.window = window_values(self.window), []
        return report
