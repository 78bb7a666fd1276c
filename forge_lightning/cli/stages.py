"""A recipe of several fits as one command: a config's ``stages``.

A config may end with a list of stages, each a name and the settings it changes::

    stages:
      - name: chains
        trainer: {max_steps: 60}
      - name: explore                      # 40 more steps with other sampling settings
        trainer: {max_steps: 40}
        model: {...}

``forge-lightning fit --config recipe.yaml`` then runs one fit per stage, in order, each in a folder
of its own under the run's ``default_root_dir`` (``<root>/<name>``): the config, then the stage's
settings, then the command line's flags (which apply to every stage), and from the second stage on
``--model.model`` the previous stage's ``final/`` weights, with a fresh optimizer, as running the
stages one command at a time would. A stage is done once its fit reached its ``max_steps``, or
the goal of a ``StopAtGoal`` in its ``trainer.callbacks`` (callbacks/stop_at_goal.py); it leaves
``stage.json`` (its steps and where its final weights are). ``--ckpt_path last`` goes on
where the recipe stopped: done stages are skipped, the first unfinished one resumes from its
``last.ckpt``, the rest start after it. A stage stopped early (``max_time``, a signal) ends the
command there, with the line that resumes it.

Every other subcommand (``validate``, ``test``, ``predict``) reads such a config without its
stages: the settings before them, so that the recipe's own config evaluates its final weights.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from forge_lightning.callbacks._paths import output_dir
from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.callbacks.stop_at_goal import ended_at_goal

STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DONE_FILE = "stage.json"
# What a stage may not set: where its fit runs and what it resumes are the recipe's.
NOT_PER_STAGE = {("trainer", "default_root_dir"), ("ckpt_path",)}


@dataclass(frozen=True)
class Stage:
    name: str
    settings: dict[str, Any]  # the config sections it changes (trainer, model, data, ...)


def config_paths(args: list[str]) -> list[int]:
    """The positions in ``args`` of each ``--config``/``-c`` value."""
    found = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            found.append(i + 1)
        elif arg.startswith("--config="):
            found.append(i)
    return found


def _path_at(args: list[str], i: int) -> str:
    return args[i].removeprefix("--config=")


def staged_config(args: list[str]) -> tuple[int, list[Stage]] | None:
    """The position in ``args`` of the config that has ``stages``, and its stages; None when none has."""
    staged = []
    for i in config_paths(args):
        path = Path(_path_at(args, i))
        loaded = yaml.safe_load(path.read_text()) if path.is_file() else None
        if isinstance(loaded, dict) and "stages" in loaded:
            staged.append((i, parse_stages(loaded["stages"], path)))
    if len(staged) > 1:
        raise SystemExit("fit: only one --config may list stages; the others add or change settings")
    return staged[0] if staged else None


def parse_stages(raw: Any, path: Path) -> list[Stage]:
    """``stages`` as written in ``path``, checked: a non-empty list of mappings, each with a unique
    ``name`` fit for a folder and no setting a stage may not change."""
    where = f"{path}: stages"
    if not isinstance(raw, list) or not raw:
        raise SystemExit(f"{where} must be a non-empty list of {{name: ..., <section>: {{...}}}}")
    stages, names = [], set()
    for k, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise SystemExit(f"{where}[{k}] must be a mapping with a name (a folder name), got {entry!r}")
        name = entry["name"]
        if not STAGE_NAME.match(name) or name in names:
            raise SystemExit(f"{where}[{k}].name {name!r} must be a new folder name (letters, digits, _ . -)")
        names.add(name)
        settings = {key: value for key, value in entry.items() if key != "name"}
        for section, *key in NOT_PER_STAGE:
            if section in settings and (not key or key[0] in (settings[section] or {})):
                raise SystemExit(
                    f"{where}[{k}] sets {'.'.join([section, *key])}: that is the recipe's, not a stage's"
                )
        stages.append(Stage(name, settings))
    return stages


@dataclass(frozen=True)
class Staged:
    """A command's arguments with the staged config replaced by a copy without its stages, the
    stages, and the folder holding that copy and each stage's settings (``stage-<k>-<name>.yaml``)."""

    args: list[str]
    stages: list[Stage]
    folder: Path | None

    def stage_file(self, k: int) -> Path:
        return self.folder / f"stage-{k}-{self.stages[k].name}.yaml"


