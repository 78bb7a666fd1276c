"""Lightning's count of stepped batches, the step its loggers and callbacks log at, read and set
(callbacks/step_axis.py keeps it equal to the optimizer steps; evaluation/validation.py sets it
for validate's logged step)."""

from __future__ import annotations

import lightning.pytorch as pl


def stepped_batches(trainer: pl.Trainer) -> int:
    """Lightning's count of stepped batches (private, as :func:`set_stepped_batches` says)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_stepped_batches(trainer: pl.Trainer, count: int) -> None:
    """Set Lightning's count of stepped batches.

    Private: the fit loop keeps it in ``fit_loop.epoch_loop._batches_that_stepped`` and has no
    setter. Checked on lightning 2.4.0 and 2.6.6; tests/test_private_api.py checks the attribute
    (through validation.EvaluationLogStep, which sets it for validate's logged step) and
    tests/training/test_steps_per_generation.py that LearningRateMonitor logs at the optimizer step."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = count
