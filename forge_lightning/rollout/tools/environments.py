"""An environment (``environment_factory``), as TRL takes one: a class, or a function that returns
an instance, made once per completion so that no state passes between samples. ``reset(**row)``
starts the episode with its prompt's batch fields and may return text appended to the prompt's
last user message; ``get_reward()`` (TRL's name; ``reward()`` is read too) scores the finished
episode (:class:`EnvironmentReward`); its other public methods are the tools (an ``async def``
tool, or reset, is awaited). Several environments are a mapping name -> factory: each row's
``environment`` field (TRL's column) picks its own, so one run mixes tasks.

Under ``sandbox: process`` an episode's environment lives in a sandbox worker's process for the
whole episode (sandbox/pool.py's sticky episodes): :func:`sandboxed_environment` makes it there
and resets it, and the trainer holds a :class:`SandboxedEnvironment`, whose public methods (the
tools, the score) run in that process.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forge_lightning.run.user_code import accepted_kwargs, is_async
from forge_lightning.sandbox.pool import Sandbox, SandboxEpisode

# The environment methods that are not tools: the episode's start, and its score (TRL's name first).
RESET = "reset"
SCORES = ("get_reward", "reward")
# The dataset field that names a row's environment where there are several (TRL's column).
ENVIRONMENT_FIELD = "environment"


def factories_by_name(factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None) -> dict[Any, Any]:
    """``environment_factory`` as a mapping name -> factory: one factory under the name None, none
    as an empty mapping; ValueError for an empty mapping or one whose names are not text."""
    if factory is None:
        return {}
    if not isinstance(factory, Mapping):
        return {None: factory}
    if not factory or not all(isinstance(name, str) and name for name in factory):
        raise ValueError(
            "environment_factory as a mapping names each environment (a non-empty string, what a "
            f"row's {ENVIRONMENT_FIELD!r} field says) -> its factory; got {dict(factory)!r:.200}"
        )
    return dict(factory)


def environment_named(factories: Mapping[Any, Any], row: Mapping[str, Any]) -> str | None:
    """The name of ``row``'s environment: its ``environment`` field where there are several
    (ValueError naming the environments there are for a row that names none of them); None where
    there is one environment or none."""
    if not factories or None in factories:
        return None
    name = row.get(ENVIRONMENT_FIELD)
    if name not in factories:
        said = f"names {name!r}" if ENVIRONMENT_FIELD in row else f"has no {ENVIRONMENT_FIELD!r} field"
        raise ValueError(
            f"a row {said}: with several environments (environment_factory a mapping), each row's "
            f"{ENVIRONMENT_FIELD!r} field names its own, one of {', '.join(map(repr, factories))}"
        )
    return name


# What an environment factory must be, said where one is not.
WHAT_A_FACTORY_IS = (
    "it must be a class, or a function that takes no arguments and returns an environment (an object "
    "whose public methods are its tools; reset(**row) and get_reward() optional)"
)


def environment_class(factory: Callable[[], Any]) -> type:
    """The class of the environments ``factory`` makes: a class is its own; a function is called
    once and its instance's class read. ValueError (:data:`WHAT_A_FACTORY_IS`) for a function that
    needs arguments, and for a built-in class or value (``os.getcwd`` makes a str): no environment."""
    name = f"environment_factory {getattr(factory, '__name__', repr(factory))}"
    if inspect.isclass(factory):
        cls, said = factory, f"is the built-in {factory.__name__}"
    else:
        try:
            inspect.signature(factory).bind()
        except TypeError:
            raise ValueError(f"{name} takes arguments: {WHAT_A_FACTORY_IS}") from None
        except ValueError:  # no signature to read (some built-ins): calling it says
            pass
        made = factory()
        cls, said = type(made), f"returned {type(made).__name__} {made!r:.60}"
    if cls.__module__ == "builtins":
        raise ValueError(f"{name} {said}, not an environment: {WHAT_A_FACTORY_IS}")
    return cls


def environment_type(env: Any) -> type:
    """The class of ``env``: its own, or for a :class:`SandboxedEnvironment` the class in its worker."""
    return env.environment_class if isinstance(env, SandboxedEnvironment) else type(env)


def probe_environment(factory: Callable[[], Any], sandboxed: bool) -> Any:
    """An environment to read the tools and their schemas from: under ``sandbox: process`` a
    class's instance made without running its ``__init__`` (user code runs in the workers);
    else (or for a function factory) one the factory makes."""
    return factory.__new__(factory) if sandboxed and inspect.isclass(factory) else factory()


class SandboxedEnvironment:
    """An episode's environment that lives in a sandbox worker's process: each public method of
    ``environment_class`` (with its signature, as a tool's schema needs) is called there.

    Args:
        episode: the sticky episode holding it.
        environment_class: the class of the environment made there.
        timeout: seconds a call may take, after which the episode's process is killed and the
            episode ends (None: the sandbox's default).
    """

    def __init__(self, episode: SandboxEpisode, environment_class: type, timeout: float | None) -> None:
        self.episode, self.environment_class, self.timeout = episode, environment_class, timeout

    def __getattr__(self, name: str) -> Any:
        cls = self.__dict__.get("environment_class")
        fn = None if cls is None or name.startswith("_") else getattr(cls, name, None)
        if not inspect.isfunction(fn):
            raise AttributeError(name)
        return types.MethodType(_remote(name, fn, f"{cls.__name__}.{name}"), self)


def _remote(name: str, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """A function standing for the method ``fn`` that calls it in the episode's process."""

    def method(self: SandboxedEnvironment, **kwargs: Any) -> Any:
        return self.episode.call(name, kwargs, self.timeout, what)

    method.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    method.__name__, method.__qualname__, method.__doc__ = name, what, fn.__doc__
    return method


def sandboxed_environment(
    sandbox: Sandbox, factory: Callable[[], Any], cls: type, row: dict[str, Any], timeout: float | None
) -> tuple[SandboxedEnvironment, Any]:
    """A new episode's environment made by ``factory`` in one of ``sandbox``'s workers, its
    ``reset`` called there with the fields of ``row`` it takes; and what reset returned."""
    reset = getattr(cls, RESET, None)
    method, kwargs = (RESET, accepted_kwargs(reset, row)) if callable(reset) else (None, {})
    episode, text = sandbox.open_episode(factory, method, kwargs, timeout, f"{cls.__name__}.{RESET}")
    return SandboxedEnvironment(episode, cls, timeout), text


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


def refuse_async(factories: Sequence[Callable[..., Any]], cls: type | None) -> None:
    """ValueError naming every ``async def`` environment factory, and the async score of the
    environment class ``cls``, before any is called: the tools and ``reset`` are awaited, but a
    factory and the score (read by the reward) are called where nothing awaits them."""
    named = [getattr(fn, "__name__", repr(fn)) for fn in factories if is_async(fn)]
    if cls is not None:
        named += [f"{cls.__name__}.{m}" for m in SCORES if is_async(getattr(cls, m, None))]
    if named:
        raise ValueError(
            f"{', '.join(named)} cannot be async def: an environment factory and an environment's "
            "score are called where nothing awaits them (its tools and reset may be async). Write "
            "them as plain def functions"
        )
