"""A rollback to the best weights (and a lower learning rate, a higher KL weight) when a watched
metric collapses."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from forge_lightning.callbacks._paths import output_dir
from forge_lightning.callbacks.protocols import ReportsSteps, TakesAdjustments
from forge_lightning.run.fileio import append_jsonl
from forge_lightning.run.folder import LOG_NAME

Verdict = Literal["best", "healthy", "bad", "collapse"]
ROLLBACKS = "guard/rollbacks"  # the loggers' count of rollbacks so far


@dataclass(frozen=True)
class CollapseRule:
    """When a value of the watched metric is collapsed: not finite, below ``min_value``, above
    ``max_value``, or (with ``drop``) more than ``drop`` worse than the best seen, worse meaning
    lower under ``mode: max`` and higher under ``mode: min``."""

    mode: Literal["max", "min"] = "max"
    drop: float | None = None
    min_value: float | None = None
    max_value: float | None = None

    def better(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.mode == "max" else value < best)

    def collapsed(self, value: float, best: float | None) -> bool:
        if not math.isfinite(value):
            return True
        if (self.min_value is not None and value < self.min_value) or (
            self.max_value is not None and value > self.max_value
        ):
            return True
        if self.drop is None or best is None:
            return False
        return value < best - self.drop if self.mode == "max" else value > best + self.drop


class CollapseWatch:
    """The best value seen and the collapsed values in a row, observation by observation (no
    Trainer: the rule alone)."""

    def __init__(self, rule: CollapseRule, patience: int) -> None:
        self.rule, self.patience = rule, patience
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0  # collapsed observations in a row

    def observe(self, step: int, value: float) -> Verdict:
        """Take the value at optimizer step ``step``: ``best`` (a new best), ``healthy``, ``bad``
        (collapsed, under the patience) or ``collapse`` (``patience`` collapsed in a row; the count
        starts again)."""
        if not self.rule.collapsed(value, self.best):
            self.bad = 0
            if not self.rule.better(value, self.best):
                return "healthy"
            self.best, self.best_step = value, step
            return "best"
        self.bad += 1
        if self.bad < self.patience:
            return "bad"
        self.bad = 0
        return "collapse"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]


@dataclass
class Snapshot:
    """The training state a rollback restores, on the CPU: the trainable weights by name and each
    optimizer's state (its moments and step counts), as they were after optimizer step ``step``."""

    step: int
    value: float
    weights: dict[str, Tensor]
    optimizers: list[dict[str, Any]]

    @classmethod
    def take(cls, step: int, value: float, module: torch.nn.Module, optimizers: list[Any]) -> Snapshot:
        with torch.no_grad():
            weights = {
                n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters() if p.requires_grad
            }
        return cls(step, value, weights, [cpu_copy(o.state_dict()) for o in optimizers])

    def restore(self, module: torch.nn.Module, optimizers: list[Any]) -> None:
        """Put the weights and the optimizers' state back, bitwise; each parameter group keeps the
        learning rate it has now (the schedule goes on at the current step)."""
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in self.weights:
                    p.copy_(self.weights[name])
        for optimizer, state in zip(optimizers, self.optimizers):
            rates = [(g["lr"], g.get("initial_lr")) for g in optimizer.param_groups]
            # A copy: load_state_dict keeps CPU tensors as they are, and the steps would update ours.
            optimizer.load_state_dict(cpu_copy(state))
            for group, (lr, initial) in zip(optimizer.param_groups, rates):
                group["lr"] = lr
                if initial is not None:
                    group["initial_lr"] = initial


