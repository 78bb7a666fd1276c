"""GRPO math as free functions of tensors: advantages, per-token log-probs, masked means, losses.

Nothing here knows about models, tokenizers or Lightning, so every formula can be checked on small
tensors written by hand. Shapes use B for the batch of completions, T for completion length, V for
the vocabulary and G for the group size.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

LossType = Literal["grpo", "dapo", "dr_grpo", "forge"]
AdvantageScale = Literal["group", "batch", "none"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)

_STD_EPS = 1e-8


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is non-zero.

    Args:
        values: any shape, floating.
        mask: same shape as ``values``; 0/1, bool or float.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``values`` reduced over ``dim``. The count is clamped to at least 1, so a fully masked slice
        gives 0 rather than NaN.
    """
    weight = mask.to(values.dtype)
    # masked_fill rather than a plain product: padding may hold inf/NaN, and inf * 0 is NaN.
    total = (values.masked_fill(weight == 0, 0) * weight).sum(dim=dim)
    return total / weight.sum(dim=dim).clamp(min=1)


# ---------------------------------------------------------------------------------------------------
# Advantages


def _group_std(grouped: Tensor) -> Tensor:
    return grouped.std(dim=1, keepdim=True) + _STD_EPS  # (N/G, 1)


def _batch_std(grouped: Tensor) -> Tensor:
    return grouped.std() + _STD_EPS  # () over every raw reward in the batch


def _unit_scale(grouped: Tensor) -> Tensor:
    return grouped.new_ones(())


_ADVANTAGE_DENOMINATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "group": _group_std,
    "batch": _batch_std,
    "none": _unit_scale,
}


def group_advantages(rewards: Tensor, group_size: int, scale: AdvantageScale = "group") -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally rescaled.

    Args:
        rewards: (N,) flat rewards with groups contiguous, so ``rewards[0:G]`` is group 0.
        group_size: G, completions per prompt; at least 2 and must divide N.
        scale: ``"group"`` divides by the group's std, ``"batch"`` by the std of all N rewards,
            ``"none"`` leaves the centred rewards as they are. Stds use Bessel's correction.

    Returns:
        (N,) advantages in the rewards' floating dtype (float32 for integer rewards). A group whose
        rewards are all equal gets exactly zero.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    if scale not in _ADVANTAGE_DENOMINATORS:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # Half-precision rewards would lose the small differences that the std divides back up.
    work_dtype = torch.promote_types(out_dtype, torch.float32)
    grouped = rewards.to(work_dtype).view(-1, group_size)  # (N/G, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = centred / _ADVANTAGE_DENOMINATORS[scale](grouped)
    # The mean of equal floats need not round back to the same float; force the exact zero.
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (N/G, 1)
    advantages = torch.where(all_equal, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1).to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# Per-token log-probabilities


def _scaled_float(logits: Tensor, temperature: float) -> Tensor:
    """(n, V) logits upcast to at least float32 and divided by the temperature."""
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return upcast if temperature == 1.0 else upcast / temperature


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[target], upcasting one chunk of rows at a time.

    Plain autograd would keep every chunk's float32 copy alive for the backward pass, which defeats
    the chunking; this function saves only the original logits and the (n,) logsumexp and rebuilds
    the softmax chunk by chunk when the gradient is needed.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> Tensor:
        # logits (n, V), targets (n,) -> (n,)
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        out = logits.new_empty(targets.shape, dtype=out_dtype)
        lse = torch.empty_like(out)
        for start in range(0, targets.numel(), chunk_size):
            rows = slice(start, start + chunk_size)
            scaled = _scaled_float(logits[rows], temperature)  # (c, V)
            lse[rows] = torch.logsumexp(scaled, dim=-1)
            out[rows] = scaled.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, targets.numel(), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            probs = torch.exp(_scaled_float(logits[rows], ctx.temperature) - lse[rows].unsqueeze(-1))
            grad_rows = grad_out[rows].unsqueeze(-1)  # (c, 1)
            # d/dz of (z_target - logsumexp z) is onehot(target) - softmax(z); z = logits / T.
            chunk_grad = (-probs * grad_rows).scatter_add(-1, targets[rows].unsqueeze(-1), grad_rows)
            grad_logits[rows] = chunk_grad / ctx.temperature
        return grad_logits, None, None, None


