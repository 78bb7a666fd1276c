"""Ends a fit once a training metric reaches a goal: a recipe's stage that lasts until a habit is
learned rather than for a guessed number of steps."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from forge_lightning.callbacks._paths import output_dir
from forge_lightning.callbacks.protocols import ReportsSteps
from forge_lightning.run.fileio import append_jsonl
from forge_lightning.run.folder import LOG_NAME


class StopAtGoal(Callback):
    """Stops the fit after the optimizer step at which a training metric's mean over the last
    ``window`` steps is at least ``at_least`` (or at most ``at_most``), from step ``min_steps`` on;
    ``trainer.max_steps`` stays the limit when the goal is not reached. Off unless added to
    ``trainer.callbacks``, e.g. in one stage of a recipe (forge_lightning/cli/stages.py), where a
    stage ended at its goal is done, as one that ran its ``max_steps``::

        stages:
          - name: calc                     # until the completions are short: the one-call habit
            trainer:
              max_steps: 25
              callbacks:
                - class_path: forge_lightning.callbacks.StopAtGoal
                  init_args: {monitor: train/completion_length, at_most: 30, window: 3}

    The metric is a training step's record (``train/reward``, ``train/completion_length``, ... as
    the module's step records carry them, read through ``ReportsSteps``). The goal's step is
    ``reached_step``; it is announced, and written to ``training_log.jsonl`` as a line
    ``{"step", "event": "goal", ...}``. The last ``window`` values are in the callback's state, so
    a run resumed from ``last.ckpt`` stops where the uninterrupted one does. Under DDP or FSDP a
    step's metrics are already its means reduced across ranks (``StepRecord.metrics``), so every
    rank sees the same values and stops after the same step.

    Args:
        monitor: the metric watched, by its logged name.
        at_least: the goal is a mean of at least this (a reward); None: no such goal.
        at_most: the goal is a mean of at most this (a completion length); None: no such goal.
        window: the optimizer steps averaged.
        min_steps: the goal counts from this optimizer step on.
        output_dir: run folder of ``training_log.jsonl``; ``trainer.default_root_dir`` when None.
    """

    def __init__(
        self,
        monitor: str = "train/reward",
        at_least: float | None = None,
        at_most: float | None = None,
        window: int = 3,
        min_steps: int = 1,
        output_dir: str | None = None,
    ) -> None:
        if not isinstance(monitor, str) or not monitor.startswith("train/"):
            raise ValueError(f"StopAtGoal.monitor must be a training step's metric (train/...): {monitor!r}")
        if (at_least is None) == (at_most is None):
            raise ValueError("StopAtGoal needs one goal: at_least or at_most (not both)")
        for name, value in (("window", window), ("min_steps", min_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StopAtGoal.{name} must be an integer >= 1, got {value!r}")
        self.monitor, self.at_least, self.at_most = monitor, at_least, at_most
        self.window, self.min_steps, self.output_dir = window, min_steps, output_dir
        self._start()

    def _start(self) -> None:
        self.values: deque[float] = deque(maxlen=self.window)
        self.reached_step: int | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # before a checkpoint's state is restored: a second fit starts afresh
            self._start()

    def reached(self, step: int, value: float) -> bool:
        """Take the value of optimizer step ``step``; True when the goal is met there."""
        self.values.append(value)
        if step < self.min_steps or len(self.values) < self.window:
            return False
        mean = math.fsum(self.values) / len(self.values)
        return mean >= self.at_least if self.at_least is not None else mean <= self.at_most

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.reached_step is not None:  # resumed from a checkpoint taken at or after the goal
            trainer.should_stop = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if self.reached_step is not None or not isinstance(pl_module, ReportsSteps):
            return
        for record in pl_module.batch_records:
            value = record.metrics.get(self.monitor)
            if value is not None and self.reached(record.step, float(value)):
                self._stop(trainer, record.step)
                return

    def _stop(self, trainer: pl.Trainer, step: int) -> None:
        self.reached_step = step
        trainer.should_stop = True
        goal = f">= {self.at_least:g}" if self.at_least is not None else f"<= {self.at_most:g}"
        mean = math.fsum(self.values) / len(self.values)
        rank_zero_info(
            f"StopAtGoal: {self.monitor} averaged {mean:.4g} over steps {step - self.window + 1}-{step} "
            f"({goal}): the fit ends at step {step}"
        )
        if trainer.is_global_zero and not trainer.fast_dev_run:
            path = output_dir(trainer, self.output_dir) / LOG_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(path, {"step": step, "event": "goal", "monitor": self.monitor, "mean": mean})

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "reached_step": self.reached_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = deque(state_dict["values"], maxlen=self.window)
        self.reached_step = state_dict["reached_step"]


def ended_at_goal(trainer: Any) -> bool:
    """Whether a StopAtGoal of ``trainer``'s ended its fit."""
    return any(isinstance(c, StopAtGoal) and c.reached_step is not None for c in trainer.callbacks)
