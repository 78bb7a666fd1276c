"""How a reward is called and what it returns is checked: the reward contract (:class:`RewardOutput`,
:class:`BaseReward`), which keyword arguments each reward gets (its signature decides; TRL-style
rewards get TRL's names), the arguments it cannot do without, time limits, the slow-call warning,
a reward's own exits, ``async def`` rewards (awaited), the sandbox (``sandbox: process``: the call
runs in a worker process, sandbox/pool.py) and :func:`checked_scores`.

The reward library and the entry points that take a whole, possibly composite, reward live in
:mod:`forge_lightning.rewards`, which re-exports these names: import them from there.
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
from types import SimpleNamespace
from typing import Any, Literal, TypeAlias

from forge_lightning.run.user_code import (
    CallTimeout,
    UserCodeExit,
    accepted_kwargs,
    awaited,
    call_user_code,
    call_within,
    takes_completions,
    trl_kwargs,
    warn_thread_abandoned,
)
from forge_lightning.sandbox.pool import Sandbox, SandboxTimeout, refuse_unpicklable

# The arguments that live in the trainer's process (a callable, the environments' objects): a
# sandboxed reward that names one is refused at the start, one that takes **kwargs goes without.
IN_PROCESS_ARGUMENTS = ("log_metric", "environments")


@dataclass
class RewardOutput:
    """One score per response, plus anything a reward wants to expose for inspection."""

    scores: list[float]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardCalls:
    """How a reward is called, in training and validation alike: what its error does (``raise``
    stops the run, ``zero`` scores its samples 0), the seconds a call may take (None: no limit),
    and the sandbox it runs in (None: the trainer's threads)."""

    on_error: Literal["raise", "zero"] = "raise"
    timeout: float | None = None
    sandbox: Sandbox | None = None


class BaseReward(ABC):
    """Base class for rewards. Subclasses may declare a narrower ``__call__`` (no ``**kwargs``)."""

    #: Keyword arguments the reward cannot score without although its signature gives them a
    #: default (``references=None``); checked against the batch before the first generation.
    needs: tuple[str, ...] = ()
    #: Whether the reward runs in the trainer's process under ``sandbox: process`` too: a reward
    #: that holds a model (RewardModel) is trusted code whose weights stay where they are.
    in_process: bool = False

    @abstractmethod
    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput: ...


RewardFn: TypeAlias = BaseReward | Callable[..., RewardOutput | Sequence[float]]


def completion_messages(
    prompts: list[Any], responses: list[str], transcripts: list[Any] | None = None
) -> list[Any]:
    """What a TRL-style reward gets as ``completions``: each response as text, or, where its prompt
    is a conversation (a list of messages) or it called tools, as TRL's messages: its
    ``transcripts`` entry (the assistant and tool turns), else
    ``[{"role": "assistant", "content": text}]``."""
    transcripts = transcripts or [None] * len(responses)
    out: list[Any] = []
    for prompt, response, turns in zip(prompts, responses, transcripts):
        messages = turns or [{"role": "assistant", "content": response}]
        out.append(messages if isinstance(prompt, list) or len(messages) > 1 else response)
    return out


def absent_arguments(reward: RewardFn, available: set[str]) -> list[str]:
    """The keyword arguments one reward needs that are not in ``available``: its required
    parameters besides the prompts and responses (the first two, or for a TRL-style reward
    ``prompts`` and ``completions``), and a :class:`BaseReward`'s ``needs``."""
    try:
        params = list(inspect.signature(reward).parameters.values())
    except (TypeError, ValueError):
        params = []
    given = available
    if takes_completions(reward):
        params = [p for p in params if p.name not in ("prompts", "completions")]
        given = set(trl_kwargs(dict.fromkeys(available)))
    else:
        params = params[2:]
    required = [
        p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    required += list(getattr(reward, "needs", ()))
    return [key for key in dict.fromkeys(required) if key not in given]


def sandboxed(reward: RewardFn, sandbox: Sandbox | None) -> bool:
    """Whether ``reward`` runs in ``sandbox`` (None: the run's rewards run in its threads): every
    reward but one that stays in process (:attr:`BaseReward.in_process`)."""
    return sandbox is not None and not getattr(reward, "in_process", False)


def refuse_outside_sandbox(reward: RewardFn, what: str) -> None:
    """TypeError naming ``what`` (``reward 'name'``) where ``reward`` cannot run in a sandbox
    worker: it cannot be pickled, or it names an argument that lives in the trainer's process
    (:data:`IN_PROCESS_ARGUMENTS`)."""
    try:
        params = set(inspect.signature(reward).parameters)
    except (TypeError, ValueError):
        params = set()
    named = sorted(params & set(IN_PROCESS_ARGUMENTS))
    if named:
        raise TypeError(
            f"{what} takes {', '.join(named)}, which cannot cross into a sandbox worker under "
            "sandbox: process (a callable, the environments' objects): do without it, or set sandbox: thread"
        )
    refuse_unpicklable(reward, what)


def reward_name(reward: RewardFn) -> str:
    """A readable name: a function's ``__name__`` (``<lambda>`` becomes ``lambda``), else the class name."""
    name = getattr(reward, "__name__", None) or type(reward).__name__
    return name.strip("<>")


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


def invoke_reward(
    reward: RewardFn,
    prompts: list[str],
    responses: list[str],
    kwargs: dict[str, Any],
    timeout: float | None,
    slow_after: float,
    sandbox: Sandbox | None = None,
) -> Any:  # rewards.call_reward is the entry point: it gives slow_after
    """Call ``reward`` with its own copies of the lists: a reward that rewrites or empties its
    inputs changes nothing for the next reward, the log or the samples table. What an ``async
    def`` reward returns is awaited (in an event loop of its own).

    A reward is called as ``reward(prompts, responses, **fields)``, or, when it names a
    ``completions`` parameter and no ``responses`` one (TRL's signature), as
    ``reward(prompts=..., completions=..., **fields)`` (:func:`takes_completions`).

    In a ``sandbox`` (:func:`sandboxed`) the call runs in a worker process, killed after
    ``timeout`` seconds (the sandbox's default where None) with everything it started; that, an
    exit or a crash there is that call's error (a :class:`RewardTimeout`, a SandboxCallError).

    Else, with ``timeout`` (seconds) the call runs in a daemon thread (an ``async def`` reward on
    that thread's own event loop, so one that blocks its loop is no different) and is abandoned,
    raising :class:`RewardTimeout`, when it takes longer; the abandoned thread is left to finish
    alone (a thread cannot be killed; a warning says so once per process), and a process exit
    does not wait for it. Without one, a call
    running past ``slow_after`` seconds is warned about (once) and left to run. A SystemExit or
    KeyboardInterrupt that the reward's code raises becomes :class:`RewardExit` naming the
    reward; one that a signal raised (Ctrl-C, a SIGTERM) passes through unchanged.
    """
    own = {key: list(value) if isinstance(value, list) else value for key, value in kwargs.items()}
    args, named = bound_arguments(reward, prompts, responses, own)
    name = reward_name(reward)
    if sandboxed(reward, sandbox):
        named = {key: value for key, value in named.items() if key not in IN_PROCESS_ARGUMENTS}
        if "trainer_state" in named:  # read by attribute, as TRL's: a namespace crosses without
            named["trainer_state"] = SimpleNamespace(**vars(named["trainer_state"]))  # torch's import
        try:
            return sandbox.call(reward, args, named, timeout, f"reward {name!r}")
        except SandboxTimeout as err:
            raise RewardTimeout(f"{err} on {len(responses)} responses (reward_timeout)") from None

    def call() -> Any:
        return awaited(reward(*args, **named))

    def watched() -> Any:
        if timeout is None:
            return _call_watched(call, name, slow_after)
        return _call_within(call, f"reward {name!r}", len(responses), timeout)

    try:
        return call_user_code(watched)  # the one contract of user code, as for tools
    except UserCodeExit as err:
        raise RewardExit(
            f"reward {name!r} raised {err.__cause__!r} from its own code (no signal did): the run stops. A "
            "reward that cannot score raises an Exception instead (the run's rule for reward errors "
            "decides what then happens: raise, or score 0)"
        ) from err.__cause__


def bound_arguments(
    reward: RewardFn, prompts: list[str], responses: list[str], own: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments ``reward`` is called with, by its convention."""
    if takes_completions(reward):  # TRL's convention: everything by keyword
        completions = completion_messages(prompts, responses, own.get("completions"))
        trl = {**trl_kwargs(own), "prompts": list(prompts), "completions": completions}
        return (), accepted_kwargs(reward, trl)
    return (list(prompts), list(responses)), accepted_kwargs(reward, own)


def _call_watched(call: Callable[[], Any], name: str, slow_after: float) -> Any:
    """``call()``, with one warning if it runs past ``slow_after`` seconds (a hang with no
    timeout set would otherwise be silent)."""
    message = (
        f"reward {name!r} has run for more than {slow_after:g}s in one call, with no "
        "reward_timeout set; if it hangs, set model.reward_timeout (seconds, e.g. "
        "--model.reward_timeout 300) to abandon a call that takes longer"
    )

    def warn() -> None:
        warnings.warn(message, stacklevel=1)

    watchdog = threading.Timer(slow_after, warn)
    watchdog.daemon = True
    watchdog.start()
    try:
        return call()
    finally:
        watchdog.cancel()


def _call_within(call: Callable[[], Any], what: str, size: int, timeout: float) -> Any:
    """``call()`` in a daemon thread, abandoned with :class:`RewardTimeout` after ``timeout`` s
    (its thread runs on: warned about once per process)."""
    try:
        return call_within(call, timeout, what)
    except CallTimeout:
        warn_thread_abandoned(
            "reward", "reward_timeout", "where errors score 0, their samples count in reward_errors"
        )
        raise RewardTimeout(
            f"{what} took longer than reward_timeout={timeout:g}s on {size} responses; the call was abandoned"
        ) from None
