"""``forge-lightning check-resume --config X [overrides]``: does a resume after a crash continue the
run exactly? The config's own run, shortened to a few steps in a temporary folder, runs once
straight; then once per hard moment it is SIGKILLed there (callbacks/kill_point.py), resumed with
``--ckpt_path last`` to the end, and every logged value and every weight saved is compared with
the straight run's (run/run_diff.py). Prints ``PASS``, or ``FAIL:`` and the first difference
(exit status 1; 2 when the check could not be made).

The moments come after the first checkpoint, at step k (1, or with a generation split into steps
the optimizer steps a batch takes): inside step k + 1, after a backward (with gradient
accumulation, in the step's last batch: the earlier batches' gradients held, no optimizer step
yet); while the next checkpoint's ``last.ckpt`` is written; and for asynchronous rollouts as the
batch of step k + 1 ends, with batches handed to the rollout servers and not trained yet.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from forge_lightning.callbacks.kill_point import KILL_POINT_ENV, KillPointSpec
from forge_lightning.callbacks.reward_logger import JSONL_KEYS
from forge_lightning.run.run_diff import first_difference

PROG = "forge-lightning check-resume"
# The logged values that are wall-clock seconds, different in every run.
TIMINGS = tuple(key for key in JSONL_KEYS if key.endswith("_s"))
# Each group check-resume sets, and the class that, listed in trainer.callbacks instead, takes
# the group's place (the group's flags would then configure a second copy).
GROUPS = {"checkpoint": "ModelCheckpoint", "reward_logger": "RewardLogger"}
# The groups' own output folders, which would otherwise take every run's files to one place.
OUTPUT_FOLDERS = {"checkpoint": "dirpath", "reward_logger": "output_dir", "hf_checkpoint": "output_dir"}
SIGKILL_EXIT = -9


@dataclass(frozen=True)
class KillRun:
    """One crash to recover from: its folder's name, the moment, what the progress line says."""

    name: str
    point: KillPointSpec
    moment: str


class CheckError(Exception):
    """The config cannot be checked as given, or a run failed: the message says which and why."""


def main(argv: list[str], build_cli: Callable[[list[str]], Any]) -> None:
    """Parse ``argv`` (what follows ``check-resume``), run the check, exit 0 on PASS, 1 on FAIL
    and 2 when the check itself could not be made; ``build_cli``: the CLI's (forge_cli.py), which
    resolves the config as a fit would."""
    parser = arguments()
    args, fit_args = parser.parse_known_args(argv)
    if not any(a in ("-c", "--config") or a.startswith("--config=") for a in fit_args):
        parser.error("--config is required: the config whose resume is checked")
    if any(a == "--ckpt_path" or a.startswith("--ckpt_path=") for a in fit_args):
        parser.error("--ckpt_path: each run starts fresh; check-resume adds --ckpt_path last to its resumes")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="forge-check-resume-"))
    try:
        config = resolved_config(fit_args, build_cli)
        difference = check_resume(config, fit_args, workdir, args.steps, args.rtol)
    except CheckError as err:
        ran = any(workdir.iterdir()) if workdir.is_dir() else False
        if not ran and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"{PROG}: {err}" + (f"\n(the runs are in {workdir})" if ran else ""), file=sys.stderr)
        raise SystemExit(2) from None
    if difference is None:
        print("PASS")
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    print(f"FAIL: {difference}\n(the runs are in {workdir})")
    raise SystemExit(1)


def arguments() -> argparse.ArgumentParser:
    """check-resume's own options; every other argument is the fit's."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description=(
            "Run the config (shortened to a few steps, in a temporary folder) straight, then SIGKILL "
            "it at its hard moments (inside a step, while a checkpoint is written, with async rollouts "
            "in flight), resume each with --ckpt_path last, and compare every logged value and every "
            "weight with the straight run: PASS, or FAIL and the first difference (exit status 1)."
        ),
        epilog="Every other argument goes to each `fit` as it is (--config files, --model.* ...).",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each run (default: 4)")
    parser.add_argument(
        "--rtol", type=float, default=1e-6, help="relative tolerance of logged values (weights: exact)"
    )
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder, kept on FAIL)")
    return parser


def check_resume(
    config: dict[str, Any], fit_args: list[str], workdir: Path, steps: int, rtol: float
) -> str | None:
    """Run ``fit_args`` (resolved: ``config``) straight and killed at each moment, in ``workdir``;
    the first difference, None if none."""
    workdir.mkdir(parents=True, exist_ok=True)
    k = steps_per_batch(config["model"])
    if (config["trainer"].get("max_steps") or -1) > 0:
        steps = min(steps, config["trainer"]["max_steps"])  # shortened, never longer
    steps = k * max(2, -(-steps // k))  # whole batches, and a step after the first checkpoint
    fit_args = [*fit_args, *shortened(config, steps, k)]
    print(f"{PROG}: {steps} optimizer steps a run, checkpoints every {k}, in {workdir}", flush=True)
    fit(fit_args, workdir / "straight", "straight")
    for run in kill_runs(config["model"], k):
        folder = workdir / f"kill_{run.name}"
        fit(fit_args, folder, f"kill_{run.name}: killed {run.moment}", kill=run.point)
        fit([*fit_args, "--ckpt_path", "last"], folder, f"kill_{run.name}: resumed")
        difference = first_difference(workdir / "straight", folder, rtol, TIMINGS)
        if difference is not None:
            return f"kill_{run.name}, {difference}\n(kill_{run.name} was killed {run.moment})"
    return None


def resolved_config(fit_args: list[str], build_cli: Callable[[list[str]], Any]) -> dict[str, Any]:
    """The fit's config as the CLI resolves it (``--print_config``), without running it."""
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            build_cli(["fit", *fit_args, "--print_config"])
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise CheckError(f"the config does not parse: {errors.getvalue().strip()}") from None
    return yaml.safe_load(printed.getvalue())


