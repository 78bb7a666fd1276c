"""Scoring a batch: the one place responses are turned into checked scores, per component; the
components that may run at once (``async def`` rewards, and every sandboxed one) do.

A reward may report samples it could not score without raising (a judge's unreadable reply):
``RewardOutput.metadata[UNSCORED]``, ``{index: why}``; each counts as that sample's error."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from forge_lightning.rewards.calls import sandboxed
from forge_lightning.rewards.library import (
    CompositeReward,
    RewardFn,
    RewardOutput,
    RewardTimeout,
    call_reward,
    checked_scores,
    reward_name,
)
from forge_lightning.rewards.reward_model import batch_zscore
from forge_lightning.rollout.types import Rollout
from forge_lightning.run.user_code import is_async
from forge_lightning.sandbox.pool import Sandbox

# The RewardOutput.metadata key of the samples a reward could not score ({index: why}).
UNSCORED = "unscored"


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
    sandbox: Sandbox | None = None,
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

    With a ``sandbox`` each reward but those that stay in process runs in its workers
    (rewards/calls.py's ``sandboxed``). A CompositeReward's ``async def`` components are awaited
    at once, and with a sandbox its sandboxed components run at once too (as many as it has
    workers); the others run one after another, and the scores come back in the components' order.

    Raises:
        ValueError: bad ``on_error``, mismatched lengths, or a reward output that is not one finite
            number per response.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    if isinstance(reward, CompositeReward):
        calls = {
            name: functools.partial(
                _score_one, part, name, prompts, responses, kwargs, on_error, reward_timeout, True, sandbox
            )
            for name, part in zip(reward.names, reward.rewards)
        }
        at_once = [name for name, part in zip(reward.names, reward.rewards) if _at_once(part, sandbox)]
        parts = _run_calls(calls, at_once)
        components = {
            name: _normalized(part, scores)
            for part, (name, (scores, _)) in zip(reward.rewards, parts.items())
        }
        failed = set().union(*(failures for _, failures in parts.values()))
        return ScoredRewards(reward.combine(components), components, len(failed))
    name = reward_name(reward)
    scores, failures = _score_one(
        reward, name, prompts, responses, kwargs, on_error, reward_timeout, sandbox=sandbox
    )
    scores = _normalized(reward, scores)
    return ScoredRewards(scores, {name: list(scores)}, len(failures))


def _at_once(reward: RewardFn, sandbox: Sandbox | None) -> bool:
    """Whether a component may run while others do: it is ``async def`` (it awaits), or it runs
    in the sandbox (a process of its own). Plain rewards in the trainer's threads run one by one,
    as a reward that is not thread-safe expects."""
    return is_async(reward) or sandboxed(reward, sandbox)


def _run_calls(calls: dict[str, Callable[[], Any]], at_once: list[str]) -> dict[str, Any]:
    """Each call's value by name, in ``calls``' order: those named in ``at_once`` in threads of
    their own meanwhile the others run here one by one. The first error in that order is raised,
    once every call has ended."""
    if len(at_once) < 2:
        return {name: call() for name, call in calls.items()}
    outcomes: dict[str, Any] = {}
    with ThreadPoolExecutor(len(at_once), thread_name_prefix="reward") as threads:
        futures = {name: threads.submit(calls[name]) for name in at_once}
        for name, call in calls.items():
            if name not in futures:
                try:
                    outcomes[name] = (call(), None)
                except BaseException as err:  # raised below, in the components' order
                    outcomes[name] = (None, err)
        for name, future in futures.items():
            error = future.exception()
            outcomes[name] = (None if error else future.result(), error)
    for name in calls:
        if outcomes[name][1] is not None:
            raise outcomes[name][1]
    return {name: outcomes[name][0] for name in calls}


def _normalized(reward: RewardFn, scores: list[float]) -> list[float]:
    """A reward's batch, z-scored when it asks for it (``normalize="batch"``, e.g. RewardModel's):
    here, after the whole batch is scored, not in the call, which after a reward error may be
    one sample's."""
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
    sandbox: Sandbox | None = None,
) -> tuple[list[float], list[int]]:
    """Checked scores of one reward and the indices of the samples that raised (only with "zero")."""
    try:
        output = call_reward(reward, prompts, responses, kwargs, timeout, sandbox)
    except RewardTimeout as err:
        if on_error == "raise":
            raise RuntimeError(f"{err} (model.on_reward_error: zero scores such a batch 0)") from err
        warnings.warn(f"{err}: its {len(responses)} samples score 0.0", stacklevel=3)
        return [0.0] * len(responses), list(range(len(responses)))
    except Exception as err:
        batch_error = err
    else:
        return _unscored(output, checked_scores(output, len(responses), name, allow_none), name, on_error)
    size = len(responses)
    scores: list[float] = []
    failures: list[tuple[int, Exception]] = []
    for i in range(size):
        try:
            output = call_reward(
                reward, prompts[i : i + 1], responses[i : i + 1], _sample_kwargs(kwargs, i, size), timeout,
                sandbox,
            )  # fmt: skip
            if isinstance(output, RewardOutput) and output.metadata.get(UNSCORED):
                raise ValueError(next(iter(output.metadata[UNSCORED].values())))
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


def _unscored(output: Any, scores: list[float], name: str, on_error: str) -> tuple[list[float], list[int]]:
    """``scores`` with the samples ``output`` reports unscored (module docstring) handled as
    ``on_error`` says: a RuntimeError naming the first, or each scored 0.0, warned about and
    returned as a failure."""
    unscored = output.metadata.get(UNSCORED) if isinstance(output, RewardOutput) else None
    if not unscored:
        return scores, []
    first = min(unscored)
    if on_error == "raise":
        raise RuntimeError(
            f"reward {name!r} could not score sample {first}: {unscored[first]} (model.on_reward_error: "
            "zero scores such a sample 0 and counts it)"
        )
    warnings.warn(
        f"reward {name!r} could not score {len(unscored)} of {len(scores)} samples, which score 0.0 "
        f"(first: sample {first}: {unscored[first]})",
        stacklevel=4,
    )
    return [0.0 if i in unscored else s for i, s in enumerate(scores)], sorted(unscored)


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
    sandbox: Sandbox | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, dict[str, Tensor], int]:
    """Score a rollout's G completions per prompt, each seeing its prompt's batch values and its
    own facts (:meth:`Rollout.facts`: ``completion_ids``, ``completion_lengths``, ``truncated``),
    and ``extras``, given whole to every call (TRL's trainer_state and log_metric:
    extras.RewardExtras.arguments); ``sandbox``: where the rewards run (:func:`score`).

    Returns the total rewards ``(P*G,)``, each component's ``(P*G,)`` (on the rollout's device,
    as ``dtype``: float64 keeps each score as the reward returned it) and the number of samples
    whose reward raised (scored 0 under ``on_error="zero"``).
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
        sandbox=sandbox,
        **repeated,
    )

    def as_tensor(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=rollout.prompt_ids.device)

    components = {name: as_tensor(v) for name, v in scored.components.items()}
    return as_tensor(scored.total), components, scored.num_errors
