"""Reward functions, and the checks that turn what one returns into scores.

A reward is a :class:`BaseReward` or any plain callable ``(prompts, responses, **kwargs)`` returning a
:class:`RewardOutput` or a list of floats. Only the keyword arguments a reward's signature accepts are
passed to it, so rewards that need ``references`` and rewards that do not can be mixed freely.
:func:`forge_lightning.scoring.score` scores a batch with one.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from forge_lightning.data.gsm8k import extract_answer, normalize_number
from forge_lightning.preemption import raised_by_signal, signals_marked
from forge_lightning.specs import Spec, from_spec, is_spec, to_spec

# A reward call without reward_timeout that runs longer than this many seconds is warned about.
SLOW_REWARD_SECONDS = 60.0


@dataclass
class RewardOutput:
    """One score per response, plus anything a reward wants to expose for inspection."""

    scores: list[float]
    metadata: dict[str, Any] = field(default_factory=dict)


class BaseReward(ABC):
    """Base class for rewards. Subclasses may declare a narrower ``__call__`` (no ``**kwargs``)."""

    #: Keyword arguments the reward cannot score without although its signature gives them a
    #: default (``references=None``); checked against the batch before the first generation.
    needs: tuple[str, ...] = ()

    @abstractmethod
    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput: ...


RewardFn: TypeAlias = BaseReward | Callable[..., RewardOutput | Sequence[float]]

# What the module's ``reward`` takes from a config: a reward, or a list of them. The list comes
# first: jsonargparse cannot write a list of functions back out of the other order.
RewardArgument: TypeAlias = list[Callable[..., Any]] | Callable[..., Any]

# Batch keys renamed from the dataset's column names (split_batch), by Forge's convention. TRL
# passes every column under its own name, so a TRL-style reward gets it under both.
_COLUMN_NAMES = {"references": "reference"}


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` can take by name (all of them if it has ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        # Some builtins have no signature; passing everything lets a mismatch fail loudly at the call.
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in kwargs.items() if key in by_name}


def takes_completions(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a TRL-style reward: a parameter named ``completions`` and none named
    ``responses``. Such a reward is called by keyword (``prompts=``, ``completions=`` and the
    batch's fields), as TRL calls it, so ``def f(completions, **kwargs)`` works too."""
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "completions" in names and "responses" not in names


def trl_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The batch's keyword arguments for a TRL-style reward: each dataset column under its own
    name too (``reference`` beside ``references``)."""
    columns = {column: kwargs[key] for key, column in _COLUMN_NAMES.items() if key in kwargs}
    return {**columns, **kwargs}


def completion_messages(prompts: list[Any], responses: list[str]) -> list[Any]:
    """What a TRL-style reward gets as ``completions``: each response as text, or, where its prompt
    is a conversation (a list of messages), as TRL's ``[{"role": "assistant", "content": text}]``."""
    return [
        [{"role": "assistant", "content": response}] if isinstance(prompt, list) else response
        for prompt, response in zip(prompts, responses)
    ]


