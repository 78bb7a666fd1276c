"""Scoring a batch: the one place responses are turned into checked scores, per component."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from forge_lightning.grpo import group_advantages, needs_batch
from forge_lightning.rewards.library import (
    CompositeReward,
    RewardFn,
    RewardTimeout,
    call_reward,
    checked_scores,
    reward_name,
)
from forge_lightning.rewards.reward_model import batch_zscore
from forge_lightning.rollout.types import Rollout


@dataclass
class ScoredRewards:
    """Validated scores of one batch: the total, each named component, and how many samples failed."""

    total: list[float]
    components: dict[str, list[float]]
    num_errors: int = 0


def _sample_kwargs(kwargs: dict[str, Any], index: int, batch_size: int) -> dict[str, Any]:
    """Per-sample view of the kwargs: batch-length lists/tuples are sliced, anything else is shared."""
    return {
        key: value[index : index + 1]
        if isinstance(value, (list, tuple)) and len(value) == batch_size
        else value
        for key, value in kwargs.items()
    }


def score(
    reward: RewardFn,
    prompts: list[str],
    responses: list[str],
    on_error: Literal["raise", "zero"] = "raise",
    *,
    reward_timeout: float | None = None,
    **kwargs: Any,
) -> ScoredRewards:
    """Score a batch with ``reward`` and check the result; the entry point the training loop uses.

    A :class:`CompositeReward` is scored component by component so that errors name the component
    and ``components`` holds each one's scores. When a reward raises, it is re-called one sample at a
    time (batch-length list/tuple kwargs sliced alongside) to find the culprit: ``on_error="raise"``
    raises a RuntimeError naming the first failing sample, ``on_error="zero"`` scores failing samples
    0.0 (per component), warns, and counts the failing samples in ``num_errors``.

    A call that runs past ``reward_timeout`` seconds is abandoned (see
    :func:`~forge_lightning.rewards.call_reward`) and, not re-tried sample by sample, fails the
    whole batch: an error naming the reward, or under ``on_error="zero"`` every sample of the
    batch scores 0.0 and counts as an error.

    Raises:
        ValueError: bad ``on_error``, mismatched lengths, or a reward output that is not one finite
            number per response.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    if isinstance(reward, CompositeReward):
        parts = {
            name: _score_one(
                part, name, prompts, responses, kwargs, on_error, reward_timeout, allow_none=True
            )
            for name, part in zip(reward.names, reward.rewards)
        }
        components = {
            name: _normalized(part, scores)
            for part, (name, (scores, _)) in zip(reward.rewards, parts.items())
        }
        failed = set().union(*(failures for _, failures in parts.values()))
        return ScoredRewards(reward.combine(components), components, len(failed))
    name = reward_name(reward)
    scores, failures = _score_one(reward, name, prompts, responses, kwargs, on_error, reward_timeout)
    scores = _normalized(reward, scores)
    return ScoredRewards(scores, {name: list(scores)}, len(failures))


def _normalized(reward: RewardFn, scores: list[float]) -> list[float]:
    """A reward's batch, z-scored when it asks for it (``normalize="batch"``, e.g. RewardModel's):
    here, after the whole batch is scored, not in the call, which under ``on_reward_error`` may
    be one sample's."""
    return batch_zscore(scores) if getattr(reward, "normalize", None) == "batch" and scores else scores


