"""The policy terms of the token-level loss types, one function each (their registry is
``_KINDS`` in losses.py): PPO's clipped ratio (dual-clipped with ``clip_ratio_c``), CISPO's
clipped-weight REINFORCE and SAPO's soft gate.

Each takes the ratio ``r`` (B, T) (or (B, 1) at sequence level), the advantages (B, 1), the
policy's log-probs and mask (B, T) and the loss settings, and returns the term to minimise
(broadcastable to (B, T)) and where a clip bit on the low and the high side (for the metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor


class LossSettings(Protocol):
    """What the policy terms read of grpo.LossSettings (whose docstring says what each is)."""

    @property
    def clip_range(self) -> tuple[float, float]: ...

    @property
    def clip_ratio_c(self) -> float | None: ...

    @property
    def sapo_temperature_pos(self) -> float: ...

    @property
    def sapo_temperature_neg(self) -> float: ...


Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, LossSettings], tuple[Tensor, Tensor, Tensor]]


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> Tensor:
    """PPO's pessimistic objective, negated to be a loss; ``ratio`` and ``advantages`` broadcast.
    With ``dual_clip`` c, a negative advantage's term is at most ``-c * A`` (dual-clip PPO)."""
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    policy = -torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip is None:
        return policy
    return torch.where(advantages < 0, torch.minimum(policy, -dual_clip * advantages), policy)


def clip_masks(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Where the clip actually changes the objective (its gradient is zero there), low and high side."""
    low = (ratio < 1 - eps_low) & (advantages < 0)
    high = (ratio > 1 + eps_high) & (advantages > 0)
    return low, high


def ppo_clip(
    ratio: Tensor, advantages: Tensor, logp: Tensor, mask: Tensor, settings: LossSettings
) -> tuple[Tensor, Tensor, Tensor]:
    """grpo's, dapo's and dr_grpo's term ``-min(r A, clip(r) A)``, at most ``-clip_ratio_c * A``
    where ``A < 0`` when dual-clipped (Ye et al., arXiv 1912.09729)."""
    eps_low, eps_high = settings.clip_range
    policy = clipped_surrogate(ratio, advantages, eps_low, eps_high, settings.clip_ratio_c)
    return (policy, *clip_masks(ratio.detach(), advantages, eps_low, eps_high))


def cispo(
    ratio: Tensor, advantages: Tensor, logp: Tensor, mask: Tensor, settings: LossSettings
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO's REINFORCE term ``-sg(min(r, 1 + eps_high)) * A * logp`` (MiniMax-M1, arXiv
    2506.13585); the high side counts the tokens whose weight the cap lowered, whatever the
    advantage's sign."""
    cap = 1 + settings.clip_range[1]
    weight = ratio.detach().clamp(max=cap)  # (B, T), a constant: REINFORCE, not a ratio's gradient
    policy = -weight * advantages * torch.where(mask, logp, 0)
    return policy, torch.zeros_like(mask), ratio.detach() > cap


def sapo(
    ratio: Tensor, advantages: Tensor, logp: Tensor, mask: Tensor, settings: LossSettings
) -> tuple[Tensor, Tensor, Tensor]:
    """SAPO's soft-gated term ``-sigmoid(tau (r - 1)) * 4 / tau * A`` (Qwen, arXiv 2511.20347),
    ``tau`` by the advantage's sign; no hard clip, so nothing counts as clipped."""
    pos = advantages.new_tensor(settings.sapo_temperature_pos)
    neg = advantages.new_tensor(settings.sapo_temperature_neg)
    tau = torch.where(advantages > 0, pos, neg)  # (B, 1)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    no_clip = torch.zeros_like(mask)
    return -gate * advantages, no_clip, no_clip
