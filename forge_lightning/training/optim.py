"""The optimizer side of a step: AdamW with a cosine, linear or constant schedule, the schedule's length,
and the guard that skips steps whose gradient is not finite."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from forge_lightning.run.fit import FitShape
from forge_lightning.training.context import Reduce, StepContext

LR_SCHEDULES = ("cosine", "linear", "constant")


def adamw_with_schedule(
    params: list[Tensor],
    *,
    learning_rate: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    fused: bool = False,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with ``warmup_steps`` of linear warmup, then a cosine (``cosine``) or straight-line
    (``linear``, TRL's default) decay that reaches zero at ``total_steps``, or the peak rate to the
    end (``constant``)."""
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=fused)
    if schedule == "cosine":
        scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps, max(total_steps, 1))
    elif schedule == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup_steps, max(total_steps, 1))
    elif schedule == "constant":
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup_steps)
    else:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    return optimizer, scheduler


def can_fuse_adamw(params: Iterable[Tensor], *, precision: str, sharded: bool) -> bool:
    """Whether AdamW may use its fused kernel: one pass per tensor, about 4x the default loop on a
    CPU. Not under mixed precision (Lightning's MixedPrecision plugin refuses to clip gradients for
    a fused optimizer, bf16 included) nor on sharded parameters."""
    on_plain_devices = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return on_plain_devices and not sharded and not str(precision).endswith("-mixed")


def policy_optimizer(
    model: Any,
    *,
    learning_rate: float,
    weight_decay: float,
    warmup_steps: int,
    schedule: str,
    total_steps: int,
    precision: str,
    sharded: bool,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The module's AdamW over ``model``'s trainable parameters, and its schedule (fused where
    can_fuse_adamw allows)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = can_fuse_adamw(params, precision=precision, sharded=sharded)
    return adamw_with_schedule(
        params,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        schedule=schedule,
        fused=fused,
    )


def total_optimizer_steps(fit: FitShape, accumulation: int, passes: int, dynamic: bool = False) -> int:
    """Optimizer steps of the whole fit: ``max_steps`` when set, else counted from the batches
    (``accumulation`` per step, ``passes`` steps per batch where more than one; a ``dynamic`` plan's
    batches per step are not known)."""
    if fit.step_limit is not None:
        return fit.step_limit
    if fit.max_time_set:
        warnings.warn(
            f"trainer.max_time is set but trainer.max_steps is not: the learning-rate schedule is sized "
            f"from max_epochs ({fit.max_epochs}), and a run stopped by max_time ends wherever it is "
            "on it (with the default 1000 epochs the cosine barely moves). Set trainer.max_steps to "
            "give the schedule its length",
            stacklevel=2,
        )
    if dynamic:
        raise ValueError(
            "dynamic_sampling needs trainer.max_steps: how many batches an optimizer step takes is "
            "not known in advance, so the learning-rate schedule cannot be sized from the data"
        )
    batches = fit.stepping_batches()
    if not math.isfinite(batches):
        raise ValueError("the dataset has no length: set trainer.max_steps so the schedule has an end")
    epochs = max(fit.max_epochs or 1, 1)
    per_epoch = math.ceil(batches / epochs)
    if passes > 1:
        return per_epoch * epochs * passes
    return math.ceil(per_epoch / accumulation) * epochs


def gradient_norm(params: Iterable[Tensor]) -> Tensor:
    """Total 2-norm of the parameters' gradients (a plain tensor also for sharded gradients)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def scale_gradients(params: Iterable[Tensor], factor: Tensor | float) -> None:
    """Multiply every gradient by ``factor`` in place (sharded gradients included)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor.to(p.grad.device) if isinstance(factor, Tensor) else factor)


