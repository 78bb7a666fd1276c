"""Group-relative advantages: each completion's reward against its group's.

An estimator is one entry of ``_ESTIMATORS``: the baseline each reward is measured against and,
for one that normalises itself (``reinforce_pp``), its own divisor in place of the scale's.
Adding an estimator means its function, its entry here and its name in ``AdvantageEstimator``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)

_STD_EPS = 1e-8


def _group_std(grouped: Tensor) -> Tensor:
    return grouped.std(dim=1, keepdim=True) + _STD_EPS  # (N/G, 1)


def _batch_std(grouped: Tensor) -> Tensor:
    return grouped.std() + _STD_EPS  # () over every value in the batch


def _unit_scale(grouped: Tensor) -> Tensor:
    return grouped.new_ones(())


_ADVANTAGE_DENOMINATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "group": _group_std,
    "batch": _batch_std,
    "none": _unit_scale,
}


def _minus_group_mean(grouped: Tensor) -> Tensor:
    """(N/G, G) each reward minus its group's mean (GRPO's baseline)."""
    return grouped - grouped.mean(dim=1, keepdim=True)


def _minus_leave_one_out_mean(grouped: Tensor) -> Tensor:
    """(N/G, G) each reward minus the mean of the other G - 1 of its group (RLOO, Ahmadian et al.
    2024, arXiv 2402.14740): ``r - (sum - r) / (G - 1)``, which is ``G / (G - 1) x (r - mean)``."""
    size = grouped.shape[1]
    return (grouped - grouped.mean(dim=1, keepdim=True)) * (size / (size - 1))


@dataclass(frozen=True)
class _Estimator:
    """One advantage estimator: ``centred`` maps the (N/G, G) rewards to each one's distance from
    its baseline; ``divisor``, when set, divides them instead of the scale's std and is
    taken over the whole batch's centred rewards (every rank's, when gathered)."""

    centred: Callable[[Tensor], Tensor]
    divisor: Callable[[Tensor], Tensor] | None = None


_ESTIMATORS: dict[str, _Estimator] = {
    "grpo": _Estimator(_minus_group_mean),
    "rloo": _Estimator(_minus_leave_one_out_mean),
    # REINFORCE++-baseline (Hu et al., arXiv 2501.03262): the group mean removed, then the batch
    # normalised by its own std (the batch mean of the centred values is 0, so none is removed).
    "reinforce_pp": _Estimator(_minus_group_mean, _batch_std),
}


def scales_itself(estimator: AdvantageEstimator) -> bool:
    """Whether the estimator divides by a std of its own (then the scale must be ``none``)."""
    return _ESTIMATORS[estimator].divisor is not None


def needs_batch(scale: AdvantageScale, estimator: AdvantageEstimator = "grpo") -> bool:
    """Whether the advantages read the whole batch's rewards (every rank's, under data parallelism):
    the ``batch`` scale's std, or an estimator that normalises over the batch."""
    return scale == "batch" or scales_itself(estimator)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: AdvantageScale = "group",
    batch_rewards: Tensor | None = None,
    estimator: AdvantageEstimator = "grpo",
) -> Tensor:
    """Group-relative advantages: each reward against its group's baseline, optionally rescaled.

    Args:
        rewards: (N,) flat rewards with groups contiguous, so ``rewards[0:G]`` is group 0.
        group_size: G, completions per prompt; at least 2 and must divide N.
        scale: ``"group"`` divides by the group's std, ``"batch"`` by the std of all N rewards,
            ``"none"`` leaves the centred rewards as they are. Stds use Bessel's correction.
        batch_rewards: the rewards a batch statistic is taken over, when more than ``rewards``
            (every rank's, under data parallelism; groups contiguous); None: ``rewards``.
        estimator: the baseline. ``grpo``: the group's mean. ``rloo``: the mean of the other G - 1
            completions of the group (``G / (G - 1)`` times grpo's centred reward), then ``scale``
            as for grpo (RLOO's own is ``none``). ``reinforce_pp`` (REINFORCE++-baseline): the
            group's mean removed, then divided by the std of those centred rewards over the whole
            batch (``batch_rewards``) instead of by ``scale`` (which must be ``none``). It differs
            from ``grpo`` with ``scale="batch"``, whose std is of the raw rewards: that one counts
            the spread between prompts (an easy prompt's rewards against a hard one's), this one
            only the spread within groups, the part the advantages are made of.

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
    if estimator not in _ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    kind = _ESTIMATORS[estimator]
    if scales_itself(estimator) and scale != "none":
        raise ValueError(
            f"estimator {estimator!r} divides by its own batch std: scale must be 'none', got {scale!r}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # Half-precision rewards would lose the small differences that the std divides back up.
    work_dtype = torch.promote_types(out_dtype, torch.float32)
    grouped = rewards.to(work_dtype).view(-1, group_size)  # (N/G, G)
    batch = grouped if batch_rewards is None else batch_rewards.to(work_dtype).view(-1, group_size)
    centred = kind.centred(grouped)
    if kind.divisor is not None:
        advantages = centred / kind.divisor(kind.centred(batch))
    else:
        advantages = centred / _ADVANTAGE_DENOMINATORS[scale](batch if scale == "batch" else grouped)
    # The mean of equal floats need not round back to the same float; force the exact zero.
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (N/G, 1)
    advantages = torch.where(all_equal, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1).to(out_dtype)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(N/G,) True for each group whose rewards are not all equal: the only groups whose
    advantages, and so policy gradient, are not zero (DAPO's dynamic sampling keeps these)."""
    grouped = rewards.view(-1, group_size)
    return ~(grouped == grouped[:, :1]).all(dim=1)
