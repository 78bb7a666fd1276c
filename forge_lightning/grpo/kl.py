"""The KL estimators, and the KL penalty subtracted from the reward (LossSettings says when) rather than
added to the loss."""

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]


def k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL, exp(x) - x - 1: unbiased for the KL and never negative."""
    return torch.exp(log_ratio) - log_ratio - 1


# Each estimator of a token's KL from ``x = ref_logp - logp`` (the loss's estimator, by name).
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda x: -x,
    "k2": lambda x: 0.5 * x**2,
    "k3": k3,
}


def kl_penalised_rewards(
    rewards: Tensor, old_logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float, estimator: KLEstimator
) -> Tensor:
    """The (B,) rewards less ``beta x`` each completion's KL to the reference: the sum over its
    ``mask`` tokens (B, T) of the ``estimator`` of ``x = ref_logp - old_logp``, ``old_logp`` the
    sampling policy's, so the penalty is a constant of the reward. verl's ``use_kl_in_reward``
    likewise sums its per-token penalty into the sequence's reward before the advantages."""
    mask = mask.bool()
    kl = KL_ESTIMATORS[estimator](torch.where(mask, ref_logp - old_logp, 0))  # (B, T)
    penalty = kl.masked_fill(~mask, 0).sum(dim=1).detach()  # (B,)
    return rewards - beta * penalty.to(rewards.dtype)
