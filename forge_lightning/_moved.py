"""Where the modules of the flat layout (one folder, before the package took its layer folders),
and those moved between folders since, live now: each old import path keeps working, so that
configs, checkpoints (a reward or callback stored by import path) and users' own imports written
against it still load.

An old module path is the new module itself (one object under two names: a monkeypatch or an
``isinstance`` through either agrees), except where a split sent some of its names elsewhere: then
the old path is a thin module that looks a name up in the new modules in order. An old module
that became a package (``forge_lightning.rollout``, ``.rewards``, ...) keeps its names through that
package's :func:`lazy_exports`. A name renamed within its module keeps its old name there through
:func:`renamed` (an attribute of a class, through :func:`renamed_attribute`), with a
DeprecationWarning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_P = "forge_lightning."

# old module path -> its new home, or the homes its names now have (searched in order)
MOVED: dict[str, str | tuple[str, ...]] = {
    "async_rollout": "rollout.in_flight",
    "backward": "training.loss_passes",
    "bench_references": "bench.references",
    "checkpoint_io": ("run.checkpoint_io", "training.run_state"),
    "components": "settings.assembly",
    "config": ("settings.checks", "run.resume", "callbacks.defaults"),
    "control_tokens": "rollout.control_tokens",
    "fileio": "run.fileio",
    "generation": "rollout.engines",
    "generation_settings": "rollout.engines.generation_settings",
    "hf_compat": "models.hf_compat",
    "logprobs": ("rollout.logprobs", "rollout.types"),
    "lora": "models.lora",
    "metrics": "reporting.metrics",
    "optim": "training.optim",
    "plot": "reporting.plot",
    "policy": "models.policy",
    "preemption": ("run.signals", "callbacks.preemption"),
    "profiler": "reporting.profiler",
    "reward_calls": ("rewards.calls", "run.user_code"),
    "reward_extras": "rewards.extras",
    "reward_model": "rewards.reward_model",
    "reward_setting": "rewards.setting",
    "rewards_math": "rewards.math_verify_reward",
    "rollout_sources": ("rollout.sources", "callbacks.defaults"),
    "run_folder": "run.folder",
    "sampled_eval": "evaluation.sampled",
    "sampling": "rollout.engines.base",
    "sampling_rounds": "training.dynamic_sampling",
    "scoring": ("rewards.batch_scoring", "training.step"),
    "sharding": "models.sharding",
    "specs": "run.specs",
    "step_plan": ("training.plan", "rollout.sources"),
    "tool_rollout": "rollout.tool_sampler",
    "tools": ("rollout.tools", "rewards.environment"),
    "tools.base": "rollout.tools.protocol",
    "tools.calculator": "rollout.tools.calculator",
    "tools.calls": "rollout.tools.function_call",
    "tools.environments": ("rollout.tools.environments", "rewards.environment"),
    "tools.functions": ("rollout.tools.functions", "rewards.environment"),
    "tools.parsers": "rollout.tools.parsers",
    "tools.stored": "rollout.tools.stored",
    "trl_names": "settings.trl_names",
    "validation": ("evaluation.validation", "callbacks.step_axis"),
    "validation_ranks": "evaluation.ranks",
    "vllm_backend": "rollout.engines.vllm",
    "weight_ring": "serving.devices",
    # Moved within the layered layout; the in-process rollout worker became the local:1 server.
    "rollout.engines.async_worker": "rollout.in_flight",
    "rollout.async_worker": "rollout.in_flight",
    "rollout.engines.weight_ring": "serving.devices",
    # The sandbox, a package of its own (it was half of run/).
    "run.episode_worker": "sandbox.episode_worker",
    "run.isolation": "sandbox.isolation",
    "run.landlock": "sandbox.landlock",
    "run.sandbox": "sandbox.pool",
    "run.sandbox_episodes": "sandbox.episode",
    "run.sandbox_frames": "sandbox.frames",
    "run.sandbox_process": "sandbox.process",
    "run.sandbox_view": "sandbox.view",
    "run.sandbox_worker": "sandbox.worker",
    "run.seccomp": "sandbox.seccomp",
    # Named for what it holds: the assembly of the module's parts from its settings.
    "settings.components": "settings.assembly",
    # Renamed so that no two files of the package share a name.
    "callbacks.loop_hooks": "callbacks.rl_loop",
    "callbacks.curriculum": "callbacks.settled_prompt_filter",
    "data.sampler": "data.epoch_sampler",
    "rewards.resume": "rewards.resume_changes",
    "rewards.scoring": ("rewards.batch_scoring", "training.step"),
    "rollout.tools.base": "rollout.tools.protocol",
    "rollout.tools.calls": "rollout.tools.function_call",
    "run.preemption": "run.signals",
    "settings.preflight": "settings.module_preflight",
}

# The packages that took the path of a module of the flat layout: they offer its names (lazy_exports).
PACKAGES_OF_OLD_MODULES = tuple(_P + name for name in ("bench", "models", "reporting", "rewards", "rollout"))

_MISSING = object()


def _look_up(name: str, homes: Sequence[str]) -> Any:
    """``name`` from the first of ``homes`` (modules, imported on first use) that has it; else
    ``_MISSING``. A dunder name is never looked up there (``__path__``, ``__file__``...)."""
    if not name.startswith("__"):
        for home in homes:
            module = importlib.import_module(home)
            if hasattr(module, name):
                return getattr(module, name)
    return _MISSING


def _names_of(homes: Sequence[str]) -> set[str]:
    return {name for home in homes for name in dir(importlib.import_module(home))}


class _Delegate(types.ModuleType):
    """An old module path whose names now live in several modules: each looked up in order."""

    def __init__(self, name: str, homes: Sequence[str]) -> None:
        super().__init__(name, f"Moved: its names are in {', '.join(homes)}.")
        self._homes = list(homes)
        self.__path__: list[str] = []  # its old submodules import through the finder below

    def __getattr__(self, name: str) -> Any:
        value = _look_up(name, self._homes)
        if value is _MISSING:
            raise AttributeError(
                f"module {self.__name__!r} (moved to {self._homes[0]}) has no attribute {name!r}"
            )
        return value

    def __dir__(self) -> list[str]:
        return sorted(_names_of(self._homes))


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path (after every other finder found nothing) and loads it as its home."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_P) or fullname[len(_P) :] not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        homes = MOVED[spec.name[len(_P) :]]
        if isinstance(homes, str):
            module = importlib.import_module(_P + homes)
            spec.loader_state = module.__spec__  # put back after the import system sets ours
            return module
        return _Delegate(spec.name, [_P + home for home in homes])

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__ is not None and module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Let the old module paths import (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def lazy_exports(package: str, homes: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package that offers the names of ``homes`` (modules,
    searched in order, imported on first use): the names of the old module of the same path."""

    def __getattr__(name: str) -> Any:
        value = _look_up(name, homes)
        if value is _MISSING:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # found once: later reads skip the search
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *_names_of(homes)})

    return __getattr__, __dir__


def renamed(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """``__getattr__`` for ``module`` whose old names ``names`` (old -> new) give the object of
    their new name, with a DeprecationWarning that says which it is."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is now {names[name]}: import that name instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], names[name])

    return __getattr__


def renamed_attribute(old: str, new: str) -> property:
    """A class's attribute ``old`` as the property that reads and sets its attribute ``new``, with
    a DeprecationWarning at each use."""

    def warn() -> None:
        warnings.warn(f"{old} is now {new}: use that name instead", DeprecationWarning, stacklevel=3)

    def get(self: Any) -> Any:
        warn()
        return getattr(self, new)

    def set_(self: Any, value: Any) -> None:
        warn()
        setattr(self, new, value)

    return property(get, set_, doc=f"The old name of :attr:`{new}`.")