def normalise_and_clip(
    params: Iterable[Tensor], scale: Tensor, max_norm: float | None, loss_scale: float = 1.0
) -> Tensor:
    """Multiply the gradients by ``scale`` (the step's loss normaliser) and clip their total norm to
    ``max_norm`` as ``clip_grad_norm_`` does; return the norm before clipping. A non-finite norm
    leaves the gradients as they are (the step is skipped).

    One norm pass and one multiply: the norm of ``scale * g`` is ``scale * |g|``, so the scale folds
    into the clip factor (Lightning's ``clip_gradients`` would take the norm a second time).
    ``loss_scale``: a GradScaler's factor still on the gradients (16-mixed unscales them inside
    ``optimizer.step()``, after this); the norm and the clip are in unscaled units."""
    params = [p for p in params if p.grad is not None]
    raw = gradient_norm(params)
    raw = raw.to(torch.promote_types(raw.dtype, torch.float32))  # a bf16 factor would round the scale
    factor = scale.to(raw.device, raw.dtype)
    norm = raw * factor / loss_scale
    if not torch.isfinite(norm):
        return norm
    if max_norm is not None:  # torch's clip_grads_with_norm_ factor, 1e-6 included
        factor = factor * (max_norm / (norm + 1e-6)).clamp(max=1.0)
    scale_gradients(params, factor)
    return norm


class NonFiniteGuard:
    """Counts optimizer steps in a row whose gradient norm is not finite; stops the run at ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def allows(self, grad_norm: Tensor) -> bool:
        """True for a finite norm. False (with a warning) for a step to skip; raises at the limit."""
        if torch.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        warnings.warn(f"non-finite gradient norm ({grad_norm.item()}); optimizer step skipped", stacklevel=2)
        if self.in_a_row >= self.limit:
            raise RuntimeError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients; stopping. Lower "
                "learning_rate, check the reward for NaN/inf, or try a different precision"
            )
        return False


class OptimizerStep:
    """One optimizer step of manual optimization, its two guarantees included: the gradient is
    divided by the step's loss normaliser and clipped in one pass, a step whose gradient is not
    finite is skipped (``max_consecutive_bad_steps`` in a row stop the run), and a step that leaves
    a weight non-finite stops the run before a checkpoint saves it."""

    def __init__(self, clip_norm: float | None, max_consecutive_bad_steps: int) -> None:
        self.clip_norm = clip_norm  # the gradient's total norm is clipped to it (None: not clipped)
        self.guard = NonFiniteGuard(max_consecutive_bad_steps)

    def __call__(
        self, model: torch.nn.Module, optimizer: Any, scheduler: Any, count: Tensor, context: StepContext
    ) -> tuple[bool, dict[str, Tensor]]:
        """Normalise by ``count`` (every rank's, summed), clip, step, zero and schedule. Returns
        whether the weights changed, and the step's metrics (``skipped_steps``; ``lr`` and
        ``grad_norm`` of a step taken)."""
        grad_norm = normalise_and_clip(
            model.parameters(),
            context.world_size / count.clamp(min=1),
            self.clip_norm,
            context.loss_scale(),
        )
        if not self.guard.allows(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            return False, {"skipped_steps": torch.tensor([1.0])}
        taken = {"skipped_steps": torch.tensor([0.0]), "lr": torch.tensor([scheduler.get_last_lr()[0]])}
        optimizer.step()  # every gradient None after a round of uninformative groups: no update
        require_finite_parameters(
            model, context.reduce if context.world_size > 1 else None, context.global_step()
        )
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return True, {**taken, "grad_norm": grad_norm}


def all_finite(tensors: list[Tensor]) -> Tensor:
    """Per tensor, whether every element is finite, as a bool tensor of ``len(tensors)``.

    A tensor's min and max are finite exactly when all of it is (both propagate NaN). ``aminmax``
    reads the tensor once and allocates nothing of its size; ``isfinite(p).all()`` writes a full
    mask first and took ~13x as long on a 135M-parameter model on a CPU (the bulk of the step)."""
    ends = [torch.stack(torch.aminmax(t)) if t.numel() else t.new_zeros(2) for t in tensors]  # (2,) each
    return torch.stack(ends).isfinite().all(dim=1)


def loss_scale(precision: Any) -> float:
    """The factor a GradScaler (Lightning's ``MixedPrecision.scaler``, 16-mixed) left on the
    gradients at this point of a manual step; 1 for every other precision."""
    scaler = getattr(precision, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None else 1.0


def require_finite_parameters(model: torch.nn.Module, reduce: Reduce | None, step: int) -> None:
    """Raise when optimizer step ``step`` (1-based, just taken) left a trainable weight NaN or inf
    (a finite gradient can still overflow an update), before any checkpoint can save it;
    ``reduce`` sums a count over the ranks (None: one process)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        return
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]  # FSDP2 shards
    finite = all_finite(local)
    bad = (~finite).sum().float()
    if reduce is not None:
        bad = reduce(bad, "sum")
    if bad.item() == 0:
        return
    names = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    raise RuntimeError(
        f"optimizer step {step} left parameters non-finite ({shown or 'on another rank'}) although the "
        "gradient was finite; stopping before a checkpoint saves them (the last one saved is intact). "
        "Lower learning_rate or weight_decay, or use a more precise precision"
    )


