"""A chat completion request as the agent endpoint (endpoint.py) reads it, its fields checked.

The body comes from the agent's client as JSON; :func:`chat_request` checks every field the endpoint
reads (``messages`` and the parts of each message it renders or compares, ``tools``, ``max_tokens``,
``max_completion_tokens``, ``n``, ``stream``) before any of it reaches an episode, and refuses a
wrong one with a :class:`RequestError` naming it, as OpenAI's ``param`` does
(``messages[2].content``). The fields it does not read (``model``, ``temperature``, ...) pass
unchecked: the run's sampling settings are used, never a request's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatRequest:
    """What the endpoint reads of a request: its messages, the tools it offers, and the tokens it
    asks for at most (``max_completion_tokens``, else ``max_tokens``; None: the episode's budget)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None


class RequestError(ValueError):
    """A request's field ``param`` is wrong (None: the body as a whole); the message says how."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def chat_request(body: Any) -> ChatRequest:
    """The request ``body`` (decoded JSON) as the endpoint reads it; RequestError naming the first
    wrong field."""
    if not isinstance(body, dict):
        raise RequestError(None, f"a chat completion request is a JSON object, got {_kind(body)}")
    if _optional(body, "stream", bool, "a boolean"):
        raise RequestError("stream", "stream is not supported: the endpoint answers whole completions")
    n = _optional(body, "n", int, "an integer")
    if n not in (None, 1):
        raise RequestError(
            "n", f"n={n} is not supported: make one request per completion (each is its own sample)"
        )
    limits = [_positive(body, name) for name in ("max_completion_tokens", "max_tokens")]
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        max_tokens=next((limit for limit in limits if limit is not None), None),
    )


def _messages(messages: Any) -> list[dict[str, Any]]:
    """``messages``: a non-empty list of messages, each checked (:func:`_message`)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages", f"messages must be a non-empty list of messages, got {_kind(messages)}"
        )
    for i, message in enumerate(messages):
        _message(message, f"messages[{i}]")
    return messages


def _message(message: Any, param: str) -> None:
    """A message: an object with a string ``role``; its content a string, a list of parts or null;
    its ``name`` and ``tool_call_id`` strings; its ``tool_calls`` a list of calls."""
    if not isinstance(message, dict):
        raise RequestError(param, f"{param} must be a message object, got {_kind(message)}")
    if not isinstance(message.get("role"), str):
        raise RequestError(
            f"{param}.role", f"{param}.role must be a string, got {_kind(message.get('role'))}"
        )
    _content(message.get("content"), f"{param}.content")
    for key in ("name", "tool_call_id"):
        _optional(message, key, str, "a string", param)
    calls = _optional(message, "tool_calls", list, "a list of tool calls", param)
    for j, call in enumerate(calls or []):
        _call(call, f"{param}.tool_calls[{j}]")


def _content(content: Any, param: str) -> None:
    """A message's content: a string, null, or a list of parts (objects) whose ``text`` is a string."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(param, f"{param} must be a string, a list of parts or null, got {_kind(content)}")
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(
                f"{param}[{k}]", f"{param}[{k}] must be a content part object, got {_kind(part)}"
            )
        _optional(part, "text", str, "a string", f"{param}[{k}]")


def _call(call: Any, param: str) -> None:
    """A tool call sent back: an object whose ``id`` is a string and whose ``function`` is an
    object with a string ``name`` and ``arguments``."""
    if not isinstance(call, dict):
        raise RequestError(param, f"{param} must be a tool call object, got {_kind(call)}")
    _optional(call, "id", str, "a string", param)
    function = _optional(call, "function", dict, "an object", param)
    for key in ("name", "arguments"):
        _optional(function or {}, key, str, "a string", f"{param}.function")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools``: null, or a list of tools, each an object whose ``function`` has a string ``name``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", f"tools must be a list of tools, got {_kind(tools)}")
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"tools[{j}]", f"tools[{j}] must be an object whose function has a string name"
            )
    return tools


def _positive(body: dict[str, Any], key: str) -> int | None:
    """``body[key]``: absent (None) or an integer of at least 1."""
    value = _optional(body, key, int, "a positive integer")
    if value is not None and value < 1:
        raise RequestError(key, f"{key} must be a positive integer, got {value!r}")
    return value


def _optional(mapping: dict[str, Any], key: str, kind: type, what: str, within: str | None = None) -> Any:
    """``mapping[key]``: absent or null (None), else of type ``kind`` (a boolean is no integer);
    RequestError naming ``within.key`` where it is not."""
    value = mapping.get(key)
    wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
    if value is not None and wrong:
        param = f"{within}.{key}" if within else key
        raise RequestError(param, f"{param} must be {what}, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    """``value`` as an error message shows it: its JSON type and a short repr."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    name = names.get(type(value), "a number")
    return name if isinstance(value, dict | list) or value is None else f"{name} {value!r:.40}"
