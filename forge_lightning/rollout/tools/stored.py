"""The module's ``tools`` and ``environment_factory`` as its hyperparameters keep them (import
paths) and as the rollouts use them, with what is refused when the module is built: what is not a
tool, what has no import path, an ``async def`` environment factory or score, two tools of one
name in one environment."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from forge_lightning.rollout.tools.environments import (
    environment_class,
    environment_tools,
    factories_by_name,
    refuse_async,
    score_name,
)
from forge_lightning.rollout.tools.function_call import WHAT_A_TOOL_IS
from forge_lightning.run.specs import from_spec, import_path


def tool_names(tools: Sequence[Callable[..., Any]] | None, environments: Sequence[type]) -> list[str]:
    """Every tool's name once: the functions' own, then each environment class's methods. Two
    environments may share a method's name (a row has one environment); one row's tools may not."""
    functions, names = [fn.__name__ for fn in tools or []], []
    for methods in [environment_tools(cls) for cls in environments] or [[]]:
        row = [*functions, *methods]
        duplicated = sorted({n for n in row if row.count(n) > 1})
        if duplicated:
            raise ValueError(f"two tools have the name {', '.join(duplicated)}: each tool needs its own")
        names += [n for n in row if n not in names]
    return names


ToolsArgument: TypeAlias = list[Callable[..., Any]] | None
EnvironmentArgument: TypeAlias = type | str | dict[str, type | str] | None


@dataclass
class StoredTools:
    """The module's ``tools`` and ``environment_factory`` as its hyperparameters keep them (import
    paths: run/specs.py), and as the rollouts use them (the functions, the factory or the mapping
    name -> factory, and the class of the environments each makes)."""

    tools: list[str] | None
    environment_factory: str | dict[str, str] | None
    functions: list[Callable[..., Any]]
    factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None
    environments: dict[str | None, type] = field(default_factory=dict)

    @property
    def environment(self) -> type | None:
        """The class of the environments of a run with one environment factory."""
        return self.environments.get(None)

    @property
    def names(self) -> list[str]:
        return tool_names(self.functions, list(self.environments.values()))

    @property
    def scored(self) -> bool:
        """Whether the run has environments and each scores its episodes (TRL's get_reward)."""
        return bool(self.environments) and all(score_name(cls) for cls in self.environments.values())


def stored_tools(tools: Sequence[Callable[..., Any] | str] | None, environment_factory: Any) -> StoredTools:
    """``tools`` and ``environment_factory`` (objects or import paths; the factory may be a mapping
    name -> factory) both ways. What is not a function (a JSON schema), and one with no import path
    (a lambda, a local function or class, one defined in ``__main__``) are refused: a checkpoint, a
    saved config or another process could not build it back. So are an ``async def`` factory and
    environment score."""
    functions = [from_spec(t, Callable[..., Any]) if isinstance(t, str) else t for t in tools or []]
    for i, fn in enumerate(functions):
        if not callable(fn) or inspect.isclass(fn):
            raise ValueError(f"tools[{i}] is {type(fn).__name__} {fn!r:.100}, not a tool: {WHAT_A_TOOL_IS}")
    factories = {
        name: from_spec(f, type | Callable[..., Any]) if isinstance(f, str) else f
        for name, f in factories_by_name(environment_factory).items()
    }
    for name, factory in factories.items():
        if not callable(factory):
            where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            raise ValueError(
                f"{where} must be a class, or a function that returns an environment (or the import "
                f"path of one), got {type(factory).__name__} {factory!r:.100}"
            )
    named = [("tools", fn) for fn in functions]
    named += [("environment_factory", f) for f in factories.values()]
    for setting, obj in named:
        if import_path(obj) is None:
            raise ValueError(
                f"{setting} takes importable functions and classes (module.name), so that a checkpoint "
                f"and a saved config can name them; {obj!r} has no import path (a lambda, a local "
                "definition, or one in __main__?): define it in a module"
            )
    refuse_async(list(factories.values()), None)
    environments = {name: environment_class(f) for name, f in factories.items()}
    for cls in environments.values():
        refuse_async([], cls)
    paths = {name: import_path(f) for name, f in factories.items()}
    single = None in factories
    return StoredTools(
        [import_path(fn) for fn in functions] if tools is not None else None,
        paths.get(None) if single else (paths or None),
        functions,
        factories.get(None) if single else (factories or None),
        environments,
    )