def rescale_schedule(scheduler: Any, learning_rate: float, total_steps: int | None = None) -> bool:
    """Bring a schedule restored from a checkpoint to this run's settings from its current step on:
    the peak ``learning_rate`` (a resumed run's ``--model.learning_rate``) and the schedule this run
    built, sized for its ``total_steps`` (the checkpoint restores only the step and the rate its
    optimizer had: a longer ``max_steps`` would otherwise train its first step at the 0 where the
    checkpoint's cosine ended, then jump). Warns for each change; returns whether anything changed."""
    if not hasattr(scheduler, "lr_lambdas"):
        return False
    step, old_peak = scheduler.last_epoch, scheduler.base_lrs[0]
    groups = scheduler.optimizer.param_groups
    rates = [learning_rate * fn(step) for fn in scheduler.lr_lambdas]
    expected = groups[0]["lr"] * learning_rate / old_peak  # the checkpoint's schedule, at the new peak
    reshaped = not math.isclose(rates[0], expected, rel_tol=1e-6, abs_tol=1e-9 * learning_rate)
    if old_peak == learning_rate and not reshaped:
        return False
    for i, group in enumerate(groups):
        scheduler.base_lrs[i] = learning_rate
        group["initial_lr"] = learning_rate
        group["lr"] = rates[i]
    set_last_lr(scheduler, rates)
    if old_peak != learning_rate:
        warnings.warn(
            f"resumed with learning_rate {learning_rate:g} (the checkpoint's was {old_peak:g}): the "
            f"schedule continues at step {step} with the new peak rate",
            stacklevel=2,
        )
    if reshaped:
        length = "length" if total_steps is None else f"{total_steps} steps"
        warnings.warn(
            f"the learning-rate schedule is sized for this run's {length}, not the checkpoint's: at step "
            f"{step} it continues at {rates[0]:g} instead of {expected:g} (a longer trainer.max_steps "
            "stretches the decay from here on). To keep the checkpoint's schedule, resume with its "
            "trainer.max_steps; to train on at the peak rate, with --model.lr_schedule constant",
            stacklevel=2,
        )
    return True


def set_last_lr(scheduler: Any, rates: list[float]) -> None:
    """Make ``get_last_lr()`` report ``rates`` (what the optimizer now uses) without a step.

    Private: torch's LRScheduler keeps them in ``_last_lr`` and offers no setter (``step()`` would
    advance the schedule, and ``get_lr()`` outside a step warns). Checked on torch 2.13; the test
    ``test_the_private_attributes_we_rely_on_exist`` fails if torch moves it."""
    scheduler._last_lr = list(rates)