def _score_one(
    reward: RewardFn,
    name: str,
    prompts: list[str],
    responses: list[str],
    kwargs: dict[str, Any],
    on_error: str,
    timeout: float | None = None,
    allow_none: bool = False,
) -> tuple[list[float], list[int]]:
    """Checked scores of one reward and the indices of the samples that raised (only with "zero")."""
    try:
        output = call_reward(reward, prompts, responses, kwargs, timeout)
    except RewardTimeout as err:
        if on_error == "raise":
            raise RuntimeError(f"{err} (model.on_reward_error: zero scores such a batch 0)") from err
        warnings.warn(f"{err}: its {len(responses)} samples score 0.0", stacklevel=3)
        return [0.0] * len(responses), list(range(len(responses)))
    except Exception as err:
        batch_error = err
    else:
        return checked_scores(output, len(responses), name, allow_none), []
    size = len(responses)
    scores: list[float] = []
    failures: list[tuple[int, Exception]] = []
    for i in range(size):
        try:
            output = call_reward(
                reward, prompts[i : i + 1], responses[i : i + 1], _sample_kwargs(kwargs, i, size), timeout
            )
        except Exception as err:
            if on_error == "raise":
                raise RuntimeError(f"reward {name!r} failed on sample {i}: {err!r}") from batch_error
            failures.append((i, err))
            scores.append(0.0)
            continue
        scores.extend(checked_scores(output, 1, name, allow_none))
    if failures:
        warnings.warn(
            f"reward {name!r} raised on {len(failures)} of {size} samples, which score 0.0 "
            f"(first: sample {failures[0][0]}: {failures[0][1]!r})",
            stacklevel=3,
        )
    elif on_error == "raise":
        # A failure that no single sample reproduces (e.g. out of memory) has no sample to blame.
        raise RuntimeError(_batch_only(name, size, batch_error)) from batch_error
    else:
        warnings.warn(
            f"{_batch_only(name, size, batch_error)}; each sample keeps its own score", stacklevel=3
        )
    return scores, [i for i, _ in failures]


def _batch_only(name: str, size: int, error: Exception) -> str:
    return (
        f"reward {name!r} failed on the batch of {size} but on no single sample when retried one by "
        f"one: it depends on the batch as a whole, e.g. on its size (a batch too big for memory or a "
        f"service's limit) or on the samples together: {error!r}"
    )


def score_groups(
    reward: RewardFn,
    prompts: list[str],
    rollout: Rollout,
    batch_kwargs: dict[str, list[Any]],
    on_error: Literal["raise", "zero"] = "raise",
    reward_timeout: float | None = None,
    extras: dict[str, Any] | None = None,
) -> tuple[Tensor, dict[str, Tensor], int]:
    """Score a rollout's G completions per prompt, each seeing its prompt's batch values and its
    own facts (:meth:`Rollout.facts`: ``completion_ids``, ``completion_lengths``, ``truncated``),
    and ``extras``, given whole to every call (TRL's trainer_state and log_metric:
    extras.RewardExtras.arguments).

    Returns the total rewards ``(P*G,)``, each component's ``(P*G,)`` (on the rollout's device)
    and the number of samples whose reward raised (scored 0 under ``on_error="zero"``).
    """
    group_size = rollout.group_size
    repeated = {key: [v for v in values for _ in range(group_size)] for key, values in batch_kwargs.items()}
    repeated.update(rollout.facts())
    repeated.update(extras or {})
    scored = score(
        reward,
        [p for p in prompts for _ in range(group_size)],
        rollout.completions,
        on_error=on_error,
        reward_timeout=reward_timeout,
        **repeated,
    )

    def as_tensor(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=rollout.prompt_ids.device)

    components = {name: as_tensor(v) for name, v in scored.components.items()}
    return as_tensor(scored.total), components, scored.num_errors


def batch_advantages(
    rewards: Tensor,
    group_size: int,
    scale: str,
    world_size: int,
    all_gather: Callable[[Tensor], Tensor],
    estimator: str = "grpo",
) -> Tensor:
    """Group-relative advantages of the rewards ``(P*G,)`` by ``estimator``. ``scale="batch"``
    and ``reinforce_pp`` take their std over every rank's groups of this training batch
    (``all_gather``: the module's), all of its micro-batches and steps_per_generation shares
    (later accumulation batches are not sampled yet)."""
    gathered = needs_batch(scale, estimator) and world_size > 1
    batch = all_gather(rewards).reshape(-1) if gathered else None
    return group_advantages(rewards, group_size, scale=scale, batch_rewards=batch, estimator=estimator)
