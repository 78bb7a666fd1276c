"""What a resumed run may change of a reward it stored by spec (run/specs.py).

A resume refuses a reward whose stored spec differs from the run's (run/resume.py compares the
whole ``reward`` setting). A reward class may name init arguments that change where or how fast
it is scored but not its scores, in a ``changeable_on_resume`` tuple: a served reward's ``url``
(servers move), its batch size, timeouts. Those may change, with a warning; any other argument
of such a reward that changed (a judge's ``template`` or ``parse``) is refused here by name,
before the whole-setting comparison, which would only print both specs.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

from forge_lightning.run.specs import Spec, canonical


def reward_on_resume(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's hyperparameters ``saved`` with the changeable arguments of each reward
    that has some taken from this run's ``current`` (each change warned about), to be compared
    with ``current`` as before. ValueError naming the reward and each argument that changed and
    may not."""
    if "reward" not in saved or "reward" not in current:
        return dict(saved)
    return {**saved, "reward": _accepted(saved["reward"], current["reward"])}


def _accepted(saved: Spec, current: Spec) -> Spec:
    """``saved`` with the changeable arguments of the rewards it shares with ``current`` taken
    from ``current``, walking both where they have the same shape."""
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        return [_accepted(a, b) for a, b in zip(saved, current)]
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return saved
    changeable = _changeable(saved, current)
    if changeable is None:
        return {
            key: _accepted(value, current[key]) if key in current else value for key, value in saved.items()
        }
    return {**saved, "init_args": _init_args(saved, current, changeable)}


def _changeable(saved: dict[str, Any], current: dict[str, Any]) -> tuple[str, ...] | None:
    """The ``changeable_on_resume`` of the class both specs name; None where they name different
    classes, none, or one without it."""
    path = saved.get("class_path")
    if not isinstance(path, str) or canonical(path) != canonical(current.get("class_path")):
        return None
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return getattr(cls, "changeable_on_resume", None)


def _init_args(saved: dict[str, Any], current: dict[str, Any], changeable: tuple[str, ...]) -> dict[str, Any]:
    name = saved["class_path"].rpartition(".")[2]
    before, now = saved.get("init_args") or {}, current.get("init_args") or {}
    changed = [
        key for key in dict.fromkeys([*before, *now]) if canonical(before.get(key)) != canonical(now.get(key))
    ]
    refused = [key for key in changed if key not in changeable]
    if refused:
        what = "; ".join(f"{key}: {before.get(key)!r} -> {now.get(key)!r}" for key in refused)
        raise ValueError(
            f"resuming with a {name} whose {', '.join(refused)} changed since the checkpoint, which "
            f"changes its scores midway ({what}). Run with the original {', '.join(refused)}, or start "
            "a new run in a new folder"
        )
    for key in changed:
        warnings.warn(
            f"resumed with the {name}'s {key} changed: {before.get(key)!r} -> {now.get(key)!r} "
            "(it may change: where the reward is scored, not how)",
            stacklevel=4,
        )
    return {**before, **{key: now.get(key) for key in changed}}
