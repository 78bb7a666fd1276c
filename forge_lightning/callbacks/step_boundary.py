"""Checkpoints only at optimizer-step boundaries, for Lightning's own ``ModelCheckpoint`` too."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from forge_lightning.callbacks.protocols import StepsInBatches


def completed_step(pl_module: pl.LightningModule) -> bool:
    """Whether the latest training batch ended with an optimizer step (True for a module that
    does not say: it optimizes every batch)."""
    return pl_module.stepped if isinstance(pl_module, StepsInBatches) else True


class SaveAtStepBoundaries(Callback):
    """Keeps every ``ModelCheckpoint`` from saving after a batch that did not end an optimizer step.

    Under manual optimization with gradient accumulation (or an async batch filling the pipeline,
    or a dynamic-sampling round) ``global_step`` does not move between a step's batches, and a
    checkpoint written there holds a data position past batches whose gradient it does not hold:
    a resume from it trains that step on part of its batches. ``ModelCheckpoint`` skips a step it
    has saved already, but does not keep that across a resume, so the resumed fit's first batch
    (mid-step) wrote its step's checkpoint and ``last.ckpt`` again, half a step further. After
    such a batch this callback marks every ``ModelCheckpoint`` as having saved the current step
    (which its files already hold), so no path of it (step cadence, validation, exception) saves
    until the step completes. The module adds it to every fit; Lightning runs checkpoint
    callbacks after all others, so it always acts first.
    """

    def __init__(self) -> None:
        self._warned = False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if completed_step(pl_module):
            return
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint):
                continue
            # A Lightning that renamed the attribute: say so rather than save mid-step.
            if not mark_saved(callback, trainer.global_step) and not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"{type(callback).__name__} cannot be kept from saving between the batches of an "
                    "optimizer step on this Lightning version; a resume from such a checkpoint is not exact"
                )


def mark_saved(callback: ModelCheckpoint, step: int) -> bool:
    """Tell ``callback`` that ``step`` is saved already; False where this Lightning cannot be told.

    Private: ``ModelCheckpoint`` keeps the step it saved last in ``_last_global_step_saved`` and
    skips every save at that step; it has no public way to hold a save back. Checked on lightning
    2.4.0 and 2.6.6; ``tests/test_private_api.py`` fails if it moves."""
    if not hasattr(callback, "_last_global_step_saved"):
        return False
    callback._last_global_step_saved = step
    return True
