"""An environment (``environment_factory``), as TRL takes one: a class, or a function that returns
an instance, made once per completion so that no state passes between samples. ``reset(**row)``
starts the episode with its prompt's batch fields and may return text appended to the prompt's
last user message; ``get_reward()`` (TRL's name; ``reward()`` is read too) scores the finished
episode (:class:`EnvironmentReward`); its other public methods are the tools.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from forge_lightning.run.user_code import is_async

# The environment methods that are not tools: the episode's start, and its score (TRL's name first).
RESET = "reset"
SCORES = ("get_reward", "reward")


def environment_class(factory: Callable[[], Any]) -> type:
    """The class of the environments ``factory`` makes: a class is its own; a function is called
    once and its instance's class read."""
    return factory if inspect.isclass(factory) else type(factory())


def environment_tools(cls: type) -> list[str]:
    """The tool names of an environment class: its public methods but ``reset`` and the score."""
    return [
        name
        for name, _ in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in (RESET, *SCORES)
    ]


def score_name(cls: type | None) -> str | None:
    """The method that scores an episode of ``cls`` (``get_reward`` or ``reward``), if it has one."""
    return next((name for name in SCORES if callable(getattr(cls, name, None))), None)


def refuse_async(functions: Sequence[Callable[..., Any]], cls: type | None) -> None:
    """ValueError naming every ``async def`` tool, and every async method of the environment class
    ``cls`` (its tools, ``reset`` and its score), before any is called."""
    named = [getattr(fn, "__name__", repr(fn)) for fn in functions if is_async(fn)]
    if cls is not None:
        methods = [*environment_tools(cls), RESET, *SCORES]
        named += [f"{cls.__name__}.{m}" for m in methods if is_async(getattr(cls, m, None))]
    if named:
        raise ValueError(
            f"async tools are not supported yet: {', '.join(named)} (async def); a coroutine would be "
            "the tool's answer, never awaited. Write them as plain def functions (one that needs an "
            "async client can run it with asyncio.run)"
        )
