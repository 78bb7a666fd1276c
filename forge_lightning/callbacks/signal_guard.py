"""A warning (or a stop) when a stretch of optimizer steps trains (almost) nothing."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from forge_lightning.callbacks.protocols import ReportsSteps
from forge_lightning.reporting.metrics import StepRecord, logged_name

ZERO_STD = logged_name("frac_zero_std_groups")
GRAD_NORM = logged_name("grad_norm")
# A suggested group size is the smallest whose chance of a group with no signal is at most this.
NO_SIGNAL_TARGET = 0.1
LARGEST_SUGGESTED_G = 1024


class SignalGuardError(RuntimeError):
    """The stop of a run SignalGuard found training nothing (``mode: fail``); the message starts
    with ``SignalGuard:``."""


@dataclass
class RewardTally:
    """What a stretch's rewards were, in a few numbers: enough for a 0/1 reward's pass rate and to
    tell a reward that never varies."""

    count: int = 0
    total: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    binary: bool = True  # every reward 0 or 1

    def add(self, rewards: Tensor) -> None:
        """Count ``rewards`` (any shape; the non-finite ones are left out)."""
        values = rewards.detach().float().reshape(-1)
        values = values[values.isfinite()]
        if not values.numel():
            return
        self.count += values.numel()
        self.total += float(values.sum())
        self.low, self.high = min(self.low, float(values.min())), max(self.high, float(values.max()))
        self.binary = self.binary and bool(((values == 0) | (values == 1)).all())

    def merge(self, other: RewardTally) -> None:
        if other.count:
            self.count, self.total = self.count + other.count, self.total + other.total
            self.low, self.high = min(self.low, other.low), max(self.high, other.high)
            self.binary = self.binary and other.binary


@dataclass
class Stretch:
    """Consecutive optimizer steps that trained (almost) nothing, and what they showed."""

    start: int  # global_step before its first step
    steps: int = 0
    zero_std_total: float = 0.0  # the sum of its steps' zero-std shares ...
    zero_std_steps: int = 0  # ... over the steps that logged one
    grad_norm_max: float | None = None  # None: no step logged a norm (skipped steps)
    moved: bool = False  # whether any of its steps changed a trainable tensor
    rewards: RewardTally = field(default_factory=RewardTally)
    reported: bool = False

    @property
    def zero_std_share(self) -> float | None:
        return self.zero_std_total / self.zero_std_steps if self.zero_std_steps else None


@dataclass
class SignalRule:
    """When an optimizer step trains (almost) nothing: a zero-std group share of at least
    ``zero_std_share``, a gradient norm below ``min_grad_norm``, or no trainable tensor changed."""

    zero_std_share: float = 0.9
    min_grad_norm: float = 1e-8

    def idle(self, metrics: dict[str, float], moved: bool | None) -> bool:
        """Whether a step with these logged ``metrics`` (a StepRecord's) trained nothing; ``moved``:
        whether it changed a trainable tensor (None: not known)."""
        zero_std, grad_norm = metrics.get(ZERO_STD), metrics.get(GRAD_NORM)
        return (
            (zero_std is not None and zero_std >= self.zero_std_share)
            or (grad_norm is not None and grad_norm < self.min_grad_norm)
            or moved is False
        )


class SignalWatch:
    """The stretches of idle optimizer steps, record by record (no Trainer: the rule alone)."""

    def __init__(self, rule: SignalRule, patience: int, step: int = 0) -> None:
        self.rule, self.patience = rule, patience
        self.step = step  # global_step of the latest record seen
        self.pending = RewardTally()  # the rewards of the step in progress
        self.stretch: Stretch | None = None

    def observe(self, record: StepRecord, moved: bool | None) -> Stretch | None:
        """Take one record (``moved``: whether its steps changed a trainable tensor; None: not
        known); the stretch when it reaches ``patience`` steps, once per stretch, else None."""
        self.pending.add(record.rewards)
        if not record.metrics:  # a batch that only accumulated gradients
            return None
        steps, start = max(record.step - self.step, 1), self.step
        self.step = record.step
        pending, self.pending = self.pending, RewardTally()
        if not self.rule.idle(record.metrics, moved):
            self.stretch = None
            return None
        stretch = self.stretch = self.stretch or Stretch(start)
        stretch.steps += steps
        stretch.rewards.merge(pending)
        stretch.moved = stretch.moved or moved is True
        if ZERO_STD in record.metrics:
            stretch.zero_std_total += record.metrics[ZERO_STD] * steps
            stretch.zero_std_steps += steps
        if GRAD_NORM in record.metrics:
            stretch.grad_norm_max = max(stretch.grad_norm_max or 0.0, record.metrics[GRAD_NORM])
        if stretch.steps < self.patience or stretch.reported:
            return None
        stretch.reported = True
        return stretch

    def state_dict(self) -> dict[str, Any]:
        stretch = None if self.stretch is None else asdict(self.stretch)
        return {"step": self.step, "pending": asdict(self.pending), "stretch": stretch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.pending = state["step"], RewardTally(**state["pending"])
        stretch = state["stretch"]
        if stretch is not None:
            stretch = Stretch(**{**stretch, "rewards": RewardTally(**stretch["rewards"])})
        self.stretch = stretch


def no_signal_chance(p: float, group_size: int) -> float:
    """The chance that a group of ``group_size`` 0/1 rewards at pass rate ``p`` is all equal."""
    return p**group_size + (1 - p) ** group_size


def group_size_for(p: float, target: float = NO_SIGNAL_TARGET) -> int | None:
    """The smallest G (2 to 1024) whose groups have no signal with chance at most ``target`` at pass
    rate ``p``; None where there is none (p of 0 or 1: never)."""
    return next((g for g in range(2, LARGEST_SUGGESTED_G + 1) if no_signal_chance(p, g) <= target), None)


def reward_advice(
    rewards: RewardTally, group_size: int | None, dynamic_sampling: bool, groups_vary: bool = False
) -> str:
    """What a stretch's rewards say about the group size: a pass rate's (0/1 rewards) suggested G,
    a reward that never varies, or (other rewards) no suggestion; where most groups' rewards vary
    (``groups_vary``: the zero-std share was under the rule's), that the signal is lost after them."""
    if not rewards.count:
        return "No reward was seen."
    if rewards.low == rewards.high:
        return (
            f"The reward never varies (all {rewards.count} were {rewards.low:g}): no G helps; check "
            "that the reward can tell these completions apart."
        )
    if groups_vary:
        return (
            "Most groups' rewards vary, so the signal is lost after the reward: check learning_rate, "
            "which weights are trainable, and the loss settings."
        )
    dynamic = "" if dynamic_sampling else "; or dynamic_sampling: true trains on the groups that vary"
    if not rewards.binary:
        return (
            f"The rewards are not 0/1 (from {rewards.low:g} to {rewards.high:g} over {rewards.count}), "
            f"so no G is suggested from a pass rate{dynamic}."
        )
    p = rewards.total / rewards.count
    now = "" if group_size is None else f"at G={group_size} {no_signal_chance(p, group_size):.2f}; "
    g = group_size_for(p)
    better = f"G={g} brings it to {NO_SIGNAL_TARGET}" if g else f"no G up to {LARGEST_SUGGESTED_G} does"
    return (
        f"Pass rate p={p:.3f} over {rewards.count} 0/1 rewards: a group has no signal with chance "
        f"p^G + (1-p)^G, {now}{better}{dynamic}."
    )


def describe(stretch: Stretch, rule: SignalRule, patience: int, advice: str) -> str:
    """The one message of a stretch: ``SignalGuard:``, its steps, its numbers against the rule's."""
    share, norm = stretch.zero_std_share, stretch.grad_norm_max
    share_text = "n/a" if share is None else f"{share:.0%}"
    norm_text = "n/a" if norm is None else f"{norm:.3g}"
    numbers = [
        f"zero-std groups {share_text} (idle at >= {rule.zero_std_share:.0%})",
        f"gradient norm at most {norm_text} (idle below {rule.min_grad_norm:g})",
        "trainable weights " + ("changed" if stretch.moved else f"unchanged since step {stretch.start}"),
    ]
    first, last = stretch.start + 1, stretch.start + stretch.steps
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    return (
        f"SignalGuard: optimizer {steps} ({stretch.steps} in a row, patience {patience}) trained "
        f"(almost) nothing: {'; '.join(numbers)}. {advice}"
    )


class SignalGuard(Callback):
    """Warns, with the numbers, when ``patience`` optimizer steps in a row train (almost) nothing;
    under ``mode: fail`` it stops the run instead (an error that starts ``SignalGuard:``).

    A step trains nothing when its share of zero-std groups (all G rewards equal: zero advantages)
    is at least ``zero_std_share``, or its gradient norm is below ``min_grad_norm``, or it changed
    no trainable tensor (the LoRA adapter's under ``peft``): each tensor's norm, taken at the start
    of training and after each step, is exactly what it was (an optimizer step with a nonzero
    gradient changes it). The message gives the stretch's mean zero-std share, its largest gradient
    norm and whether the weights moved, and what the rewards say: for 0/1 rewards the pass rate p
    and the smallest G whose groups lack a signal (chance p^G + (1-p)^G) at most one time in ten,
    and dynamic sampling; for a reward that never varies, that no G helps; for other rewards no G;
    where most groups' rewards vary, that the signal is lost after the reward.
    Each stretch is reported once. It reads the module's step records (``ReportsSteps``) and does
    nothing with a module that has none; its counters are in the checkpoint, so a resumed run
    fires at the same step.

    Args:
        mode: ``warn`` (a warning) or ``fail`` (stop the run).
        patience: idle optimizer steps in a row before it warns or fails.
        zero_std_share: a step is idle when at least this share of its groups has zero reward std.
        min_grad_norm: a step is idle when its gradient norm (before clipping) is below this.
    """

    def __init__(
        self,
        mode: Literal["warn", "fail"] = "warn",
        patience: int = 10,
        zero_std_share: float = 0.9,
        min_grad_norm: float = 1e-8,
    ) -> None:
        if mode not in ("warn", "fail"):
            raise ValueError(f"signal_guard.mode must be 'warn' or 'fail', got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"signal_guard.patience must be an integer >= 1, got {patience!r}")
        if not 0 < zero_std_share <= 1:
            raise ValueError(f"signal_guard.zero_std_share must be in (0, 1], got {zero_std_share!r}")
        if not min_grad_norm >= 0:
            raise ValueError(f"signal_guard.min_grad_norm must be >= 0, got {min_grad_norm!r}")
        self.mode, self.patience = mode, patience
        self.rule = SignalRule(zero_std_share, min_grad_norm)
        self.watch = SignalWatch(self.rule, patience)
        self._norms: Tensor | None = None  # (N,) each trainable tensor's norm after the latest step

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before a checkpoint's state is restored (load_state_dict): a second fit starts afresh.
        if stage == "fit":
            self.watch = SignalWatch(self.rule, self.patience)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watch.step = trainer.global_step  # the restored one on a resume
        self._norms = tensor_norms(pl_module) if isinstance(pl_module, ReportsSteps) else None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if not isinstance(pl_module, ReportsSteps) or not pl_module.batch_records:
            return
        records = pl_module.batch_records
        moved = None
        if self._norms is not None and any(r.metrics for r in records):
            # One look per batch: when it took several steps, they changed nothing or not.
            norms = tensor_norms(pl_module)
            moved = not torch.equal(norms, self._norms)
            moved = trainer.strategy.reduce_boolean_decision(moved, all=False)  # a shard may move alone
            self._norms = norms
        for record in records:
            stretch = self.watch.observe(record, moved)
            if stretch is not None:
                self._report(stretch, pl_module)

    def _report(self, stretch: Stretch, pl_module: pl.LightningModule) -> None:
        group_size = pl_module.hparams.get("group_size")
        group_size = group_size if isinstance(group_size, int) else None
        dynamic = bool(pl_module.hparams.get("dynamic_sampling"))
        share = stretch.zero_std_share
        vary = share is not None and share < self.rule.zero_std_share
        advice = reward_advice(stretch.rewards, group_size, dynamic, groups_vary=vary)
        message = describe(stretch, self.rule, self.patience, advice)
        if self.mode == "fail":
            raise SignalGuardError(message)
        rank_zero_warn(message)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.watch.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.watch.load_state_dict(state_dict)


def tensor_norms(module: torch.nn.Module) -> Tensor:
    """(N,) the norm of each trainable tensor of ``module`` (a sharded one's local shard: no
    collective), in float32, on the CPU: a few numbers per tensor, not a copy of the weights."""
    with torch.no_grad():
        norms = [
            torch.linalg.vector_norm(_local(p.detach()), dtype=torch.float32)
            for p in module.parameters()
            if p.requires_grad
        ]
    return torch.stack(norms).cpu() if norms else torch.zeros(0)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # an FSDP2 shard's own part
