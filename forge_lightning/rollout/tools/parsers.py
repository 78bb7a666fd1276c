"""How a completion writes a function call: a small parser per format, chosen by name
(``tool_call_format``) from :data:`CALL_FORMATS`.

- ``hermes``: Hermes' and Qwen2.5/Qwen3's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``llama3_json``: Llama 3.1/3.2's JSON call, the whole assistant turn ``{"name": ...,
  "parameters": {...}}`` (after an optional ``<|python_tag|>``; several joined by ``;``), which
  ends with the turn's end-of-turn token.
- ``qwen3_coder``: Qwen3-Coder's XML ``<tool_call><function=name><parameter=key>value</parameter>
  </function></tool_call>``, each value text read by its parameter's type in the tool's schema.

A turn is read at its end (the end-of-turn token it samples), whole: every call it wrote, in
every format, runs (up to the completion's cap of calls). The text parsed is what the model
sampled: it is read as JSON or text, never run. Whatever is
wrong with a call (no JSON, an unknown name, arguments that do not fit the function) becomes an
error message the model reads back as the tool's result.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ParsedCall:
    """A call read from the completion: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


class CallFormat(Protocol):
    """A tool-call format: the text a call begins with (``begins``), a call as the model is told
    to write one (``example``), and how the text of the policy's turn, read whole at its end (its
    end-of-turn token), becomes its calls (each, or the message saying what is wrong with it)."""

    example: str
    begins: str  # the text a call starts with; "" where the whole turn is the call

    def write(self, name: str, arguments: dict[str, Any]) -> str:
        """A call of ``name`` as this format writes it (what the model would sample)."""
        ...

    def has_calls(self, text: str) -> bool:
        """Whether the policy's turn ``text``, read whole at its end, holds a call."""
        ...

    def parse(self, text: str) -> list[ParsedCall | str]: ...


def json_call(text: str, arguments_key: str = "arguments") -> ParsedCall | str:
    """One call written as a JSON object ``{"name": ..., <arguments_key>: {...}}`` (the arguments
    may be written as a JSON string, as some models do), or what is wrong with it."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError as err:
        return f"the call is not valid JSON ({err.msg} at character {err.pos})"
    shape = f'a call is a JSON object {{"name": ..., "{arguments_key}": {{...}}}}'
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return shape
    arguments = call.get(arguments_key, call.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "the call's arguments are not a JSON object"
    if not isinstance(arguments, dict):
        return "the call's arguments are not a JSON object"
    return ParsedCall(call["name"], arguments)


class HermesToolCalls:
    """Hermes' and Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: every
    complete call of the turn, in order (a model may write several in a row)."""

    begins = "<tool_call>"
    example = '<tool_call>{"name": "the tool\'s name", "arguments": {"argument": "value"}}</tool_call>'
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, schemas: Sequence[dict[str, Any]] = ()) -> None:
        pass  # JSON carries each argument's type

    def write(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"

    def has_calls(self, text: str) -> bool:
        return self._block.search(text) is not None

    def parse(self, text: str) -> list[ParsedCall | str]:
        blocks = self._block.findall(text)
        if not blocks:
            return ["no <tool_call>...</tool_call> call found"]
        return [json_call(block) for block in blocks]


class Llama3JsonToolCalls:
    """Llama 3.1/3.2's JSON tool calls: the policy's turn is the call, ``{"name": ...,
    "parameters": {...}}`` (vLLM's ``llama3_json``), after an optional ``<|python_tag|>``;
    several calls are joined by ``;``. The calls end with the turn, at its end-of-turn token
    (``<|eot_id|>``, ``<|eom_id|>``)."""

    begins = ""
    example = '{"name": "the tool\'s name", "parameters": {"argument": "value"}} as the whole reply'
    _tag = "<|python_tag|>"
    _call = re.compile(r'\{\s*"name"\s*:')  # how a call begins; other JSON is an answer

    def __init__(self, schemas: Sequence[dict[str, Any]] = ()) -> None:
        pass  # JSON carries each argument's type

    def write(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments})

    def has_calls(self, text: str) -> bool:
        return self._call.match(self._body(text)) is not None

    def _body(self, text: str) -> str:
        return text.strip().removeprefix(self._tag).strip()

    def parse(self, text: str) -> list[ParsedCall | str]:
        body, decoder, calls, at = self._body(text), json.JSONDecoder(), [], 0
        if not body.startswith("{"):
            return ['no call found: a call is the whole reply, {"name": ..., "parameters": {...}}']
        while at < len(body):
            try:
                _, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError as err:
                return [*calls, f"the call is not valid JSON ({err.msg} at character {err.pos})"]
            calls.append(json_call(body[at:end], "parameters"))
            rest = body[end:].lstrip().removeprefix(";").lstrip()
            at = len(body) - len(rest)
        return calls


class Qwen3CoderToolCalls:
    """Qwen3-Coder's XML tool calls (vLLM's ``qwen3_coder``): ``<tool_call>\\n<function=name>\\n
    <parameter=key>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``, every complete call of
    the turn in order. A value is text: it is read as its parameter's type in the tool's schema
    says (a string as it is, anything else as JSON; text that is not JSON stays text)."""

    begins = "<tool_call>"
    example = (
        "<tool_call>\n<function=the tool's name>\n<parameter=argument>\nvalue\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _function = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def __init__(self, schemas: Sequence[dict[str, Any]] = ()) -> None:
        self.types = {
            s["function"]["name"]: {
                key: spec.get("type")
                for key, spec in s["function"].get("parameters", {}).get("properties", {}).items()
            }
            for s in schemas
        }

    def write(self, name: str, arguments: dict[str, Any]) -> str:
        shown = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{shown}</function>\n</tool_call>"

    def has_calls(self, text: str) -> bool:
        return self._block.search(text) is not None

    def parse(self, text: str) -> list[ParsedCall | str]:
        blocks = self._block.findall(text)
        if not blocks:
            return ["no <tool_call>...</tool_call> call found"]
        return [self._call(block) for block in blocks]

    def _call(self, block: str) -> ParsedCall | str:
        function = self._function.search(block)
        if function is None:
            return (
                "a call is <tool_call><function=name><parameter=key>value</parameter></function></tool_call>"
            )
        name, body = function.group(1).strip(), function.group(2)
        types = self.types.get(name, {})
        arguments = {
            key.strip(): self._value(value.removeprefix("\n").removesuffix("\n"), types.get(key.strip()))
            for key, value in self._parameter.findall(body)
        }
        return ParsedCall(name, arguments)

    @staticmethod
    def _value(text: str, kind: Any) -> Any:
        if kind == "string" or kind is None:
            return text
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"  # the template writes Python's True and False
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # the tool's signature check, or the tool, says what is wrong with it


CALL_FORMATS: dict[str, type] = {
    "hermes": HermesToolCalls,
    "llama3_json": Llama3JsonToolCalls,
    "qwen3_coder": Qwen3CoderToolCalls,
}


def format_names() -> str:
    """The formats ``tool_call_format`` may name, for a message: ``'hermes'``, ..."""
    return ", ".join(map(repr, sorted(CALL_FORMATS)))


def format_named(name: str, schemas: Sequence[dict[str, Any]] = ()) -> CallFormat:
    """The format ``tool_call_format`` names, reading calls of the tools whose JSON schemas are
    ``schemas``."""
    if name not in CALL_FORMATS:
        raise ValueError(f"tool_call_format must be one of {format_names()}, got {name!r}")
    return CALL_FORMATS[name](schemas)
