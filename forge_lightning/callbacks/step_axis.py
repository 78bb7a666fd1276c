"""Lightning's count of stepped batches, the step its loggers and callbacks log at: kept on the
module's optimizer-step axis in a fit (:class:`OptimizerStepAxis`), and set to the evaluated
weights' step for ``trainer.validate`` (:class:`EvaluationLogStep`)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def stepped_batches(trainer: pl.Trainer) -> int:
    """Lightning's count of stepped batches (private, as :func:`set_stepped_batches` says)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_stepped_batches(trainer: pl.Trainer, count: int) -> None:
    """Set Lightning's count of stepped batches.

    Private: the fit loop keeps it in ``fit_loop.epoch_loop._batches_that_stepped`` and has no
    setter. Checked on lightning 2.4.0 and 2.6.6; tests/test_private_api.py checks the attribute
    (through :class:`EvaluationLogStep`) and tests/training/test_steps_per_generation.py that
    LearningRateMonitor logs at the optimizer step."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = count


class OptimizerStepAxis(Callback):
    """Keeps Lightning's count of stepped batches, the step its callbacks log at
    (``LearningRateMonitor``, ``DeviceStatsMonitor``), on the module's axis: during a batch it is
    the number of the optimizer step the batch works towards (the steps taken, plus one), the step
    whose ``train/*`` the module logs at that step.

    Under automatic optimization Lightning counts a batch only when it ends an optimizer step.
    Under manual optimization it cannot tell and counts every batch, so with gradient accumulation
    or a generation split into several steps (several in one batch) those callbacks logged against
    batches while the module's ``train/*`` go to the loggers at ``global_step``: two x-axes. And
    ``LearningRateMonitor`` logs, at a batch's start, the rate the batch's next step uses: at the
    steps taken so far it showed the next step's rate, where ``train/lr`` shows the rate the step
    logged used. So at a fit's start this sets the count to 1 (a resume's comes back from its
    checkpoint) and after each batch to what makes it, at the next batch's start, the step that
    batch takes next: every point of either curve at step n is the rate optimizer step n used
    (with S steps in a batch, the monitor logs a batch's first step and ``train/lr`` its
    last, on one curve). A checkpoint keeps the count as Lightning expects at a batch's end, so a
    resume restores it the same way. The module adds it to every fit; under automatic optimization
    it does nothing.
    """

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:  # before a resume's checkpoint restores the count
            set_stepped_batches(trainer, trainer.global_step + 1)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if pl_module.automatic_optimization:
            return
        # Lightning adds one after this hook (every batch, under manual optimization).
        set_stepped_batches(trainer, trainer.global_step)


class EvaluationLogStep:
    """Outside a fit Lightning sends an evaluation's logged metrics to the loggers at its count
    of stepped batches (``fit_loop.epoch_loop._batches_that_stepped``, 0 in ``trainer.validate``),
    unless a ``step`` metric is logged, which ``trainer.validate`` would then return with the
    metrics. So the count is set to the step of the weights evaluated (a checkpoint's) for the
    epoch's end, and put back when the validation ends, for a fit the same trainer may run later."""

    def __init__(self) -> None:
        self._saved: int | None = None

    def set(self, trainer: pl.Trainer, step: int) -> None:
        if self._saved is None:
            self._saved = stepped_batches(trainer)
        set_stepped_batches(trainer, step)

    def restore(self, trainer: pl.Trainer) -> None:
        if self._saved is not None:
            set_stepped_batches(trainer, self._saved)
            self._saved = None
