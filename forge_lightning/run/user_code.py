"""Calling a user's code (a reward, a tool, an environment's method): the keyword arguments its
signature takes (TRL-style functions get TRL's names), ``async def`` told apart, a time limit, and
the one error contract: a SystemExit or KeyboardInterrupt that the code raises itself is its own
failure, one that a signal raised stops the run."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from forge_lightning.run.signals import raised_by_signal, signals_marked

log = logging.getLogger(__name__)

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


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine or an async generator (an ``async def``, or an
    object whose ``__call__`` is one), a reward's or a tool's."""
    call = fn if inspect.isroutine(fn) else getattr(type(fn), "__call__", None)
    call = inspect.unwrap(call) if call is not None else None
    return inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call)


def awaited(value: Any) -> Any:
    """``value``, or where it is awaitable (what an ``async def`` reward returns) what it gives,
    run to the end in an event loop of its own: this thread's, or where this thread runs a loop
    already (a notebook's), a new thread's."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, wait()).result()


def close_unawaited(value: Any) -> bool:
    """Whether ``value`` is awaitable (what an async function returned where a plain one was
    expected); if so it is closed, never awaited, so that Python does not warn that it was not."""
    if not inspect.isawaitable(value):
        return False
    close = getattr(value, "close", None)
    if callable(close):
        close()
    return True


class CallTimeout(TimeoutError):
    """A call ran past its time limit and was abandoned."""


def call_within(call: Callable[[], Any], timeout: float | None, name: str) -> Any:
    """``call()``, in a daemon thread abandoned after ``timeout`` seconds (:class:`CallTimeout`
    naming ``name``); the thread is left to finish alone, as a thread cannot be killed. An
    ``async def`` reward's loop (:func:`awaited`) is this thread's own, so a coroutine that blocks
    it is abandoned the same way."""
    if timeout is None:
        return call()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(timeout):
        raise CallTimeout(f"{name} took longer than {timeout:g}s; the call was abandoned")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@functools.cache
def warn_thread_abandoned(what: str, setting: str, counted: str) -> None:
    """Say, once per process for each ``what`` (``tool``, ``reward``), that a call abandoned past
    ``setting`` (its timeout) in this process runs on in its thread, how such calls are
    ``counted``, and what kills them instead."""
    log.warning(
        "a %s call ran past %s and was abandoned, but its thread keeps running in this process until "
        "the call returns (a thread cannot be killed, nor an async %s that blocks its event loop), "
        "holding what it holds (a CPU, memory, files); sandbox: process runs each call in a worker "
        "process and kills it past its timeout. Said once per process; %s",
        what,
        setting,
        what,
        counted,
    )


class UserCodeExit(Exception):
    """User code (a reward's, a tool's) raised SystemExit or KeyboardInterrupt itself; no signal
    did. An Exception, so that the caller treats it as that code's own failure."""


def call_user_code(call: Callable[[], Any]) -> Any:
    """``call()``, the one error contract of user code that must not stop the run by raising: a
    SystemExit or KeyboardInterrupt that the code raises becomes :class:`UserCodeExit` (the
    original as its cause), while one that a signal raised (Ctrl-C, a SIGTERM under
    preemption.sigterm_interrupts) passes through unchanged, so the run still stops. Tools answer
    a UserCodeExit as the call's error; a reward's stops the run with its name (invoke_reward)."""
    try:
        with signals_marked():
            return call()
    except (SystemExit, KeyboardInterrupt) as err:
        if raised_by_signal(err):
            raise
        raise UserCodeExit(f"raised {err!r} from its own code (no signal did)") from err