def cpu_copy(value: Any) -> Any:
    """``value`` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    copied to the CPU and everything else deep-copied: nothing shared with the original."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cpu_copy(v) for v in value)
    return copy.deepcopy(value)


class CollapseGuard(Callback):
    """Watches one logged metric and, when it collapses, rolls the run back to the best weights
    seen and trains on with a lower learning rate and a higher KL weight; at most
    ``max_rollbacks`` times, after which it warns once (of the first collapse it cannot roll back)
    and lets the run go on. Off unless added to ``trainer.callbacks``.

    The metric is a training step's (``train/reward``, ``train/entropy``,
    ``train/completion_length``, ... as the module's step records carry them, read through
    ``ReportsSteps``: one observation per optimizer step) or validation's (a ``val/`` name such as
    ``val/accuracy`` or ``val/pass@4``, read from ``trainer.callback_metrics`` after each
    validation in the fit: one observation per validation). A value is collapsed when it is not
    finite, outside ``[min_value, max_value]``, or more than ``drop`` worse than the best seen
    (lower under ``mode: max``, higher under ``mode: min``); ``patience`` collapsed observations
    in a row make a collapse.

    Snapshot: at each new best the trainable weights and the optimizer's state (AdamW's moments
    and step count) are copied to the CPU, in memory (a copy of 3 floats a trainable parameter:
    with LoRA, the adapter's). A training metric describes the rollouts of the weights before its
    step, so its snapshot is one update past them; a validation metric's is the weights it scored.
    The snapshot is not in the checkpoint: after a resume the guard keeps its best value and takes
    the first healthy observation's weights as its snapshot (the last good ones) until a new best.

    Rollback: the snapshot's weights and optimizer state are restored exactly (bitwise); then the
    module (``TakesAdjustments``, as GRPOLightningModule) scales its learning rate by ``lr_scale``
    (the schedule's peak and the current rate: the schedule keeps its shape) and its KL weight by
    ``kl_beta_scale`` (a weight of 0 stays 0) for the rest of the run, and its rollout
    engine takes the restored weights. With another LightningModule the weights and optimizer are
    restored and no setting changes. The guard's observations start again from the restored
    weights, against the same best value.

    Semantics: ``global_step`` keeps counting (the steps the collapse took are not taken back, so
    logs never repeat a step) and the data position goes on (the next batch is the one that came
    next); the learning-rate schedule goes on at the current step. A rollback is logged as an
    event: a warning with the numbers, ``guard/rollbacks`` (the count so far) to every logger at
    the step, and a line ``{"step", "event": "rollback", ...}`` in ``training_log.jsonl`` of the
    run folder (which RewardLogger writes; a resume drops the lines after its step, events
    included). The changed settings are the module's state, not its hyperparameters: they are in
    its checkpoints (``forge_adjustments``), so ``--ckpt_path last`` resumes with them, and the
    resume check, which compares hyperparameters, accepts the run; the guard's own counters (best
    value, rollbacks done, events) are in its state. Deterministic: the same run rolls back at
    the same step. Each rank keeps its own snapshot (under DDP the weights are the same on every
    rank); sharded (FSDP) weights are not supported.

    Args:
        monitor: the metric watched, by its logged name.
        mode: ``max`` (higher is better: a reward, an accuracy) or ``min``.
        drop: a collapse is a value more than this worse than the best seen; None: no such rule.
        min_value: a value below this is collapsed (an entropy near 0); None: no bound.
        max_value: a value above this is collapsed (a completion length at the cap); None: no bound.
        patience: collapsed observations in a row that make a collapse.
        max_rollbacks: rollbacks a run may make; a collapse after them is only warned about.
        lr_scale: the factor on the learning rate at each rollback, in (0, 1].
        kl_beta_scale: the factor on the KL weight at each rollback, >= 1.
        output_dir: run folder of ``training_log.jsonl``; ``trainer.default_root_dir`` when None.
    """

    def __init__(
        self,
        monitor: str = "train/reward",
        mode: Literal["max", "min"] = "max",
        drop: float | None = None,
        min_value: float | None = None,
        max_value: float | None = None,
        patience: int = 1,
        max_rollbacks: int = 1,
        lr_scale: float = 0.5,
        kl_beta_scale: float = 2.0,
        output_dir: str | None = None,
    ) -> None:
        check_guard_settings(
            monitor, mode, drop, min_value, max_value, patience, max_rollbacks, lr_scale, kl_beta_scale
        )
        self.monitor, self.patience, self.max_rollbacks = monitor, patience, max_rollbacks
        self.lr_scale, self.kl_beta_scale, self.output_dir = lr_scale, kl_beta_scale, output_dir
        self.rule = CollapseRule(mode, drop, min_value, max_value)
        self._start()

    def _start(self) -> None:
        self.watch = CollapseWatch(self.rule, self.patience)
        self.rollbacks = 0
        self.events: list[dict[str, Any]] = []  # one per rollback
        self.snapshot: Snapshot | None = None
        self._warned = False  # of a collapse it could not roll back (once)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # before a checkpoint's state is restored: a second fit starts afresh
            self._start()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if self.monitor.startswith("val/") or not isinstance(pl_module, ReportsSteps):
            return
        for record in pl_module.batch_records:
            if self.monitor in record.metrics:
                self._observe(trainer, pl_module, record.step, record.metrics[self.monitor])

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.monitor.startswith("val/") or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if trainer.state.fn == TrainerFn.FITTING and value is not None:
            self._observe(trainer, pl_module, trainer.global_step, float(value))

    def _observe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, value: float) -> None:
        verdict = self.watch.observe(step, value)
        if verdict == "best" or (verdict == "healthy" and self.snapshot is None):
            self.snapshot = Snapshot.take(step, value, pl_module, trainer.optimizers)
        elif verdict == "collapse":
            self._collapse(trainer, pl_module, step, value)

    def _collapse(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, value: float) -> None:
        best = (
            "none yet" if self.watch.best is None else f"{self.watch.best:.4g} at step {self.watch.best_step}"
        )
        seen = f"CollapseGuard: {self.monitor} = {value:.4g} at step {step} (best {best}) is a collapse"
        if self.rollbacks >= self.max_rollbacks or self.snapshot is None:
            made = f"{self.rollbacks} of {self.max_rollbacks} rollbacks made"
            if not self._warned:
                why = made if self.snapshot is not None else "no snapshot taken yet"
                rank_zero_warn(f"{seen}; not rolled back ({why}): training goes on, and no more is said")
            self._warned = True
            return
        snapshot = self.snapshot
        snapshot.restore(pl_module, trainer.optimizers)
        changes = "no setting changed (the module takes no adjustments)"
        event: dict[str, Any] = {"step": step, "event": "rollback", "monitor": self.monitor, "value": value}
        event.update(best=self.watch.best, restored_step=snapshot.step, restored_value=snapshot.value)
        if isinstance(pl_module, TakesAdjustments):
            pl_module.weights_restored()
            adjusted = pl_module.adjust(self.lr_scale, self.kl_beta_scale)
            event.update(lr_scale=adjusted.lr_scale, kl_beta_scale=adjusted.kl_beta_scale)
            changes = (
                f"learning rate x{self.lr_scale:g} and kl_beta x{self.kl_beta_scale:g} from here on "
                f"(x{adjusted.lr_scale:g} and x{adjusted.kl_beta_scale:g} of the settings' in all)"
            )
        self.rollbacks += 1
        event["rollbacks"] = self.rollbacks
        self.events.append(event)
        rank_zero_warn(
            f"{seen}; rolled back to the weights and optimizer state of step {snapshot.step} "
            f"({self.monitor} = {snapshot.value:.4g}), rollback {self.rollbacks} of {self.max_rollbacks}; "
            f"{changes}. global_step and the data go on from step {step}"
        )
        self._log_event(trainer, event)

    def _log_event(self, trainer: pl.Trainer, event: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics({ROLLBACKS: float(self.rollbacks)}, step=event["step"])
        if trainer.is_global_zero and not trainer.fast_dev_run:
            path = output_dir(trainer, self.output_dir) / LOG_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(path, event)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"watch": self.watch.state_dict(), "rollbacks": self.rollbacks, "events": list(self.events)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.watch.load_state_dict(state_dict["watch"])
        self.rollbacks, self.events = state_dict["rollbacks"], list(state_dict["events"])


def check_guard_settings(
    monitor: str,
    mode: str,
    drop: float | None,
    min_value: float | None,
    max_value: float | None,
    patience: int,
    max_rollbacks: int,
    lr_scale: float,
    kl_beta_scale: float,
) -> None:
    """Refuse, by name, a CollapseGuard setting out of its range, or a guard with no rule."""
    checks = {
        "monitor": (monitor, isinstance(monitor, str) and bool(monitor), "a logged metric's name"),
        "mode": (mode, mode in ("max", "min"), "'max' or 'min'"),
        "drop": (drop, drop is None or drop >= 0, "None or >= 0"),
        "patience": (patience, _count(patience) and patience >= 1, "an integer >= 1"),
        "max_rollbacks": (max_rollbacks, _count(max_rollbacks) and max_rollbacks >= 0, "an integer >= 0"),
        "lr_scale": (lr_scale, 0 < lr_scale <= 1, "in (0, 1]"),
        "kl_beta_scale": (kl_beta_scale, kl_beta_scale >= 1, ">= 1"),
    }
    for name, (value, ok, words) in checks.items():
        if not ok:
            raise ValueError(f"collapse_guard.{name} must be {words}, got {value!r}")
    if drop is None and min_value is None and max_value is None:
        raise ValueError("collapse_guard needs a rule: set drop, min_value or max_value")
    if min_value is not None and max_value is not None and min_value > max_value:
        raise ValueError(f"collapse_guard.min_value ({min_value}) is above max_value ({max_value})")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