@contextmanager
def without_stages(args: list[str]) -> Iterator[Staged]:
    """``args`` as :class:`Staged` (no stages: ``args`` as they are), its files for the duration."""
    staged = staged_config(args)
    if staged is None:
        yield Staged(args, [], None)
        return
    position, stages = staged
    path = Path(_path_at(args, position))
    config = yaml.safe_load(path.read_text())
    del config["stages"]
    with tempfile.TemporaryDirectory(prefix="forge-stages-") as folder:
        base = Path(folder) / path.name
        base.write_text(yaml.safe_dump(config, sort_keys=False))
        out = list(args)
        out[position] = f"--config={base}" if args[position].startswith("--config=") else str(base)
        result = Staged(out, stages, Path(folder))
        for k, stage in enumerate(stages):
            result.stage_file(k).write_text(yaml.safe_dump(stage.settings))
        yield result


def _flag(args: list[str], name: str) -> str | None:
    """The last value the command line gives ``--name`` (``--name V`` or ``--name=V``)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
    return value


def _root(args: list[str]) -> Path:
    """The run's ``default_root_dir``: the command line's, else the last config's that sets it."""
    given = _flag(args, "--trainer.default_root_dir")
    if given is not None:
        return Path(given)
    root = None
    for i in config_paths(args):
        loaded = yaml.safe_load(Path(_path_at(args, i)).read_text()) or {}
        root = (loaded.get("trainer") or {}).get("default_root_dir", root)
    if root is None:
        raise SystemExit(
            "fit: a config with stages needs trainer.default_root_dir (each stage runs in a folder under it)"
        )
    return Path(root)


def _without_flag(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == name and i + 1 < len(args):
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def run_stages(args: list[str], fit: Callable[[list[str]], Any]) -> None:
    """``fit`` (a subcommand's arguments -> the LightningCLI that ran them) once per stage of the
    staged config in ``args`` (``args[0] == "fit"``), as the module docstring says."""
    with without_stages(args) as staged:
        base, stages = staged.args, staged.stages
        root = _root(base)
        resume = _flag(base, "--ckpt_path") == "last"
        flags = _without_flag(_without_flag(base, "--ckpt_path"), "--trainer.default_root_dir")
        previous: str | None = None
        for k, stage in enumerate(stages):
            stage_root = root / stage.name
            done = stage_root / DONE_FILE
            if resume and done.is_file():
                previous = json.loads(done.read_text())["final"]
                print(f"stage {k + 1}/{len(stages)} ({stage.name}): done before, its weights in {previous}")
                continue
            after = config_paths(flags)[-1] + 1  # the stage after the configs, before the flags
            command = [*flags[:after], "--config", str(staged.stage_file(k)), *flags[after:]]
            command += ["--trainer.default_root_dir", str(stage_root)]
            if previous is not None:
                command += ["--model.model", previous]
            if resume and (stage_root / "checkpoints" / "last.ckpt").is_file():
                command += ["--ckpt_path", "last"]
            print(f"stage {k + 1}/{len(stages)} ({stage.name}) in {stage_root}")
            cli = fit(command)
            trainer = cli.trainer
            stopped_early = 0 < trainer.max_steps and trainer.global_step < trainer.max_steps
            if stopped_early and not ended_at_goal(trainer):
                again = " ".join(["forge-lightning", *args, "--ckpt_path", "last"])
                raise SystemExit(
                    f"stage {stage.name} stopped at step {trainer.global_step} of {trainer.max_steps} "
                    f"(max_time, or a signal): go on with {again}"
                )
            previous = str(final_weights(trainer))
            done.parent.mkdir(parents=True, exist_ok=True)
            record = {"stage": stage.name, "steps": trainer.global_step, "final": previous}
            done.write_text(json.dumps(record | {"at_goal": ended_at_goal(trainer)}) + "\n")


def final_weights(trainer: Any) -> Path:
    """Where the HF checkpoint callback saved the fit's final weights."""
    for callback in trainer.callbacks:
        if isinstance(callback, HFCheckpoint) and callback.save_final:
            return output_dir(trainer, callback.output_dir) / "final"
    raise SystemExit(
        "fit: a stage's final weights are the next stage's start: keep hf_checkpoint's save_final"
    )
