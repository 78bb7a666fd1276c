"""Rollout correction: the policy term weighed by the sampler's log-probs against the trainer's.

:func:`~forge_lightning.grpo.losses.grpo_loss` calls :func:`sampler_corrected` when a rollout
comes with its sampler's log-probs (``behav_logp``); its docstring has the formula.
"""

from typing import Literal

import torch
from torch import Tensor

from forge_lightning.grpo.core import masked_mean

RolloutCorrection = Literal["mask", "truncate"]


def sampler_corrected(
    policy: Tensor,
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    mode: RolloutCorrection,
    level: str,
    cap: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The (B, T) policy term of a rollout whose sampler's log-probs ``behav_logp`` differ from
    ``old_logp`` (the policy the ratio is clipped around), each token weighted by the detached
    correction weight ``w``: per token, or at ``level`` ``sequence`` one per completion from the
    mean log-ratio over its ``mask`` tokens; above ``cap``, 0 (``mask``) or ``cap``
    (``truncate``). Metrics over the model tokens: ``sampler_kl`` (k3 of
    ``x = behav_logp - old_logp``, an estimate of KL(trainer || sampler)),
    ``correction_weight_mean`` (the weight applied, over the tokens it keeps) and
    ``correction_masked_fraction`` (the share given weight 0)."""
    log_w = torch.where(mask, old_logp - behav_logp, 0).detach()  # (B, T)
    if level == "sequence":
        log_w = masked_mean(log_w, mask, dim=1).unsqueeze(-1).expand_as(log_w)  # one per completion
    weight = torch.exp(log_w)
    kept = mask
    if cap is not None and mode == "mask":
        kept = mask & (weight <= cap)
    elif cap is not None:
        weight = weight.clamp(max=cap)
    weighted = policy * torch.where(kept, weight, 0)
    metrics = {
        "sampler_kl": sampler_kl(behav_logp - old_logp.detach(), mask),
        "correction_weight_mean": masked_mean(weight, kept),
        "correction_masked_fraction": masked_mean((mask & ~kept).float(), mask),
    }
    return weighted, metrics


def sampler_kl(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 of ``x = sampler_logp - trainer_logp`` over ``mask``, in float64 as ``expm1(x) - x``:
    for the tiny ``x`` of one model scored twice, float32's ``exp(x) - x - 1`` cancels to 0."""
    x = torch.where(mask, log_ratio, 0).double()
    return masked_mean(torch.expm1(x) - x, mask).to(log_ratio.dtype)
