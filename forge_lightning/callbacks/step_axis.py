"""Lightning's logger step counts optimizer steps under manual optimization too."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from forge_lightning.reporting.lightning_step import set_stepped_batches


class OptimizerStepAxis(Callback):
    """Keeps Lightning's count of stepped batches, the step its callbacks log at
    (``LearningRateMonitor``, ``DeviceStatsMonitor``), equal to the optimizer steps taken.

    Under automatic optimization Lightning counts a batch only when it ends an optimizer step.
    Under manual optimization it cannot tell and counts every batch, so with gradient accumulation
    or ``steps_per_generation`` (several steps in one batch) those callbacks logged against
    batches while the module's ``train/*`` go to the loggers at ``global_step``: two x-axes, and a
    learning-rate curve that disagreed with ``train/lr``. After each batch this sets the count to
    what Lightning's own would be: at the next batch's start (where ``LearningRateMonitor`` logs
    the rate the next step uses) it is ``global_step``. A checkpoint keeps the count as Lightning
    expects at a batch's end, so a resume restores it the same way. The module adds it to every
    fit; under automatic optimization it does nothing.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if pl_module.automatic_optimization:
            return
        # Lightning adds one after this hook (every batch, under manual optimization).
        set_stepped_batches(trainer, trainer.global_step - 1)
