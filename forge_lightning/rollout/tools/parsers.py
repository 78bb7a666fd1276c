"""How a completion writes a function call: a small parser per format, chosen by name
(``tool_call_format``).

The text parsed is what the model sampled: it is read as JSON, never run. Whatever is wrong with
a call (no JSON, an unknown name, arguments that do not fit the function) becomes an error message
the model reads back as the tool's result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ParsedCall:
    """A call read from the completion: the tool's name and its arguments as JSON gave them."""

    name: str
    arguments: dict[str, Any]


class CallFormat(Protocol):
    """A tool-call format: the text a call starts and ends with (``start``, ``stop``), a call as
    the model is told to write one (``example``), and how the text of the policy's turn becomes
    its calls (each, or the message saying what is wrong with it)."""

    start: str
    stop: str
    example: str

    def parse(self, text: str) -> list[ParsedCall | str]: ...


class HermesToolCalls:
    """Hermes' and Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: every
    complete call of the turn, in order (a model may write several in a row)."""

    start = "<tool_call>"
    stop = "</tool_call>"
    example = '<tool_call>{"name": "the tool\'s name", "arguments": {"argument": "value"}}</tool_call>'
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall | str]:
        blocks = self._block.findall(text)
        if not blocks:
            return [f"no {self.start}...{self.stop} call found"]
        return [self._call(block) for block in blocks]

    def _call(self, block: str) -> ParsedCall | str:
        try:
            call = json.loads(block)
        except json.JSONDecodeError as err:
            return f"the call is not valid JSON ({err.msg} at character {err.pos})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 'a call is a JSON object {"name": ..., "arguments": {...}}'
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return "the call's arguments are not a JSON object"
        if not isinstance(arguments, dict):
            return "the call's arguments are not a JSON object"
        return ParsedCall(call["name"], arguments)


CALL_FORMATS: dict[str, type] = {"hermes": HermesToolCalls}


def format_names() -> str:
    """The formats ``tool_call_format`` may name, for a message: ``'hermes'``, ..."""
    return ", ".join(map(repr, sorted(CALL_FORMATS)))


def format_named(name: str) -> CallFormat:
    """The format ``tool_call_format`` names."""
    if name not in CALL_FORMATS:
        raise ValueError(f"tool_call_format must be one of {format_names()}, got {name!r}")
    return CALL_FORMATS[name]()
