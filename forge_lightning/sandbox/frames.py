"""The answers of sandboxed code, as data: what a call (sandbox/worker.py) or an episode's
process (sandbox/episode_worker.py) hands back crosses to its worker, and from the worker to the
trainer, as JSON, never as a pickle: nothing it returns or raises can run code where it is read.

An answer is ``[kind, value]``: ``ok`` and the result, ``raised`` and the exception (its type's
module and name, its message, its arguments where they are plain data), ``failed`` and a sentence
(an exit, a signal, a result that is not data), ``timeout`` and a sentence (an episode's call
killed at its time limit by the worker itself). The worker adds the call's id (``[id, kind,
value]``) before it answers the trainer, which checks it.

A result is made data where it was made, in the call's own process (:func:`as_data`): None, bool,
int, float and str as they are, lists and tuples as lists, dicts with string keys as dicts, numpy
and torch scalars as numbers and their arrays as nested lists; anything else is the call's error,
named. An answer longer than :data:`MAX_ANSWER_BYTES` is the call's error too.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import inspect
import json
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

# The longest answer, in bytes of JSON, a call may give (a tool's text is cut to its own length
# cap before this applies).
MAX_ANSWER_BYTES = 64 << 20
KINDS = ("ok", "raised", "failed", "timeout")
_DEPTH = 100  # nesting deeper than this is not data the trainer reads


class NotData(TypeError):
    """A value that is not data (:func:`as_data`)."""


class SandboxRaised(RuntimeError):
    """A sandboxed call raised an exception of a type that does not cross as itself (one not
    built into Python): its type's name and message, as text."""


def awaited(value: Any, loop: asyncio.AbstractEventLoop | None = None) -> Any:
    """A call's value, awaited where it is a coroutine (an ``async def`` reward, tool or method):
    on ``loop`` where given (an episode's, kept from call to call), else on a loop of its own."""
    if not inspect.isawaitable(value):
        return value
    return asyncio.run(_awaited(value)) if loop is None else loop.run_until_complete(_awaited(value))


async def _awaited(value: Any) -> Any:
    return await value


def as_data(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data (see the module's docstring); :class:`NotData` naming what is not."""
    if depth > _DEPTH:
        raise NotData(f"nests deeper than {_DEPTH} levels")
    if value is None or type(value) in (bool, int, float, str):
        return value
    for plain in (int, float, str):  # a subclass (an IntEnum, a str subclass): its plain value
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, (list, tuple)):
        return [as_data(item, depth + 1) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise NotData("is a dict whose keys are not all strings")
        return {str(key): as_data(item, depth + 1) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # its fields, as a dict
        return {f.name: as_data(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    kind = type(value).__module__.split(".")[0]
    if kind in ("numpy", "torch") and callable(getattr(value, "tolist", None)):
        return as_data(value.tolist(), depth + 1)  # a scalar's tolist() is its number
    raise NotData(f"is a {type(value).__module__}.{type(value).__qualname__}")


def encoded(kind: str, value: Any) -> bytes:
    """The answer ``[kind, value]`` as JSON bytes: a ``failed`` answer naming why where ``value``
    is not data or the answer is longer than :data:`MAX_ANSWER_BYTES`."""
    try:
        text = json.dumps([kind, as_data(value)])
    except (NotData, ValueError, RecursionError) as err:
        what = "its result" if kind == "ok" else "its answer"
        return failed(
            f"returned a value that is not data ({what} {err}): a sandboxed call returns None, "
            "bool, int, float, str, lists and dicts of them, or numpy/torch numbers"
        )
    if len(text) > MAX_ANSWER_BYTES:
        return failed(f"answered {len(text)} bytes, more than the sandbox's {MAX_ANSWER_BYTES}")
    return text.encode()


def failed(why: str) -> bytes:
    return json.dumps(["failed", why]).encode()


def raised(err: BaseException) -> bytes:
    """The answer of a call that raised ``err``: its type, message and (plain) arguments."""
    kind = type(err)
    try:
        message = str(err)
    except Exception:
        message = f"<{kind.__name__} whose message cannot be made text>"
    try:
        args = as_data(list(err.args))
        if not all(arg is None or isinstance(arg, (bool, int, float, str)) for arg in args):
            args = None
    except NotData:
        args = None
    return encoded(
        "raised", {"module": kind.__module__, "type": kind.__qualname__, "message": message, "args": args}
    )


def receive(conn: Connection) -> bytes | None:
    """The next answer on ``conn``; None at its end; a ``failed`` answer where it is longer than any
    answer may be."""
    try:
        return conn.recv_bytes(MAX_ANSWER_BYTES + 1024)
    except EOFError:
        return None
    except OSError:  # "bad message length"
        return failed(f"answered more than the sandbox's {MAX_ANSWER_BYTES} bytes")


def decoded(answer: bytes) -> tuple[str, Any]:
    """A call's answer as its worker reads it: ``(kind, value)``; ValueError where it is not one
    (a call's process that wrote its own bytes)."""
    try:
        kind, value = json.loads(answer)
    except (ValueError, TypeError) as err:
        raise ValueError(f"an answer that is not the sandbox's JSON ({err})") from None
    if kind not in KINDS:
        raise ValueError(f"an answer of unknown kind {str(kind)[:40]!r}")
    return kind, value


def exception(value: Any) -> BaseException:
    """The exception a ``raised`` answer names, made again in the trainer: a built-in exception
    type as itself (with its arguments where they crossed), any other as :class:`SandboxRaised`
    with its type's name and message. Nothing of the call's code runs here."""
    if not isinstance(value, dict):
        return SandboxRaised(f"raised something the sandbox could not read: {str(value)[:200]}")
    module, name, message = value.get("module"), value.get("type"), str(value.get("message"))
    kind = getattr(builtins, str(name), None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        args = value.get("args")
        for arguments in [args, [message]] if isinstance(args, list) else [[message]]:
            try:
                return kind(*arguments)
            except Exception:  # a type whose arguments did not cross (UnicodeDecodeError's bytes)
                continue
    return SandboxRaised(f"{module}.{name}: {message}")


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
