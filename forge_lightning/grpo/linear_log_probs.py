"""Per-token log-probs (and entropies) of a linear LM head's logits, never all of them at once.

``log softmax(hidden @ weight.T / T)[target]`` for (n, H) hidden states and a (V, H) head: the
logits of ``chunk_size`` positions at a time, upcast to float32, reduced to their log-probs,
logsumexps and entropies and dropped. The backward rebuilds each chunk's logits from the saved
hidden states and weight (one matmul) and leaves with its gradients, so memory holds one chunk's
(chunk, V) logits at a time, forward and backward, instead of the (n, V) that autograd would keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _LinearTokenLogProbs(torch.autograd.Function):
    """See :func:`linear_token_log_probs`. Both outputs carry gradients: the entropy's is
    ``dH/dz = -p * (log p + H)`` for ``z = logits / T``."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        # hidden (n, H), weight (V, H), targets (n,) -> log-probs (n,) and entropies (n,), or (0,)
        logp, lse, entropy = [], [], []
        for start in range(0, targets.numel(), chunk_size):
            rows = slice(start, start + chunk_size)
            z = _scaled(F.linear(hidden[rows], weight), temperature)  # (c, V), at least float32
            lse.append(torch.logsumexp(z, dim=-1))
            logp.append(z.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse[-1])
            if with_entropy:  # H = logsumexp(z) - sum p z
                entropy.append(lse[-1] - (torch.exp(z - lse[-1].unsqueeze(-1)) * z).sum(dim=-1))
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp_all, lse_all = (torch.cat(v) if v else hidden.new_zeros(0, dtype=dtype) for v in (logp, lse))
        entropy_all = torch.cat(entropy) if entropy else hidden.new_zeros(0, dtype=dtype)
        ctx.save_for_backward(hidden, weight, targets, lse_all, entropy_all)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        # The autocast of the forward, for the backward's matmuls (which run outside it).
        ctx.autocast = (hidden.device.type, *_autocast_state(hidden.device.type))
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_all)
        return logp_all, entropy_all

    @staticmethod
    def backward(
        ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        if grad_logp is None and grad_entropy is None:  # neither output was used
            return None, None, None, None, None, None
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        accumulated = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulated) if need_weight else None
        device_type, enabled, dtype = ctx.autocast
        for start in range(0, targets.numel(), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                logits = F.linear(hidden[rows], weight)  # (c, V), as in the forward
            # In place from here on: each (c, V) pass over memory costs more than its arithmetic.
            log_probs = _scaled(logits, ctx.temperature).sub_(lse[rows].unsqueeze(-1))  # (c, V)
            # d log p_target / dz = onehot(target) - p;  dH/dz = -p * (log p + H)
            g = None if grad_logp is None else grad_logp[rows].unsqueeze(-1)  # (c, 1)
            if grad_entropy is not None:
                coef = (log_probs + entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].unsqueeze(-1))
                grad_z = log_probs.exp_().mul_(coef if g is None else coef.add_(g)).neg_()
            else:
                grad_z = log_probs.exp_().mul_(-g)
            if g is not None:
                grad_z.scatter_add_(-1, targets[rows].unsqueeze(-1), g)
            if ctx.temperature != 1.0:  # z = logits / T
                grad_z.div_(ctx.temperature)
            grad_logits = grad_z.to(logits.dtype)
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits @ weight
                if grad_weight is not None:
                    grad_weight += grad_logits.T @ hidden[rows]
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """(c, V) logits upcast to at least float32 and divided by the temperature (the logits
    themselves when neither changes them)."""
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return upcast if temperature == 1.0 else upcast / temperature


def linear_token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each target token under ``softmax(hidden @ weight.T / temperature)``,
    and (``with_entropy``) the entropy of each position's distribution, ``chunk_size`` positions
    at a time.

    Args:
        hidden: (..., H) the hidden states the head reads, any floating dtype.
        weight: (V, H) the head's weight (a linear head without bias).
        targets: (...) integer ids, the leading shape of ``hidden``.
        temperature: must be > 0.
        chunk_size: positions whose logits exist at once, forward and backward; at least 1.
        with_entropy: also the entropies (None without).

    Returns:
        (...) log-probabilities and (...) entropies in float32 (float64 for float64 inputs), both
        differentiable w.r.t. ``hidden`` and ``weight``: the values and gradients of the full
        logits' to float tolerance.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden (..., H) and targets (...) disagree: {tuple(hidden.shape)} vs {tuple(targets.shape)}"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (n, H)
    logp, entropy = _LinearTokenLogProbs.apply(
        flat_hidden, weight, targets.reshape(-1).long(), float(temperature), chunk_size, with_entropy
    )
    return logp.view(targets.shape), entropy.view(targets.shape) if with_entropy else None
