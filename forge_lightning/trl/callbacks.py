"""TRL's view of a run, kept by a Lightning callback: transformers' ``TrainerState`` (``global_step``,
``epoch``, ``log_history``, what a TRL script reads after ``train()``) and the script's own
transformers ``TrainerCallback`` objects, called at the moments transformers' Trainer calls them.

A log entry holds the metrics the module reports every ``logging_steps`` optimizer steps, under its
own names without the ``train/`` prefix (``reward``, ``kl``, ``completion_length``: TRL's
``completions/mean_length``), with ``step`` and ``epoch``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from transformers import TrainerCallback, TrainerControl, TrainerState
from typing_extensions import override

from forge_lightning.callbacks.protocols import ReportsSteps


class TrainerStateCallback(pl.Callback):
    """Keeps transformers' ``TrainerState`` of the fit and calls ``callbacks`` (transformers'
    ``TrainerCallback`` objects) with it: train, epoch and step begin and end, each log, each save.

    Args:
        args: the run's ``GRPOConfig``, passed to each callback as transformers passes its
            ``TrainingArguments``.
        callbacks: transformers callbacks (a class is instantiated).
        max_steps: the fit's optimizer steps (``state.max_steps``).
    """

    def __init__(
        self, args: Any, callbacks: list[TrainerCallback | type[TrainerCallback]] = (), max_steps: int = 0
    ) -> None:
        self.args = args
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks]
        self.state = TrainerState(max_steps=max_steps)
        self.control = TrainerControl()
        self.losses: list[float] = []  # each optimizer step's train/loss, for train()'s training_loss
        self._in_step = False

    @property
    def training_loss(self) -> float:
        """The mean loss of the optimizer steps taken (``TrainOutput.training_loss``); NaN before one."""
        return sum(self.losses) / len(self.losses) if self.losses else math.nan

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resume takes back, as transformers keeps ``trainer_state.json`` in a checkpoint."""
        return {"log_history": self.state.log_history, "losses": self.losses}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.log_history = list(state_dict.get("log_history", []))
        self.losses = list(state_dict.get("losses", []))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state.num_train_epochs = max(trainer.max_epochs or 0, 0)
        self.state.global_step = trainer.global_step
        self.state.is_world_process_zero = trainer.is_global_zero
        self.state.is_local_process_zero = trainer.local_rank == 0
        self._call("on_train_begin", trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state.epoch = float(trainer.current_epoch)
        self._call("on_epoch_begin", trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._in_step:
            self._in_step = True
            self._call("on_step_begin", trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        records = pl_module.batch_records if isinstance(pl_module, ReportsSteps) else []
        epochs = trainer.current_epoch + (batch_idx + 1) / max(trainer.num_training_batches, 1)
        for record in records:
            if not record.metrics:
                continue  # a batch that only accumulated
            self._in_step = False
            self.state.global_step, self.state.epoch = record.step, round(epochs, 4)
            if "train/loss" in record.metrics:
                self.losses.append(record.metrics["train/loss"])
            self._call("on_step_end", trainer, pl_module)
            if record.report:
                logs = {k.removeprefix("train/"): v for k, v in record.report.items()}
                self.state.log_history.append({**logs, "epoch": self.state.epoch, "step": record.step})
                self._call("on_log", trainer, pl_module, logs=logs)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("on_epoch_end", trainer, pl_module)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self._call("on_save", trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("on_train_end", trainer, pl_module)

    def _call(self, event: str, trainer: pl.Trainer, pl_module: pl.LightningModule, **kwargs: Any) -> None:
        """``event`` of every callback, with what transformers' Trainer gives it; a callback's
        ``should_training_stop`` stops the fit."""
        if not self.callbacks:
            return
        given = {
            "model": getattr(pl_module, "model", None),
            "processing_class": getattr(pl_module, "tokenizer", None),
            "optimizer": next(iter(trainer.optimizers), None),
            "lr_scheduler": next((c.scheduler for c in trainer.lr_scheduler_configs), None),
            **kwargs,
        }
        for callback in self.callbacks:
            control = getattr(callback, event)(self.args, self.state, self.control, **given)
            self.control = control if isinstance(control, TrainerControl) else self.control
        if self.control.should_training_stop:
            trainer.should_stop = True
