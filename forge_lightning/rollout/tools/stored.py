"""The module's ``tools`` and ``environment_factory`` as its hyperparameters keep them (import
paths) and as the rollouts use them, with what is refused when the module is built: what is not a
tool, what has no import path, ``async def`` tools and environment methods, two tools of one name."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from forge_lightning.rollout.tools.calls import WHAT_A_TOOL_IS
from forge_lightning.rollout.tools.environments import environment_class, environment_tools, refuse_async
from forge_lightning.run.specs import from_spec, import_path


def tool_names(tools: Sequence[Callable[..., Any]] | None, environment: type | None) -> list[str]:
    """Every tool's name: the functions' own, then the environment class's methods."""
    names = [fn.__name__ for fn in tools or []]
    names += environment_tools(environment) if environment is not None else []
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"two tools have the name {', '.join(duplicated)}: each tool needs its own")
    return names


ToolsArgument: TypeAlias = list[Callable[..., Any]] | None


@dataclass
class StoredTools:
    """The module's ``tools`` and ``environment_factory`` as its hyperparameters keep them (import
    paths: run/specs.py), and as the rollouts use them (the functions, the factory and the class of
    the environments it makes)."""

    tools: list[str] | None
    environment_factory: str | None
    functions: list[Callable[..., Any]]
    factory: Callable[[], Any] | None
    environment: type | None = None

    @property
    def names(self) -> list[str]:
        return tool_names(self.functions, self.environment)


def stored_tools(tools: Sequence[Callable[..., Any] | str] | None, environment_factory: Any) -> StoredTools:
    """``tools`` and ``environment_factory`` (objects or import paths) both ways. What is not a
    function (a JSON schema), and one with no import path (a lambda, a local function or class,
    one defined in ``__main__``) are refused: a checkpoint, a saved config or another process
    could not build it back. So are ``async def`` tools and environment methods."""
    functions = [from_spec(t, Callable[..., Any]) if isinstance(t, str) else t for t in tools or []]
    factory = environment_factory
    if isinstance(factory, str):
        factory = from_spec(factory, type | Callable[..., Any])
    for i, fn in enumerate(functions):
        if not callable(fn) or inspect.isclass(fn):
            raise ValueError(f"tools[{i}] is {type(fn).__name__} {fn!r:.100}, not a tool: {WHAT_A_TOOL_IS}")
    if factory is not None and not callable(factory):
        raise ValueError(
            f"environment_factory must be a class, or a function that returns an environment (or the "
            f"import path of one), got {type(factory).__name__} {factory!r:.100}"
        )
    for name, obj in [*(("tools", fn) for fn in functions), ("environment_factory", factory)]:
        if obj is not None and import_path(obj) is None:
            raise ValueError(
                f"{name} takes importable functions and classes (module.name), so that a checkpoint "
                f"and a saved config can name them; {obj!r} has no import path (a lambda, a local "
                "definition, or one in __main__?): define it in a module"
            )
    refuse_async([*functions, *([factory] if factory is not None else [])], None)
    environment = environment_class(factory) if factory is not None else None
    refuse_async([], environment)
    paths = [import_path(fn) for fn in functions] if tools is not None else None
    return StoredTools(
        paths, None if factory is None else import_path(factory), functions, factory, environment
    )
