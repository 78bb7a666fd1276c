"""One call of a function tool: run within its time limit, its result made the text the model
reads (cut to a length, marked where cut), and every failure of the tool's own an error message
the model reads back while the run goes on."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from transformers.utils import get_json_schema

from forge_lightning.rollout.tools.parsers import ParsedCall
from forge_lightning.run.sandbox import DEFAULT_TIMEOUT, Sandbox, SandboxTimeout
from forge_lightning.run.user_code import (
    CallTimeout,
    UserCodeExit,
    call_user_code,
    call_within,
    close_unawaited,
)

# The characters of a result the model reads at most (the module's max_tool_result_chars), and
# what follows a result that was cut.
MAX_RESULT_CHARS = 10_000
CUT_MARK = "\n[cut: the result has {total} characters; the first {kept} are shown]"
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


def run_call(
    parsed: ParsedCall | str,
    functions: dict[str, Callable[..., Any]],
    timeout: float | None,
    max_chars: int,
    sandbox: Sandbox | None = None,
) -> tuple[str, bool, bool]:
    """A call's result as text, whether it succeeded and whether the text was cut. Every failure
    is a message the model reads and the run goes on: a raise, a timeout, a SystemExit or
    KeyboardInterrupt of the tool's own (run/user_code.py's call_user_code); a signal still stops the run.
    In a ``sandbox`` the tool runs in a worker process, killed past ``timeout`` (the sandbox's
    default where None); an exit or a crash there is the call's error."""
    if isinstance(parsed, str):
        return f"error: {parsed}", False, False
    name, fn = parsed.name, functions.get(parsed.name)
    if fn is None:
        return f"error: no tool is named {name!r}; the tools are {', '.join(functions)}", False, False
    try:
        inspect.signature(fn).bind(**parsed.arguments)
    except TypeError as err:
        return f"error: wrong arguments for {name}: {err}", False, False

    def call() -> tuple[str, bool]:
        # The text is made here, within the time limit and the error handling: the JSON of a huge
        # or pathological value (circular, a raising __str__) is the tool's own failure.
        if sandbox is not None:
            return result_text(sandbox.call(fn, (), parsed.arguments, timeout, f"tool {name!r}"), max_chars)
        return result_text(fn(**parsed.arguments), max_chars)

    try:
        text, cut = call_user_code(call if sandbox else lambda: call_within(call, timeout, f"tool {name!r}"))
    except (CallTimeout, SandboxTimeout):
        return f"error: {name} took longer than {timeout or DEFAULT_TIMEOUT:g}s", False, False
    except UserCodeExit as err:
        return f"error: {name} {err}", False, False
    except Exception as err:  # the tool's own failure: the model reads it, the run goes on
        return (
            capped(f"error: {name} raised {type(err).__name__}: {described(err)}", max_chars)[0],
            False,
            False,
        )
    return text, True, cut


def result_text(value: Any, max_chars: int) -> tuple[str, bool]:
    """A tool's return value as the text the model reads (a string as it is, anything else as
    JSON), cut to ``max_chars``; and whether it was cut. A coroutine is refused, never shown."""
    if close_unawaited(value):
        raise TypeError("it returned a coroutine: async tools are not supported yet, write it as a plain def")
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