def missing_arguments(reward: RewardFn, available: set[str]) -> dict[str, list[str]]:
    """For each component of ``reward`` (itself, or a CompositeReward's parts), the keyword
    arguments it needs that are not in ``available``: its required parameters besides the prompts
    and responses (the first two, or for a TRL-style reward ``prompts`` and ``completions``), and a
    :class:`BaseReward`'s ``needs``."""
    parts = (
        zip(reward.names, reward.rewards)
        if isinstance(reward, CompositeReward)
        else [(reward_name(reward), reward)]
    )
    missing: dict[str, list[str]] = {}
    for name, part in parts:
        try:
            params = list(inspect.signature(part).parameters.values())
        except (TypeError, ValueError):
            params = []
        given = available
        if takes_completions(part):
            params = [p for p in params if p.name not in ("prompts", "completions")]
            given = set(trl_kwargs(dict.fromkeys(available)))
        else:
            params = params[2:]
        required = [
            p.name
            for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        required += list(getattr(part, "needs", ()))
        absent = [key for key in dict.fromkeys(required) if key not in given]
        if absent:
            missing[name] = absent
    return missing


def require_arguments(reward: RewardFn, available: set[str], role: str = "reward") -> None:
    """Raise ValueError naming each reward component's missing keyword arguments and what the
    batch has (run before any generation, so a mismatch costs nothing)."""
    missing = missing_arguments(reward, available)
    if missing:
        what = "; ".join(f"{name!r} needs {', '.join(keys)}" for name, keys in missing.items())
        raise ValueError(
            f"{role} {what}, but a batch gives {', '.join(sorted(available))}. Add the field to the data "
            "(a 'reference' field arrives as references=, and also as reference= to a TRL-style "
            "reward), or use a reward that does without it"
        )


def reward_name(reward: RewardFn) -> str:
    """A readable name: a function's ``__name__`` (``<lambda>`` becomes ``lambda``), else the class name."""
    name = getattr(reward, "__name__", None) or type(reward).__name__
    return name.strip("<>")


def component_names(reward: RewardFn) -> list[str]:
    """Unique component names of a :class:`CompositeReward`, else the reward's own name."""
    if isinstance(reward, CompositeReward):
        return list(reward.names)
    return [reward_name(reward)]


def checked_scores(output: Any, num_samples: int, name: str, allow_none: bool = False) -> list[float]:
    """Turn a reward's output into ``num_samples`` finite floats; ValueError naming the reward otherwise.

    With ``allow_none`` (a CompositeReward's component) a None means "not applicable to this
    sample", as in TRL, and becomes NaN: it counts 0 in the total and stays out of the component's
    mean and std."""
    if isinstance(output, RewardOutput):
        output = output.scores
    elif hasattr(output, "tolist"):  # numpy arrays and tensors, without importing either
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise ValueError(
            f"reward {name!r} must return a RewardOutput or a list of floats, got {type(output)}"
        )
    if len(output) != num_samples:
        raise ValueError(f"reward {name!r} returned {len(output)} scores for {num_samples} responses")
    for i, value in enumerate(output):
        if value is None:
            if allow_none:
                continue
            raise ValueError(
                f"reward {name!r} returned None at index {i}: None ('not applicable') is for a component "
                "of a CompositeReward whose other components score that sample"
            )
        if not isinstance(value, numbers.Real):
            raise ValueError(f"reward {name!r} returned a non-number at index {i}: {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"reward {name!r} returned a non-finite score at index {i}: {value!r}")
    return [math.nan if value is None else float(value) for value in output]


class RewardTimeout(TimeoutError):
    """A reward call ran past ``reward_timeout``; it was abandoned."""


class RewardExit(SystemExit):
    """A reward's own code raised SystemExit or KeyboardInterrupt (no signal did): the run stops
    with an error that names the reward."""


def call_reward(
    reward: RewardFn,
    prompts: list[str],
    responses: list[str],
    kwargs: dict[str, Any],
    timeout: float | None = None,
) -> Any:
    """Call ``reward`` with its own copies of the lists: a reward that rewrites or empties its
    inputs changes nothing for the next reward, the log or the samples table.

    A reward is called as ``reward(prompts, responses, **fields)``, or, when it names a
    ``completions`` parameter and no ``responses`` one (TRL's signature), as
    ``reward(prompts=..., completions=..., **fields)`` (:func:`takes_completions`).

    With ``timeout`` (seconds) the call runs in a daemon thread and is abandoned, raising
    :class:`RewardTimeout`, when it takes longer; the abandoned thread is left to finish alone
    (a thread cannot be killed), and a process exit does not wait for it. Without one, a call
    running past :data:`SLOW_REWARD_SECONDS` is warned about (once) and left to run.

    A SystemExit or KeyboardInterrupt that the reward's code raises becomes :class:`RewardExit`
    naming the reward; one that a signal raised (Ctrl-C, a SIGTERM) passes through unchanged.
    """
    own = {key: list(value) if isinstance(value, list) else value for key, value in kwargs.items()}

    def call() -> Any:
        if takes_completions(reward):  # TRL's convention: everything by keyword
            completions = completion_messages(prompts, responses)
            trl = {**trl_kwargs(own), "prompts": list(prompts), "completions": completions}
            return reward(**accepted_kwargs(reward, trl))
        return reward(list(prompts), list(responses), **accepted_kwargs(reward, own))

    name = reward_name(reward)
    try:
        with signals_marked():
            if timeout is None:
                return _call_watched(call, name)
            return _call_within(call, f"reward {name!r}", len(responses), timeout)
    except (SystemExit, KeyboardInterrupt) as err:
        if isinstance(err, RewardExit) or raised_by_signal(err):
            raise
        raise RewardExit(
            f"reward {name!r} raised {err!r} from its own code (no signal did): the run stops. A "
            "reward that cannot score raises an Exception instead (model.on_reward_error decides "
            "what then happens)"
        ) from err


def _call_watched(call: Callable[[], Any], name: str) -> Any:
    """``call()``, with one warning if it runs past :data:`SLOW_REWARD_SECONDS` (a hang with no
    timeout set would otherwise be silent)."""
    message = (
        f"reward {name!r} has run for more than {SLOW_REWARD_SECONDS:g}s in one call, with no "
        "reward_timeout set; if it hangs, set model.reward_timeout (seconds, e.g. "
        "--model.reward_timeout 300) to abandon a call that takes longer"
    )

    def warn() -> None:
        warnings.warn(message, stacklevel=1)

    watchdog = threading.Timer(SLOW_REWARD_SECONDS, warn)
    watchdog.daemon = True
    watchdog.start()
    try:
        return call()
    finally:
        watchdog.cancel()


def _call_within(call: Callable[[], Any], what: str, size: int, timeout: float) -> Any:
    """``call()`` in a daemon thread, abandoned with :class:`RewardTimeout` after ``timeout`` s."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name=what, daemon=True).start()
    if not done.wait(timeout):
        raise RewardTimeout(
            f"{what} took longer than reward_timeout={timeout:g}s on {size} responses; the call was abandoned"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


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
        self.rewards_and_weights = [tuple(entry) for entry in rewards_and_weights]  # as given (specs.py)
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


def as_reward(reward: RewardFn | Sequence[RewardFn | tuple]) -> RewardFn:
    """``reward`` itself, or a list of rewards (TRL's ``reward_funcs``; entries may also be
    ``(reward, weight[, name])``) as their CompositeReward, equally weighted where no weight is
    given. Anything not callable is refused here, when the module is built, not at the first step."""
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
        return from_spec(reward, RewardArgument)
    except ValueError as err:
        raise TypeError(
            "reward must be a callable (prompts, responses, **kwargs) -> scores, a list of them, or the "
            f"import path of one: {err}"
        ) from None
