"""The two tensor primitives every GRPO formula uses: a masked mean and per-token log-probs."""

import torch
from torch import Tensor


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


def _scaled_float(logits: Tensor, temperature: float) -> Tensor:
    """(n, V) logits upcast to at least float32 and divided by the temperature."""
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return upcast if temperature == 1.0 else upcast / temperature


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[target], upcasting one chunk of rows at a time.

    Plain autograd would keep every chunk's float32 copy alive for the backward pass, which defeats
    the chunking; this function saves only the original logits and the (n,) logsumexp and rebuilds
    the softmax chunk by chunk when the gradient is needed. Asked for it, it also returns each row's
    entropy, from the same float32 chunk, with its gradient when ``entropy_grad`` (an entropy
    bonus in the loss), else detached.
    """

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        # logits (n, V), targets (n,) -> log-probs (n,) and entropies (n,), or (0,) without them
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        out = logits.new_empty(targets.shape, dtype=out_dtype)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else out.new_empty(0)
        for start in range(0, targets.numel(), chunk_size):
            rows = slice(start, start + chunk_size)
            scaled = _scaled_float(logits[rows], temperature)  # (c, V)
            lse[rows] = torch.logsumexp(scaled, dim=-1)
            out[rows] = scaled.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            if with_entropy:  # H = logsumexp(z) - sum softmax(z) * z
                probs = torch.exp(scaled - lse[rows].unsqueeze(-1))
                entropy[rows] = lse[rows] - (probs * scaled).sum(dim=-1)
        ctx.temperature, ctx.chunk_size, ctx.entropy_grad = temperature, chunk_size, entropy_grad
        if entropy_grad:
            ctx.save_for_backward(logits, targets, lse, entropy)
        else:
            ctx.save_for_backward(logits, targets, lse)
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, lse, *entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, targets.numel(), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            log_probs = _scaled_float(logits[rows], ctx.temperature) - lse[rows].unsqueeze(-1)  # (c, V)
            probs = torch.exp(log_probs)
            grad_rows = grad_out[rows].unsqueeze(-1)  # (c, 1)
            # d/dz of (z_target - logsumexp z) is onehot(target) - softmax(z); z = logits / T.
            chunk_grad = (-probs * grad_rows).scatter_add(-1, targets[rows].unsqueeze(-1), grad_rows)
            if ctx.entropy_grad and grad_entropy is not None:
                # d/dz_k of H = -sum p log p is -p_k (log p_k + H).
                h = entropy[0][rows].unsqueeze(-1)
                chunk_grad = chunk_grad - probs * (log_probs + h) * grad_entropy[rows].unsqueeze(-1)
            grad_logits[rows] = chunk_grad / ctx.temperature
        return grad_logits, None, None, None, None, None


def token_log_probs(
    logits: Tensor, target_ids: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each target token; see :func:`token_log_probs_and_entropy`."""
    return _token_log_probs(logits, target_ids, temperature, chunk_size, False, False)[0]


def token_log_probs_and_entropy(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Computed as the gathered logit minus the logsumexp over the vocabulary, so no (..., V) log-softmax
    is ever materialised. The caller aligns logits and targets (shifts by one) beforehand.

    Args:
        logits: (..., V) in any floating dtype.
        target_ids: (...) integer ids, the same leading shape as ``logits``.
        temperature: sampling temperature the completions were drawn with; must be > 0.
        chunk_size: rows of the flattened leading dims upcast at a time, forward and backward;
            ``None`` processes all rows at once. The result does not depend on it.
        entropy_grad: the entropy differentiable w.r.t. logits too (an entropy term in the loss).

    Returns:
        (...) log-probabilities in float32 (float64 for float64 logits), differentiable w.r.t. logits,
        and (...) the entropy of each position's ``softmax(logits / temperature)``, detached unless
        ``entropy_grad``.
    """
    return _token_log_probs(logits, target_ids, temperature, chunk_size, True, entropy_grad)


def _token_log_probs(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float,
    chunk_size: int | None,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
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
    flat, entropy = _ChunkedTokenLogProbs.apply(
        flat_logits, flat_targets, float(temperature), rows, with_entropy, entropy_grad
    )
    return flat.view(target_ids.shape), entropy.view(target_ids.shape) if with_entropy else entropy
