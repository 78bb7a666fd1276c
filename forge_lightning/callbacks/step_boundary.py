"""Checkpoints only at optimizer-step boundaries, for Lightning's own ``ModelCheckpoint`` too."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override


def completed_step(pl_module: pl.LightningModule) -> bool:
    """Whether the latest training batch ended with an optimizer step (True for a module that
    does not say: it optimizes every batch)."""
    return bool(getattr(pl_module, "stepped", True))


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
            if hasattr(callback, "_last_global_step_saved"):
                callback._last_global_step_saved = trainer.global_step
            elif not self._warned:  # a Lightning that renamed it: say so rather than save mid-step
                self._warned = True
                rank_zero_warn(
                    f"{type(callback).__name__} cannot be kept from saving between the batches of an "
                    "optimizer step on this Lightning version; a resume from such a checkpoint is not exact"
                )
