"""What a resumed run checks against its checkpoint: the module's settings that may not change
midway (every other one, and every trainer setting, may: applied and logged). Which may is the
settings' own declaration (settings/groups/' CHANGEABLE_ON_RESUME), handed in as
``changeable``."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from forge_lightning.run.specs import canonical

log = logging.getLogger(__name__)


# Settings the hyperparameters hold only when they can (the reward, given by import path:
# run/specs.py): a checkpoint that holds one and a run that cannot say what its own is differ.
STORED_WHEN_POSSIBLE = ("reward",)


def changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, str]:
    """``name -> "name: old -> new"`` for each setting that differs between what a checkpoint
    recorded and this run. A setting only one side records (an older checkpoint) is not compared,
    except a ``STORED_WHEN_POSSIBLE`` one the checkpoint holds and this run could not store."""
    names = sorted(set(saved) & set(current))
    # An import path compares by the object it names: a checkpoint written before a module moved
    # holds its old path.
    changed = {
        n: f"{n}: {saved[n]!r} -> {current[n]!r}"
        for n in names
        if canonical(saved[n]) != canonical(current[n])
    }
    for n in STORED_WHEN_POSSIBLE:
        if n in saved and n not in current:
            changed[n] = f"{n}: {saved[n]!r} -> an object with no import path (a lambda or local function?)"
    return dict(sorted(changed.items()))


def resume_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], changeable: Collection[str]
) -> tuple[list[str], list[str]]:
    """:func:`changed_settings` of the module's hyperparameters, split into (those that may not
    change on resume, those that may: ``changeable``)."""
    changed = changed_settings(saved, current)
    fixed = [line for name, line in changed.items() if name not in changeable]
    return fixed, [line for name, line in changed.items() if name in changeable]


def check_resume_settings(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    data_changes: Sequence[str] = (),
    *,
    changeable: Collection[str],
) -> None:
    """Raise ValueError naming every setting that differs from the checkpoint's and may not change
    on resume (all but ``changeable``): the module's, and the data's ``data_changes`` (``name: old
    -> new`` lines, e.g. a datamodule's ``resume_changes``) in the same error; log the ones that
    may (the learning rate is applied by the module)."""
    fixed, changed = resume_differences(saved, current, changeable)
    if fixed or data_changes:
        lines = [f"model.{line}" for line in fixed]
        lines += [f"data.{line} (the data position would point at other prompts)" for line in data_changes]
        raise ValueError(
            "resuming with settings that differ from the checkpoint's, which a run cannot change "
            "midway:\n  " + "\n  ".join(lines) + "\nRun with the original settings, or start a new run in "
            "a new folder"
        )
    for line in changed:
        log.info("resumed with a changed setting: %s", line)


def check_resume(
    checkpoint: Mapping[str, Any],
    current: Mapping[str, Any],
    fit: Mapping[str, Any],
    changeable: Collection[str],
) -> None:
    """A resumed fit's checks: the module's settings (``current``, flat as the checkpoint keeps
    them) may not change where that breaks the run (check_resume_settings); every trainer setting
    (``fit``, run/fit.py's ``FitShape.recorded``) may (a longer run, another cadence): applied and
    logged."""
    check_resume_settings(checkpoint.get("hyper_parameters", {}), current, changeable=changeable)
    for line in changed_settings(checkpoint.get("forge_trainer_settings", {}), fit).values():
        log.info("resumed with a changed trainer setting, applied: %s", line)
