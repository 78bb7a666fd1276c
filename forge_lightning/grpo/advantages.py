"""Group-relative advantages: each completion's reward against its group's."""

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)

_STD_EPS = 1e-8


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


def group_advantages(
    rewards: Tensor, group_size: int, scale: AdvantageScale = "group", batch_rewards: Tensor | None = None
) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally rescaled.

    Args:
        rewards: (N,) flat rewards with groups contiguous, so ``rewards[0:G]`` is group 0.
        group_size: G, completions per prompt; at least 2 and must divide N.
        scale: ``"group"`` divides by the group's std, ``"batch"`` by the std of all N rewards,
            ``"none"`` leaves the centred rewards as they are. Stds use Bessel's correction.
        batch_rewards: the rewards the ``"batch"`` std is taken over, when more than ``rewards``
            (every rank's, under data parallelism); None: ``rewards``.

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
    spread = (
        grouped if batch_rewards is None or scale != "batch" else batch_rewards.to(work_dtype).view(-1, 1)
    )
    advantages = centred / _ADVANTAGE_DENOMINATORS[scale](spread)
    # The mean of equal floats need not round back to the same float; force the exact zero.
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (N/G, 1)
    advantages = torch.where(all_equal, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1).to(out_dtype)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(N/G,) True for each group whose rewards are not all equal: the only groups whose
    advantages, and so policy gradient, are not zero (DAPO's dynamic sampling keeps these)."""
    grouped = rewards.view(-1, group_size)
    return ~(grouped == grouped[:, :1]).all(dim=1)
