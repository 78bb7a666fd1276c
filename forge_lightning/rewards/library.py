"""The reward library: :class:`ExactMatchReward`, :class:`FormatReward`,
:class:`LengthPenaltyReward`, :class:`OverlongPenaltyReward`, :class:`GSM8KAnswerReward`,
:class:`CompositeReward` and a trained reward model, :class:`RewardModel` (rewards/reward_model.py),
and the entry points that take a whole reward as the module is given one
(a reward, or a list of them): calling it, naming its components, checking its arguments, storing
it in a checkpoint and loading it back.

A reward is a :class:`BaseReward` or any plain callable ``(prompts, responses, **kwargs)`` returning a
:class:`RewardOutput` or a list of floats. Only the keyword arguments a reward's signature accepts are
passed to it, so rewards that need ``references`` and rewards that do not can be mixed freely.
:func:`forge_lightning.rewards.batch_scoring.score` scores a batch with one. How one call is made and
its output checked lives in :mod:`forge_lightning.rewards.calls`; its public names are importable
from here too.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from forge_lightning.data.gsm8k import extract_answer, normalize_number
from forge_lightning.rewards.calls import (
    BaseReward,
    RewardExit,
    RewardFn,
    RewardOutput,
    RewardTimeout,
    absent_arguments,
    checked_scores,
    completion_messages,
    invoke_reward,
    reward_name,
)
from forge_lightning.rewards.extras import NOT_GIVEN, argument_advice
from forge_lightning.rewards.reward_model import PolicyContext, RewardModel
from forge_lightning.rewards.setting import CALLABLE_REWARD, refuse_strings
from forge_lightning.run.specs import Spec, from_spec, is_spec, to_spec
from forge_lightning.run.user_code import accepted_kwargs, takes_completions, trl_kwargs
from forge_lightning.sandbox.pool import Sandbox

__all__ = [
    "SLOW_REWARD_SECONDS",
    "BaseReward",
    "CompositeReward",
    "ExactMatchReward",
    "FormatReward",
    "GSM8KAnswerReward",
    "LengthPenaltyReward",
    "OverlongPenaltyReward",
    "PolicyContext",
    "RewardArgument",
    "RewardExit",
    "RewardFn",
    "RewardModel",
    "RewardOutput",
    "RewardTimeout",
    "accepted_kwargs",
    "as_reward",
    "call_reward",
    "checked_scores",
    "completion_messages",
    "component_names",
    "load_reward",
    "missing_arguments",
    "require_arguments",
    "reward_name",
    "reward_parts",
    "reward_spec",
    "share_policy_context",
    "takes_completions",
    "trl_kwargs",
]

# A reward call without a time limit that runs longer than this many seconds is warned about.
SLOW_REWARD_SECONDS = 60.0

# What the module's ``reward`` takes from a config: a reward, or a list of them. The list comes
# first: jsonargparse cannot write a list of functions back out of the other order. A string that
# is no import path (a reward model's folder) is read as one, to be refused by name
# (rewards/setting.py), not with jsonargparse's parse of each subtype.
RewardArgument: TypeAlias = list[Callable[..., Any] | str] | Callable[..., Any] | str


def call_reward(
    reward: RewardFn,
    prompts: list[str],
    responses: list[str],
    kwargs: dict[str, Any],
    timeout: float | None = None,
    sandbox: Sandbox | None = None,
) -> Any:
    """Call ``reward`` by its convention, with its own copies of the lists, within ``timeout``
    seconds if given, else warned about once past :data:`SLOW_REWARD_SECONDS`; in ``sandbox``'s
    workers where given (:func:`~forge_lightning.rewards.calls.invoke_reward` says how)."""
    # Read at each call, so that the threshold can be tuned here, where users import it from.
    return invoke_reward(reward, prompts, responses, kwargs, timeout, SLOW_REWARD_SECONDS, sandbox)


def _require_references(
    owner: BaseReward, references: Sequence[Any] | None, responses: list[str]
) -> Sequence[Any]:
    name = type(owner).__name__
    if references is None:
        raise ValueError(f"{name} needs references (one per response), e.g. as the references= argument")
    if len(references) != len(responses):
        raise ValueError(f"{name} got {len(references)} references for {len(responses)} responses")
    return references


class ExactMatchReward(BaseReward):
    """1.0 when the reference appears in the response (case-insensitive), else 0.0.

    Args:
        references: one reference per response; may instead be passed at call time, which wins.
    """

    def __init__(self, references: list[str] | None = None) -> None:
        self.references = references
        self.needs = ("references",) if references is None else ()

    def __call__(
        self, prompts: list[str], responses: list[str], references: list[str] | None = None, **kwargs: Any
    ) -> RewardOutput:
        refs = _require_references(self, references if references is not None else self.references, responses)
        hits = [str(ref).strip().lower() in response.lower() for ref, response in zip(refs, responses)]
        return RewardOutput(scores=[float(hit) for hit in hits])


class FormatReward(BaseReward):
    """1.0 when ``format_fn(response)`` is truthy, else 0.0.

    Args:
        format_fn: any ``str -> bool``-like check of one response.
    """

    def __init__(self, format_fn: Callable[[str], object]) -> None:
        self.format_fn = format_fn

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        return RewardOutput(scores=[1.0 if self.format_fn(response) else 0.0 for response in responses])


class LengthPenaltyReward(BaseReward):
    """Word-count shaping: 1.0 at ``optimal_length`` words, falling linearly to 0.0 at ``min_length``
    (below optimal) and at ``max_length`` (above optimal); 0.0 outside ``[min_length, max_length]``.

    Args:
        optimal_length: word count that scores 1.0.
        min_length: shortest word count that can score above 0 (scores 0.0 itself unless optimal).
        max_length: longest word count that can score above 0 (scores 0.0 itself unless optimal).
    """

    def __init__(
        self,
        optimal_length: int = 200,
        min_length: int = 50,
        max_length: int = 500,
        zero_if_truncated: bool = False,
    ) -> None:
        if not 0 <= min_length <= optimal_length <= max_length:
            raise ValueError(
                "LengthPenaltyReward needs 0 <= min_length <= optimal_length <= max_length, got "
                f"min_length={min_length}, optimal_length={optimal_length}, max_length={max_length}"
            )
        self.optimal_length, self.min_length, self.max_length = optimal_length, min_length, max_length
        self.zero_if_truncated = zero_if_truncated

    def score_length(self, words: int) -> float:
        if words == self.optimal_length:
            return 1.0
        if words < self.min_length or words > self.max_length:
            return 0.0
        # Strictly between a bound and optimal here, so neither denominator can be zero.
        if words < self.optimal_length:
            return (words - self.min_length) / (self.optimal_length - self.min_length)
        return (self.max_length - words) / (self.max_length - self.optimal_length)

    def __call__(
        self, prompts: list[str], responses: list[str], truncated: list[bool] | None = None, **kwargs: Any
    ) -> RewardOutput:
        scores = [self.score_length(len(response.split())) for response in responses]
        if self.zero_if_truncated and truncated is not None:
            scores = [0.0 if cut else score for score, cut in zip(scores, truncated)]
        return RewardOutput(scores=scores)


class OverlongPenaltyReward(BaseReward):
    """DAPO's soft overlong punishment, in tokens: 0 up to ``max_length - buffer``, then falling
    linearly to -1 at ``max_length`` (and -1 beyond). Reads ``completion_lengths``, which the
    module passes to every reward that names it.

    Args:
        max_length: the length that scores -1; usually the run's ``max_new_tokens``.
        buffer: how many tokens before ``max_length`` the penalty starts.
    """

    def __init__(self, max_length: int, buffer: int) -> None:
        if not 0 < buffer <= max_length:
            raise ValueError(
                f"OverlongPenaltyReward needs 0 < buffer <= max_length, got {buffer=}, {max_length=}"
            )
        self.max_length, self.buffer = max_length, buffer

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        completion_lengths: list[int] | None = None,
        **kwargs: Any,
    ) -> RewardOutput:
        if completion_lengths is None or len(completion_lengths) != len(responses):
            raise ValueError("OverlongPenaltyReward needs completion_lengths (tokens), one per response")
        start = self.max_length - self.buffer
        return RewardOutput(scores=[-min(max(n - start, 0) / self.buffer, 1.0) for n in completion_lengths])


class GSM8KAnswerReward(BaseReward):
    """1.0 when the number extracted from the response equals the reference as a value
    ("$1,800.00" matches "1800"), else 0.0. Needs ``references=`` at call time."""

    needs = ("references",)
    # What a completion answers by this check's reading (its extracted number): the key maj@k
    # votes by beside it, the module's default ``answer_key`` as this is its default accuracy.
    answer_key = staticmethod(extract_answer)

    def __call__(
        self, prompts: list[str], responses: list[str], references: list[str] | None = None, **kwargs: Any
    ) -> RewardOutput:
        scores = []
        for ref, response in zip(_require_references(self, references, responses), responses):
            expected = normalize_number(str(ref))
            if expected is None:
                raise ValueError(f"GSM8KAnswerReward reference is not a number: {ref!r}")
            scores.append(1.0 if extract_answer(response) == expected else 0.0)
        return RewardOutput(scores=scores)


class CompositeReward(BaseReward):
    """Weighted sum of rewards, weights normalised to sum to 1.

    Each component gets only the keyword arguments its signature accepts. The output's
    ``metadata["components"]`` maps each component's unique name to its scores.

    Args:
        rewards_and_weights: ``(reward, weight)`` or ``(reward, weight, name)`` tuples; weights must be
            non-negative with a positive sum. Unnamed components take :func:`reward_name`; repeated
            names get ``_2``, ``_3``... suffixes.
    """

    def __init__(
        self, rewards_and_weights: Sequence[tuple[RewardFn, float] | tuple[RewardFn, float, str]]
    ) -> None:
        if not rewards_and_weights:
            raise ValueError("CompositeReward needs at least one (reward, weight) pair")
        for entry in rewards_and_weights:
            if not isinstance(entry, tuple) or len(entry) not in (2, 3) or not callable(entry[0]):
                raise ValueError(
                    f"CompositeReward entries are (reward, weight[, name]) tuples, got {entry!r}"
                )
        weights = [float(entry[1]) for entry in rewards_and_weights]
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"CompositeReward weights must be finite, >= 0 and sum to > 0, got {weights}")
        self.rewards_and_weights = [tuple(entry) for entry in rewards_and_weights]  # as given (run/specs.py)
        self.rewards: list[RewardFn] = [entry[0] for entry in rewards_and_weights]
        self.weights = [w / sum(weights) for w in weights]
        self.names = _unique_names(
            [entry[2] if len(entry) == 3 else reward_name(entry[0]) for entry in rewards_and_weights]
        )

    def combine(self, components: dict[str, list[float]]) -> list[float]:
        """Weighted sum of per-component scores keyed by :attr:`names`; a NaN (a component's None,
        not applicable) counts 0. A sample no component scored is an error."""
        columns = [components[name] for name in self.names]
        totals = []
        for i, row in enumerate(zip(*columns)):
            if all(math.isnan(s) for s in row):
                raise ValueError(f"no reward component scored sample {i}: every one returned None")
            totals.append(sum(w * s for w, s in zip(self.weights, row) if not math.isnan(s)))
        return totals

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        components = {
            name: checked_scores(
                call_reward(reward, prompts, responses, kwargs), len(responses), name, allow_none=True
            )
            for name, reward in zip(self.names, self.rewards)
        }
        return RewardOutput(scores=self.combine(components), metadata={"components": components})


def _unique_names(names: list[str]) -> list[str]:
    unique: list[str] = []
    for base in names:
        candidate, suffix = base, 1
        while candidate in unique:
            suffix += 1
            candidate = f"{base}_{suffix}"
        unique.append(candidate)
    return unique


# A whole reward, as the module is given one.


def missing_arguments(reward: RewardFn, available: set[str]) -> dict[str, list[str]]:
    """For each component of ``reward`` (itself, or a CompositeReward's parts), the keyword
    arguments it needs that are not in ``available``
    (:func:`~forge_lightning.rewards.calls.absent_arguments`)."""
    parts = (
        zip(reward.names, reward.rewards)
        if isinstance(reward, CompositeReward)
        else [(reward_name(reward), reward)]
    )
    missing: dict[str, list[str]] = {}
    for name, part in parts:
        absent = absent_arguments(part, available)
        if absent:
            missing[name] = absent
    return missing


def require_arguments(reward: RewardFn, available: set[str], role: str = "reward") -> None:
    """Raise ValueError naming each reward component's missing keyword arguments, what the batch
    gives (``available``: extras.reward_arguments) and how to give them; run before any
    generation, so a mismatch costs nothing. A component that may take an argument the module
    never gives (TRL's log_extra) is warned about."""
    missing = missing_arguments(reward, available)
    if missing:
        what = "; ".join(f"{name!r} needs {', '.join(keys)}" for name, keys in missing.items())
        absent = {key for keys in missing.values() for key in keys}
        raise ValueError(
            f"{role} {what}, but a batch gives {', '.join(sorted(available))}. {argument_advice(absent)}"
        )
    for part in reward_parts(reward):
        for key in NOT_GIVEN.keys() & _parameter_names(part) - available:
            warnings.warn(
                f"{role} {reward_name(part)!r} takes {key}, which it gets as None: {NOT_GIVEN[key]}",
                stacklevel=2,
            )


def _parameter_names(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature names nothing
        return set()


def reward_parts(reward: RewardFn) -> list[RewardFn]:
    """The rewards ``reward`` is made of: a CompositeReward's components (recursively), else itself."""
    if isinstance(reward, CompositeReward):
        return [leaf for part in reward.rewards for leaf in reward_parts(part)]
    return [reward]


def share_policy_context(reward: RewardFn, context: Any) -> None:
    """Hand ``context`` (reward_model.PolicyContext: the policy's device and system message) to
    each part of ``reward`` that asks for it with a ``use_policy_context`` method."""
    for part in reward_parts(reward):
        use = getattr(part, "use_policy_context", None)
        if callable(use):
            use(context)


def component_names(reward: RewardFn) -> list[str]:
    """Unique component names of a :class:`CompositeReward`, else the reward's own name."""
    if isinstance(reward, CompositeReward):
        return list(reward.names)
    return [reward_name(reward)]


def as_reward(reward: RewardFn | Sequence[RewardFn | tuple]) -> RewardFn:
    """``reward`` itself, or a list of rewards (TRL's ``reward_funcs``; entries may also be
    ``(reward, weight[, name])``) as their CompositeReward, equally weighted where no weight is
    given. Anything not callable is refused here, when the module is built, not at the first step;
    a string (a reward model's folder: RewardModel's) by what it is."""
    refuse_strings(reward)
    if isinstance(reward, (list, tuple)):
        entries = [entry if isinstance(entry, tuple) else (entry, 1.0) for entry in reward]
        return CompositeReward(entries)
    if not callable(reward):
        raise TypeError(
            f"reward must be a callable (prompts, responses, **kwargs) -> scores, or a list of them; got "
            f"{type(reward).__name__} {reward!r}"
        )
    return reward


def reward_spec(reward: RewardFn | Sequence[RewardFn | tuple] | None) -> Spec:
    """What a checkpoint stores of ``reward`` (specs.to_spec): an import path, a list of them, a
    ``{class_path, init_args}`` dict; None when it cannot be stored (a lambda, a local function)
    or is None. A list with ``(reward, weight[, name])`` entries is stored as its CompositeReward."""
    if isinstance(reward, (list, tuple)) and any(isinstance(entry, tuple) for entry in reward):
        reward = as_reward(reward)
    return to_spec(reward)


def load_reward(reward: Any) -> Any:
    """``reward`` itself, or where it is a stored form (:func:`reward_spec`; an import path) the
    reward, or list of rewards, it describes."""
    if reward is None or not is_spec(reward):
        return reward
    try:
        built = from_spec(reward, RewardArgument)
    except ValueError as err:
        raise TypeError(f"{CALLABLE_REWARD}: {err}") from None
    refuse_strings(built)  # no import path made it a reward: a folder, a hub id, a typo
    return built