def token_log_probs(
    logits: Tensor, target_ids: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Computed as the gathered logit minus the logsumexp over the vocabulary, so no (..., V) log-softmax
    is ever materialised. The caller aligns logits and targets (shifts by one) beforehand.

    Args:
        logits: (..., V) in any floating dtype.
        target_ids: (...) integer ids, the same leading shape as ``logits``.
        temperature: sampling temperature the completions were drawn with; must be > 0.
        chunk_size: rows of the flattened leading dims upcast at a time, forward and backward;
            ``None`` processes all rows at once. The result does not depend on it.

    Returns:
        (...) log-probabilities in float32 (float64 for float64 logits), differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits (..., V) and target_ids (...) disagree: "
            f"{tuple(logits.shape)} vs {tuple(target_ids.shape)}"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (n, V)
    flat_targets = target_ids.reshape(-1).long()  # (n,)
    rows = chunk_size or max(flat_targets.numel(), 1)
    flat = _ChunkedTokenLogProbs.apply(flat_logits, flat_targets, float(temperature), rows)
    return flat.view(target_ids.shape)


# ---------------------------------------------------------------------------------------------------
# Losses


@dataclass(frozen=True)
class _LossInputs:
    """Validated arguments of :func:`grpo_loss`; per-token tensors are (B, T), advantages (B,)."""

    logp: Tensor
    old_logp: Tensor
    ref_logp: Tensor | None
    advantages: Tensor
    mask: Tensor  # bool
    eps_low: float
    eps_high: float
    kl_beta: float
    max_completion_length: int
    token_normalizer: Tensor | float | None

    def __post_init__(self) -> None:
        # A (B, 1) advantage would silently broadcast to (B, B, T) below; fail loudly instead.
        per_token = {"old_logp": self.old_logp, "ref_logp": self.ref_logp, "mask": self.mask}
        for name, tensor in per_token.items():
            if tensor is not None and tensor.shape != self.logp.shape:
                raise ValueError(
                    f"{name} must match logp's shape {tuple(self.logp.shape)}, got {tuple(tensor.shape)}"
                )
        if self.logp.dim() != 2 or self.advantages.shape != self.logp.shape[:1]:
            raise ValueError(
                f"expected logp (B, T) and advantages (B,), got {tuple(self.logp.shape)} and "
                f"{tuple(self.advantages.shape)}"
            )


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's pessimistic objective, negated to be a loss; ``ratio`` and ``advantages`` broadcast."""
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _clip_masks(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Where the clip actually changes the objective (its gradient is zero there), low and high side."""
    low = (ratio < 1 - eps_low) & (advantages < 0)
    high = (ratio > 1 + eps_high) & (advantages > 0)
    return low, high


def _k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL, exp(x) - x - 1: unbiased for the KL and never negative."""
    return torch.exp(log_ratio) - log_ratio - 1


def _add_kl(policy: Tensor, kl: Tensor, beta: float) -> Tensor:
    # Skipping the term at beta 0 keeps an overflowing KL (inf * 0 = NaN) out of the loss.
    return policy + beta * kl if beta > 0 else policy


def _forge_loss(x: _LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Forge's literal loss: one ratio per sequence, of mean token log-probs, against the reference."""
    assert x.ref_logp is not None  # grpo_loss guarantees it for "forge"
    log_ratio = masked_mean(x.logp, x.mask, dim=1) - masked_mean(x.ref_logp, x.mask, dim=1)  # (B,)
    ratio = torch.exp(log_ratio)
    policy = _clipped_surrogate(ratio, x.advantages, x.eps_low, x.eps_high).mean()
    kl = _k3(log_ratio).mean()
    low, high = _clip_masks(ratio.detach(), x.advantages, x.eps_low, x.eps_high)
    metrics = {
        "policy_loss": policy,
        "kl": kl,
        "clip_fraction_low": low.float().mean(),
        "clip_fraction_high": high.float().mean(),
    }
    return _add_kl(policy, kl, x.kl_beta), metrics


def _token_level_loss(
    x: _LossInputs, reduce: Callable[[Tensor, Tensor], Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token clipped surrogate plus k3 penalty shared by grpo, dapo and dr_grpo.

    ``reduce`` maps (B, T) per-token values and the mask to a scalar; it is the only difference
    between those three losses, and it is applied to the policy term alone for the metric.
    """
    advantages = x.advantages.unsqueeze(-1)  # (B, 1)
    # Zero the log-ratios on padding before exp: garbage there could overflow, and inf * 0 grads are NaN.
    log_ratio = torch.where(x.mask, x.logp - x.old_logp, 0)  # (B, T)
    ratio = torch.exp(log_ratio)
    policy = _clipped_surrogate(ratio, advantages, x.eps_low, x.eps_high)  # (B, T)
    per_token = policy
    kl_metric = x.logp.new_zeros(())
    if x.ref_logp is not None:
        kl = _k3(torch.where(x.mask, x.ref_logp - x.logp, 0))  # (B, T)
        per_token = _add_kl(policy, kl, x.kl_beta)
        kl_metric = masked_mean(kl.detach(), x.mask)
    low, high = _clip_masks(ratio.detach(), advantages, x.eps_low, x.eps_high)
    metrics = {
        "policy_loss": reduce(policy.detach(), x.mask),
        "kl": kl_metric,
        "clip_fraction_low": masked_mean(low.float(), x.mask),
        "clip_fraction_high": masked_mean(high.float(), x.mask),
    }
    return reduce(per_token, x.mask), metrics


def _grpo_loss(x: _LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """DeepSeekMath: mean over tokens within each sequence, then over sequences that have tokens."""

    def reduce(values: Tensor, mask: Tensor) -> Tensor:
        per_sequence = masked_mean(values, mask, dim=1)  # (B,)
        # A sequence without tokens would otherwise drag the mean towards zero.
        return masked_mean(per_sequence, mask.any(dim=1))

    return _token_level_loss(x, reduce)


def _dapo_loss(x: _LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO: sum over all tokens over a token count, so long completions weigh as much per token."""

    def reduce(values: Tensor, mask: Tensor) -> Tensor:
        count = mask.sum() if x.token_normalizer is None else x.token_normalizer
        normalizer = torch.as_tensor(count, dtype=values.dtype, device=values.device).clamp(min=1)
        return values.masked_fill(~mask, 0).sum() / normalizer

    return _token_level_loss(x, reduce)


def _dr_grpo_loss(x: _LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr. GRPO: sum over tokens over a constant, removing the length bias of per-sequence means."""

    def reduce(values: Tensor, mask: Tensor) -> Tensor:
        normalizer = max(values.shape[0] * x.max_completion_length, 1)
        return values.masked_fill(~mask, 0).sum() / normalizer

    return _token_level_loss(x, reduce)


_LOSS_FUNCTIONS: dict[str, Callable[[_LossInputs], tuple[Tensor, dict[str, Tensor]]]] = {
    "grpo": _grpo_loss,
    "dapo": _dapo_loss,
    "dr_grpo": _dr_grpo_loss,
    "forge": _forge_loss,
}


def _check_loss_arguments(
    loss_type: str,
    ref_logp: Tensor | None,
    clip_epsilon: float,
    clip_epsilon_high: float | None,
    kl_beta: float,
    max_completion_length: int | None,
) -> None:
    if loss_type not in _LOSS_FUNCTIONS:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if clip_epsilon <= 0:
        raise ValueError(f"clip_epsilon must be > 0, got {clip_epsilon}")
    if clip_epsilon_high is not None and clip_epsilon_high <= 0:
        raise ValueError(f"clip_epsilon_high must be > 0, got {clip_epsilon_high}")
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"max_completion_length must be at least 1, got {max_completion_length}")
    if ref_logp is None and (kl_beta > 0 or loss_type == "forge"):
        raise ValueError(f"ref_logp is required when kl_beta > 0 or loss_type == 'forge' (got {loss_type!r})")


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: LossType = "grpo",
    clip_epsilon: float = 0.2,
    clip_epsilon_high: float | None = None,
    kl_beta: float = 0.01,
    max_completion_length: int | None = None,
    token_normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss with a k3 KL penalty towards the reference policy.

    Args:
        logp: (B, T) per-token log-probs of the completions under the policy being trained.
        old_logp: (B, T) the same under the policy that sampled them; ``None`` means ``logp``
            detached (ratio 1, one optimisation step per rollout).
        ref_logp: (B, T) the same under the frozen reference; may be ``None`` only when
            ``kl_beta == 0`` and ``loss_type != "forge"``.
        advantages: (B,) one advantage per completion.
        mask: (B, T) 1 on completion tokens, 0 on padding; bool or float.
        loss_type: ``"grpo"`` (per-sequence means), ``"dapo"`` (per-token mean), ``"dr_grpo"``
            (sum over a constant) or ``"forge"`` (one ratio per sequence against the reference).
        clip_epsilon: lower clip range, 1 - eps; also the upper one unless ``clip_epsilon_high``.
        clip_epsilon_high: upper clip range, 1 + eps (DAPO's clip-higher); ``None`` uses clip_epsilon.
        kl_beta: weight of the KL penalty.
        max_completion_length: the constant of ``"dr_grpo"``; ``None`` uses T.
        token_normalizer: the token count ``"dapo"`` divides by; pass the whole rollout's count
            when a batch is split across micro-batches or ranks. ``None`` uses this mask's count.

    Returns:
        The scalar loss and detached scalar metrics ``policy_loss``, ``kl``, ``clip_fraction_low``
        and ``clip_fraction_high`` (fractions of masked tokens, or of sequences for ``"forge"``).
    """
    _check_loss_arguments(
        loss_type, ref_logp, clip_epsilon, clip_epsilon_high, kl_beta, max_completion_length
    )
    inputs = _LossInputs(
        logp=logp,
        old_logp=logp.detach() if old_logp is None else old_logp,
        ref_logp=ref_logp,
        advantages=advantages,
        mask=mask.bool(),
        eps_low=clip_epsilon,
        eps_high=clip_epsilon if clip_epsilon_high is None else clip_epsilon_high,
        kl_beta=kl_beta,
        max_completion_length=mask.shape[1] if max_completion_length is None else max_completion_length,
        token_normalizer=token_normalizer,
    )
    loss, metrics = _LOSS_FUNCTIONS[loss_type](inputs)
    return loss, {name: value.detach() for name, value in metrics.items()}
