"""One call of a function tool: checked against its signature, invoked (the one place a tool is
called; tools/call_loop.py runs many at once, each within its time limit), its result made the text
the model reads (cut to a length, marked where cut), and every failure of the tool's own an error
message the model reads back while the run goes on. A sync tool runs in a thread of its own, an
``async def`` one on an event loop of its own (tools/event_loops.py): either is abandoned at its
time limit without holding the other calls."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from transformers.utils import get_json_schema

from forge_lightning.rollout.tools.event_loops import EventLoops
from forge_lightning.rollout.tools.parsers import ParsedCall
from forge_lightning.run.user_code import UserCodeExit, awaited, call_user_code, close_unawaited
from forge_lightning.sandbox.pool import Sandbox

T = TypeVar("T")

# The characters of a result the model reads at most (the module's setting, else this), and
# what follows a result that was cut.
MAX_RESULT_CHARS = 10_000
CUT_MARK = "\n[cut: the result has {total} characters; the first {kept} are shown]"
LONGEST_MARK = CUT_MARK.format(total=10**18, kept=10**18)
# What a tool is, for the messages that refuse something else.
WHAT_A_TOOL_IS = (
    "a tool is a Python function with type hints and a Google-style docstring (its schema is made "
    "from them), defined in a module so that it has an import path, or that import path as a "
    "string ('mypkg.tools.add')"
)


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s JSON schema; ValueError naming the tool where its hints or docstring cannot make one."""
    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers' TypeHintParsingException, DocstringParsingException
        raise ValueError(f"tool {name!r} has no schema the model can read ({err}): {WHAT_A_TOOL_IS}") from err


@dataclass
class Job:
    """A call ready to run: the tool, its arguments (checked against its signature), its name, the
    environment it is a method of (None for a function), whose calls run one at a time, the
    sandbox a function tool runs in (sandbox/pool.py; None: this process) with its time limit, and
    whether the call runs in a sandbox worker (a function tool's, or an environment's method under
    ``sandbox: process``), which kills it past its time limit, or else in this process, where a
    call past it is abandoned and its thread runs on."""

    fn: Callable[..., Any]
    arguments: dict[str, Any]
    name: str
    owner: Any = None
    sandbox: Sandbox | None = None
    timeout: float | None = None
    isolated: bool = False


class Outcome(NamedTuple):
    """A call's answer: its text, whether it succeeded, whether the text was cut, and whether it
    was abandoned at its time limit in this process (its thread runs on: ``tool_threads_abandoned``)."""

    text: str
    ok: bool
    cut: bool
    abandoned: bool = False


def check_call(
    parsed: ParsedCall | str,
    functions: dict[str, Callable[..., Any]],
    sandbox: Sandbox | None = None,
    timeout: float | None = None,
) -> Job | Outcome:
    """The :class:`Job` of a parsed call, or the error the model reads where the call cannot run
    (the parser's message, an unknown tool, arguments that do not fit its signature). A function
    tool runs in ``sandbox`` where given, killed there past ``timeout``; an environment's method
    is called on its environment (which, under ``sandbox: process``, calls its worker itself)."""
    if isinstance(parsed, str):
        return Outcome(f"error: {parsed}", False, False)
    name, fn = parsed.name, functions.get(parsed.name)
    if fn is None:
        return Outcome(
            f"error: no tool is named {name!r}; the tools are {', '.join(functions)}", False, False
        )
    try:
        inspect.signature(fn).bind(**parsed.arguments)
    except TypeError as err:
        return Outcome(f"error: wrong arguments for {name}: {err}", False, False)
    owner = fn.__self__ if inspect.ismethod(fn) else None
    # Under a sandbox an environment lives in a worker too: its methods call the worker.
    return Job(
        fn, parsed.arguments, name, owner, sandbox if owner is None else None, timeout, sandbox is not None
    )