def steps_per_batch(model: dict[str, Any]) -> int:
    """Optimizer steps one batch takes when its generation is split into steps (checkpoints fall between
    batches); 1 otherwise (accumulation keeps one step a checkpoint apart)."""
    generation = int(model.get("steps_per_generation") or 1)
    return generation * int(model.get("num_iterations") or 1) if generation > 1 else 1


def shortened(config: dict[str, Any], steps: int, every: int) -> list[str]:
    """The flags that make the config's run checkable: ``steps`` steps, a resumable checkpoint
    every ``every`` steps, a log record every step, no logger, and everything it writes under the
    run's folder (each run adds its own ``default_root_dir``). CheckError for what it cannot be."""
    trainer = config["trainer"]
    if trainer.get("enable_checkpointing") is False or config.get("checkpoint") is None:
        raise CheckError("this config keeps no Lightning checkpoint (checkpoint: null): no run of it resumes")
    listed = trainer.get("callbacks") or []
    for group, kind in GROUPS.items():
        if any(str(c.get("class_path", "")).endswith(f".{kind}") for c in listed if isinstance(c, dict)):
            raise CheckError(
                f"trainer.callbacks lists a {kind}: give its settings in the {group} group instead, "
                f"so that check-resume can set them (--{group}.*)"
            )
    flags = [f"--trainer.max_steps={steps}", "--trainer.logger=false"]
    flags += [f"--checkpoint.every_n_train_steps={every}", "--checkpoint.save_last=true"]
    if config.get("reward_logger") is None:  # the log compared, back on
        flags.append("--reward_logger=forge_lightning.callbacks.RewardLogger")
    flags.append("--reward_logger.logging_steps=1")
    for group, setting in OUTPUT_FOLDERS.items():
        if ((config.get(group) or {}).get("init_args") or {}).get(setting) is not None:
            flags.append(f"--{group}.{setting}=null")  # into the run's own folder
    return [*flags, "--trainer.callbacks+=forge_lightning.callbacks.KillPoint"]


def kill_runs(model: dict[str, Any], k: int) -> list[KillRun]:
    """The crashes to check for this config, each after the first checkpoint (step ``k``) and
    before the next one is in place."""
    # A step's batches: accumulated ones, or with k > 1 one batch for k steps.
    batches = int(model.get("gradient_accumulation_steps") or 1) if k == 1 else 1
    step = k + 1
    inside = f"inside step {step}, after a backward in its batch {batches} of {batches}"
    written = f"while step {2 * k}'s last.ckpt is written"  # the second checkpoint
    runs = [
        KillRun("inside_step", KillPointSpec("backward", step, str(batches)), inside),
        KillRun("checkpoint_write", KillPointSpec("write", 2 * k, "last.ckpt"), written),
    ]
    if model.get("rollout_mode") == "async":
        in_flight = f"with rollouts in flight, as step {step}'s last batch ends"
        runs.append(KillRun("rollouts_in_flight", KillPointSpec("batch_end", step), in_flight))
    return runs


def fit(fit_args: list[str], folder: Path, label: str, kill: KillPointSpec | None = None) -> None:
    """Run ``forge-lightning fit`` in ``folder`` (its output in ``<folder>.log``); CheckError unless
    it ends as it should: killed (SIGKILL) when ``kill`` is given, else exit status 0."""
    print(f"{PROG}: {label} ...", end="", flush=True)
    env = {key: value for key, value in os.environ.items() if key != KILL_POINT_ENV}
    if kill is not None:
        env[KILL_POINT_ENV] = str(kill)
    command = [sys.executable, "-m", "forge_lightning", "fit", *fit_args]
    command.append(f"--trainer.default_root_dir={folder}")  # last: it wins over any the user gave
    log = folder.with_name(f"{folder.name}.log")
    started = time.monotonic()
    with open(log, "a") as out:
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    print(f" {time.monotonic() - started:.0f}s", flush=True)
    if kill is not None and code == 0:
        raise CheckError(f"{label}: the run ended without reaching its kill point ({kill}); see {log}")
    if code != (SIGKILL_EXIT if kill is not None else 0):
        raise CheckError(f"{label}: fit exited with status {code}; the end of {log}:\n{_tail(log)}")


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
