"""The callbacks GRPOLightningModule adds to each fit (its ``configure_callbacks``)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from forge_lightning.callbacks.reference import ReferenceModel
from forge_lightning.callbacks.step_axis import OptimizerStepAxis
from forge_lightning.callbacks.step_boundary import SaveAtStepBoundaries
from forge_lightning.settings.checks import refuse_automatic_optimization_settings


def fit_callbacks(
    trainer: pl.Trainer | None, needs_reference: bool, extra: list[pl.Callback]
) -> list[pl.Callback]:
    """SaveAtStepBoundaries (checkpoints only between optimizer steps), OptimizerStepAxis
    (Lightning's logger step counts optimizer steps), ``extra`` (the rollout source's), and the
    default ReferenceModel when the loss needs a reference and ``trainer`` has none: a callback
    returned here would replace the trainer's own of the same type (and its settings, e.g.
    output_dir). In a fit, first refuses the trainer's automatic-optimization settings
    (configure_callbacks is the one hook before Lightning's own checks)."""
    given = trainer.callbacks if trainer is not None else []
    if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        refuse_automatic_optimization_settings(trainer)
    callbacks: list[pl.Callback] = [SaveAtStepBoundaries(), OptimizerStepAxis(), *extra]
    if needs_reference and not any(isinstance(c, ReferenceModel) for c in given):
        callbacks.append(ReferenceModel())
    return callbacks
