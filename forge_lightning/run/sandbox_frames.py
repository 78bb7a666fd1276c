"""The answers a sandbox worker sends back (run/sandbox_worker.py, run/episode_worker.py): pickled
``(kind, value)`` frames: ``ok`` and the result, ``raised`` and the exception, ``failed`` and a
sentence (an exit, a signal, a result that cannot be pickled), ``timeout`` and a sentence (an
episode's call killed at its time limit by the worker itself)."""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
from typing import Any


def awaited(value: Any, loop: asyncio.AbstractEventLoop | None = None) -> Any:
    """A call's value, awaited where it is a coroutine (an ``async def`` reward, tool or method):
    on ``loop`` where given (an episode's, kept from call to call), else on a loop of its own."""
    if not inspect.isawaitable(value):
        return value
    return asyncio.run(_awaited(value)) if loop is None else loop.run_until_complete(_awaited(value))


async def _awaited(value: Any) -> Any:
    return await value


def frame(kind: str, value: Any) -> bytes:
    try:
        return pickle.dumps((kind, value))
    except Exception as err:  # a result of a class the trainer could not rebuild either
        return pickle.dumps(("failed", f"returned {type(value).__name__}, which cannot be pickled ({err})"))


def raised(err: BaseException) -> bytes:
    """The exception itself where it pickles and unpickles, else a RuntimeError with its text."""
    try:
        answer = pickle.dumps(("raised", err))
        pickle.loads(answer)
        return answer
    except Exception:
        return pickle.dumps(("raised", RuntimeError(f"{type(err).__name__}: {err}")))


def death(status: int) -> str:
    """How a process with the wait ``status`` ended, as the end of a sentence."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name
        why = {
            "SIGXCPU": " (it used up sandbox_cpu_seconds)",
            "SIGKILL": " (killed: its CPU time or memory ran out, or it was killed)",
            "SIGSEGV": " (a segmentation fault)",
        }.get(name, "")
        return f"was killed by signal {name}{why}"
    return f"exited with code {os.WEXITSTATUS(status)} without answering"
