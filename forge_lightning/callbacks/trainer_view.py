"""What the layers below the module read of Lightning's Trainer, as plain data: the fit's shape
(:func:`fit_shape`, run/fit.py) and the loop around a training batch (:func:`step_context`,
training/context.py). These two are where a Trainer becomes the values the rest of the package
takes, so that the plan, the step, the sources and validation run and are tested without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.trainer.states import TrainerFn

from forge_lightning.callbacks.rl_loop import TrainerHooks
from forge_lightning.reporting.profiler import PhaseProfiler
from forge_lightning.run.fit import FitShape, StepCadence
from forge_lightning.training.context import StepContext
from forge_lightning.training.optim import loss_scale

# The step cadences of callbacks that act after a batch: (attribute, the setting's name).
_CADENCES = (("_every_n_train_steps", "every_n_train_steps"), ("save_steps", "save_steps"))


def fit_shape(trainer: pl.Trainer) -> FitShape:
    """The fit ``trainer`` runs, as the plan, the schedule, the sources and validation see it."""
    data = trainer.datamodule
    cadences = [
        StepCadence(type(callback).__name__, shown, value)
        for callback in trainer.callbacks
        for attribute, shown in _CADENCES
        if isinstance(value := getattr(callback, attribute, None), int) and value > 0
    ]
    return FitShape(
        max_steps=trainer.max_steps,
        max_epochs=trainer.max_epochs,
        world_size=trainer.world_size,
        precision=trainer.precision,
        log_every_n_steps=trainer.log_every_n_steps,
        stepping_batches=lambda: trainer.estimated_stepping_batches,
        max_time_set=max_time_set(trainer.callbacks),
        step_cadences=tuple(cadences),
        prompts_per_batch=_setting(data, "prompts_per_step"),
        train_size=_setting(data, "train_size"),
        val_batch_size=_setting(data, "val_batch_size"),
        train_loader_batch_size=_loader_batch(trainer.train_dataloader),
        val_loader_batch_size=_loader_batch(trainer.val_dataloaders),
        root_dir=trainer.default_root_dir,
    )


def fitting(trainer: pl.Trainer | None) -> bool:
    """Whether ``trainer`` (None: none attached) runs a fit, not a validate or predict."""
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING


def max_time_set(callbacks: Sequence[pl.Callback]) -> bool:
    """Whether a Timer with a duration (``max_time``) may stop the fit: its public
    ``time_remaining()`` is None exactly without one."""
    return any(isinstance(cb, Timer) and cb.time_remaining() is not None for cb in callbacks)


def step_context(module: pl.LightningModule) -> StepContext:
    """The loop around a training batch, as the step sees it: ``module``'s backward and gather,
    and its trainer's reduce, step count, profiler, sizes and RL loop callbacks (rl_loop.py)."""
    trainer = module.trainer
    profiler = trainer.profiler
    return StepContext(
        backward=module.manual_backward,
        gather=module.all_gather,
        reduce=lambda tensor, op: trainer.strategy.reduce(tensor, reduce_op=op),
        global_step=lambda: trainer.global_step,
        profile=profiler.profile,
        phases=profiler.last_step if isinstance(profiler, PhaseProfiler) else dict,
        loss_scale=lambda: loss_scale(trainer.precision_plugin),
        world_size=trainer.world_size,
        device=module.device,
        num_training_batches=trainer.num_training_batches,
        epoch=trainer.current_epoch,
        max_steps=trainer.max_steps,
        max_epochs=trainer.max_epochs,
        log_every_n_steps=trainer.log_every_n_steps,
        hooks=TrainerHooks(trainer, module),
    )


def _setting(data: Any, name: str) -> int | None:
    value = getattr(data, name, None)
    return value if isinstance(value, int) else None


def _loader_batch(loaders: Any) -> int | None:
    loader = loaders[0] if isinstance(loaders, Sequence) and loaders else loaders
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None