def called(job: Job, max_chars: int) -> tuple[str, bool] | Awaitable[Any]:
    """The one place a tool is called: ``fn(**arguments)``, its value made the text the model
    reads, cut to ``max_chars`` (whether it was cut too): the JSON of a huge or pathological value
    (circular, a raising ``__str__``) is the tool's own failure, within its time limit. What runs
    this in a sandbox worker (:func:`tool_text`) hands back text already cut there. An ``async def`` tool's
    awaitable comes back as it is, for :func:`invoke` to await on a loop of its own. A sandboxed
    tool runs in a worker process (which awaits an async one), killed with all it started past the
    job's timeout."""
    if job.sandbox is not None:
        answer = job.sandbox.call(
            tool_text, (job.fn, max_chars), job.arguments, job.timeout, f"tool {job.name!r}"
        )
        if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[0], str)):
            raise TypeError("its sandboxed call answered out of form (not its text and whether it was cut)")
        text, cut = answer[0], bool(answer[1])
        if len(text) > max_chars + len(LONGEST_MARK):  # a call that wrote its own answer, uncut
            text, cut = capped(text, max_chars)
        return text, cut
    value = job.fn(**job.arguments)
    return value if inspect.isawaitable(value) else result_text(value, max_chars)


def tool_text(fn: Callable[..., Any], max_chars: int, /, **arguments: Any) -> tuple[str, bool]:
    """In a sandbox worker: ``fn(**arguments)`` (awaited where it is a coroutine) made the text the
    model reads and cut to ``max_chars`` there, so that no more than that crosses back; and
    whether it was cut."""
    value = fn(**arguments)
    return result_text(awaited(value) if inspect.isawaitable(value) else value, max_chars)


async def invoke(job: Job, max_chars: int, loops: EventLoops) -> tuple[str, bool]:
    """``job``'s text and whether it was cut: :func:`called` in a thread of its own, an async
    tool's awaitable awaited on a loop of ``loops`` (one no other call awaits on, so that a
    coroutine that blocks it holds only this call) and its value made text in a thread. Cancelled
    (a timeout), the call is abandoned wherever it runs. A SystemExit or KeyboardInterrupt the
    tool raises is its own (:class:`UserCodeExit`): no signal reaches any thread but the main one,
    which only waits."""
    made = await in_thread(lambda: called(job, max_chars), job.name)
    if not inspect.isawaitable(made):
        return made
    value = await loops.run(made)
    return await in_thread(lambda: result_text(value, max_chars), job.name)


def in_thread(call: Callable[[], T], name: str) -> asyncio.Future[T]:
    """``call()`` in a daemon thread, as a future of the running loop. The thread is abandoned,
    not waited for, when its future is cancelled (a timeout): a thread cannot be killed."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_result(value) if error is None else future.set_exception(error)

    def run() -> None:
        try:
            value, error = call_user_code(call), None
        except BaseException as err:  # handed to the loop, which raises it where the call is awaited
            value, error = None, err
        loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=f"tool {name}", daemon=True).start()
    return future


def failure(name: str, err: Exception, max_chars: int) -> Outcome:
    """The answer of a call that raised ``err`` (its own SystemExit or KeyboardInterrupt too)."""
    if isinstance(err, UserCodeExit):
        return Outcome(f"error: {name} {err}", False, False)
    return Outcome(
        capped(f"error: {name} raised {type(err).__name__}: {described(err)}", max_chars)[0], False, False
    )


def result_text(value: Any, max_chars: int) -> tuple[str, bool]:
    """A tool's return value as the text the model reads (a string as it is, anything else as
    JSON), cut to ``max_chars``; and whether it was cut. An awaitable (what an awaited coroutine
    returned) is refused, never shown."""
    if close_unawaited(value):
        raise TypeError(
            "its value is itself awaitable (a coroutine that returns a coroutine?): return a value"
        )
    return capped(value if isinstance(value, str) else json.dumps(value, default=str), max_chars)


def capped(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` cut to its first ``max_chars`` characters with :data:`CUT_MARK` after them, and
    whether it was cut."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + CUT_MARK.format(total=len(text), kept=max_chars), True


def described(err: BaseException) -> str:
    """``str(err)``, or what it is where its own ``__str__`` raises."""
    try:
        return str(err)
    except Exception:
        return f"<{type(err).__name__} whose message cannot be made text>"
