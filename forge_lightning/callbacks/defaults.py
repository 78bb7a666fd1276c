"""The callbacks GRPOLightningModule adds to each fit (its ``configure_callbacks``)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from forge_lightning.callbacks.preemption import save_last
from forge_lightning.callbacks.protocols import RunsRollouts
from forge_lightning.callbacks.reference import ReferenceModel
from forge_lightning.callbacks.step_axis import OptimizerStepAxis
from forge_lightning.callbacks.step_boundary import SaveAtStepBoundaries
from forge_lightning.serving.client import NoServerLeft


def fit_callbacks(trainer: pl.Trainer | None, needs_reference: bool, worker: bool) -> list[pl.Callback]:
    """SaveAtStepBoundaries (checkpoints only between optimizer steps), OptimizerStepAxis
    (Lightning's logger step counts optimizer steps), StopWorkerOnError when a rollout ``worker``
    process samples (async), and the default ReferenceModel when the loss needs a reference and
    ``trainer`` has none: a callback returned here would replace the trainer's own of the same
    type (and its settings, e.g. output_dir). In a fit, first refuses the trainer's
    automatic-optimization settings (configure_callbacks is the one hook before Lightning's own
    checks)."""
    given = trainer.callbacks if trainer is not None else []
    if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        refuse_automatic_optimization_settings(trainer)
    callbacks: list[pl.Callback] = [SaveAtStepBoundaries(), OptimizerStepAxis()]
    callbacks += [StopWorkerOnError()] if worker else []
    if needs_reference and not any(isinstance(c, ReferenceModel) for c in given):
        callbacks.append(ReferenceModel())
    return callbacks


class StopWorkerOnError(pl.Callback):
    """Stops the rollout servers the trainer started (async mode's own among them) when a
    fit fails (teardown stops it otherwise). A fit whose rollout servers are all dead saves
    ``last.ckpt`` first, to resume from once servers are back."""

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, NoServerLeft):
            saved = save_last(trainer)
            where = ", ".join(map(str, saved)) if saved else "nothing (the trainer has no ModelCheckpoint)"
            rank_zero_warn(f"no rollout server is left at step {trainer.global_step}: saved {where}")
        if isinstance(pl_module, RunsRollouts):
            pl_module.stop_rollout_worker()


def refuse_automatic_optimization_settings(trainer: pl.Trainer) -> None:
    """Refuse the Trainer's gradient settings, which the module (it steps its optimizer itself)
    cannot honour, naming its own. Lightning's refusal of the first two says "switch to automatic
    optimization" and comes before ``setup``; clipping by value would fail only at the first step."""
    if trainer.gradient_clip_val:
        raise ValueError(
            f"trainer.gradient_clip_val={trainer.gradient_clip_val} does not apply here (the module "
            "steps its optimizer itself); set model.max_grad_norm instead"
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} does not apply here "
            "(the module steps its optimizer itself); set model.gradient_accumulation_steps instead"
        )
    algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
    if algorithm not in (None, "norm"):
        raise ValueError(
            f"trainer.gradient_clip_algorithm={algorithm!r} does not apply here: the module clips the "
            "gradient's total norm itself; set model.max_grad_norm instead (None: no clipping)"
        )
