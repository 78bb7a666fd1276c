"""The fit around the training, as plain data: what the layers below the Lightning module know of
the Trainer that runs them (its limits, its world, its data's batch sizes, the step cadences its
callbacks keep).

The module reads a :class:`FitShape` from its trainer where a hook needs one
(callbacks/trainer_view.py); the plan, the optimizer's schedule, the rollout sources, validation
and the resume checks take it instead of the Trainer, so each is tested without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepCadence:
    """A callback's step cadence: ``ModelCheckpoint(every_n_train_steps=3)``."""

    callback: str
    setting: str
    every: int

    def __str__(self) -> str:
        return f"{self.callback}({self.setting}={self.every})"


@dataclass(frozen=True)
class FitShape:
    """The fit, as the collaborators below the module see it."""

    max_steps: int = -1  # optimizer steps; -1 (Lightning's) or None: no limit
    max_epochs: int | None = None
    world_size: int = 1
    precision: str = "32-true"
    log_every_n_steps: int = 50
    # Lightning's estimated_stepping_batches: read only when asked (it loads the training data).
    stepping_batches: Callable[[], float] = lambda: math.inf
    max_time_set: bool = False  # a Timer with a duration stops the fit
    step_cadences: tuple[StepCadence, ...] = ()  # the callbacks' every_n_train_steps / save_steps
    # The datamodule's settings (None for a loader of one's own) and the loaders' batch sizes.
    prompts_per_batch: int | None = None  # the datamodule's prompts_per_step
    train_size: int | None = None
    val_batch_size: int | None = None
    train_loader_batch_size: int | None = None
    val_loader_batch_size: int | None = None
    root_dir: str | None = None  # the run folder (trainer.default_root_dir): what a run writes beside its log

    @property
    def step_limit(self) -> int | None:
        """``max_steps`` when it limits the fit, else None."""
        return self.max_steps if self.max_steps is not None and self.max_steps > 0 else None

    def recorded(self) -> dict[str, Any]:
        """The trainer settings a checkpoint records, so that a resume can say which it changed
        (all may change: a longer run, another precision or cadence)."""
        return {
            "max_steps": self.max_steps,
            "max_epochs": self.max_epochs,
            "precision": self.precision,
            "world_size": self.world_size,
            "log_every_n_steps": self.log_every_n_steps,
        }
