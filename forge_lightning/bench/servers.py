"""``python -m forge_lightning.bench.servers``: trained tokens per second of one trainer plus one
rollout server in async mode, against the synchronous in-process step, on a run config's settings,
both sides interleaved in rounds. Run it from the repository root::

    python -m forge_lightning.bench.servers [--config configs/arithmetic_cpu.yaml] [--rounds 3] \
        [--steps 4] [--threads 2] [--trainer-threads 1] [--server-threads 1] \
        [--out notebooks/figures/bench/servers_cpu.jsonl]

The config gives what a step costs: the model and the settings of its ``model`` section that
throughput.py's ``SETTING_FLAGS`` names (each the module's default where the config leaves it
out), its seed, and the prompts of its ``data`` section at its ``prompts_per_step`` (the arithmetic
task's train problems, written once as GSM8K files, or a local GSM8K folder). Its other settings
(the learning rate, the reward, validation) do not change what a step costs and are left to the
bench's defaults. Each round runs two processes of the throughput bench (``python -m
forge_lightning.bench``, throughput.py) one after the other:

- ``sync``: the in-process synchronous step on ``--threads`` threads;
- ``servers``: ``--rollout-mode async --rollout-servers local:1``: the trainer on
  ``--trainer-threads``, the server it starts on ``--server-threads`` (the bench's ``--worker-threads``).

The side that goes first alternates from round to round, so neither always meets the machine
first. Each process warms up with one step (the servers' side also fills its pipeline) and times
``--steps``. A round's ratio is the servers' trained completion tokens per second over sync's;
the summary line has each round's ratio and their median (``vs_sync``). Every line (each side's
JSON line, with ``side`` and ``round``, then the summary, with ``label``, ``date`` and ``command``)
is printed as it comes and appended to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from forge_lightning.bench.throughput import SETTING_FLAGS
from forge_lightning.data.arithmetic import DEFAULT_VARIANT, write_task
from forge_lightning.data.datamodule import PromptDataModule
from forge_lightning.models.loading import EMBEDDED
from forge_lightning.settings.signature import setting_defaults

DEFAULT_CONFIG = "configs/arithmetic_cpu.yaml"
DEFAULT_OUT = "notebooks/figures/bench/servers_cpu.jsonl"
SIDES = ("sync", "servers")


@dataclass(frozen=True)
class Step:
    """What a run's config says a training step is, as the throughput bench's flags."""

    flags: dict[str, Any]  # flag -> value: SETTING_FLAGS', --prompts-per-step and --seed
    data: dict[str, Any]  # the config's data section: where the prompts come from

    def arguments(self) -> list[str]:
        """The flags as a command line's arguments (a setting left unset, None, is left out)."""
        return [
            part for flag, value in self.flags.items() if value is not None for part in (flag, str(value))
        ]

    def settings(self) -> dict[str, Any]:
        """The flags as the summary line's settings (``--prompts-per-step``: ``prompts_per_step``)."""
        return {flag.removeprefix("--").replace("-", "_"): value for flag, value in self.flags.items()}


def section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A config's section, given flat or under ``init_args``."""
    found = config.get(name) or {}
    return found.get("init_args", found)


def step_of(config: dict[str, Any]) -> Step:
    """The step a loaded run config trains; a setting it leaves out is the module's (or the data
    module's) default."""
    given = {**setting_defaults(), "model": EMBEDDED, **section(config, "model")}
    flags = {flag: given[name] for name, flag in SETTING_FLAGS.items()}
    data = section(config, "data")
    per_step = inspect.signature(PromptDataModule).parameters["prompts_per_step"].default
    flags["--prompts-per-step"] = data.get("prompts_per_step", per_step)
    flags["--seed"] = config.get("seed_everything", 0)
    return Step(flags, data)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.bench.servers",
        description="Time async steps on one rollout server against sync in-process steps, interleaved.",
    )
    add = parser.add_argument
    add("--config", default=DEFAULT_CONFIG, help="the run config whose step is timed")
    add("--rounds", type=int, default=3, help="rounds of the two sides")
    add("--steps", type=int, default=4, help="timed steps per process, after its warm-up")
    add("--threads", type=int, default=2, help="sync: the in-process step's threads")
    add("--trainer-threads", type=int, default=1, help="servers: the trainer's threads")
    add("--server-threads", type=int, default=1, help="servers: each started server's threads")
    add("--rollout-servers", dest="servers", nargs="+", default=["local:1"], help="servers: their entries")
    add("--max-staleness", dest="lag", type=int, default=1, help="servers: optimizer steps a rollout may lag")
    add("--label", default=None, help="the summary's label (default: servers-<entries>)")
    add("--out", default=DEFAULT_OUT, help="the JSON-lines file every line is appended to")
    args = parser.parse_args(argv)
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file (run from the repository root, or give a path)")
    for name in ("rounds", "steps", "threads", "trainer_threads", "server_threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lag < 0:
        parser.error(f"--max-staleness must be >= 0, got {args.lag}")
    args.label = args.label or "servers-" + "+".join(args.servers)
    return args


def prompts_folder(step: Step, tmp: Path) -> str:
    """A GSM8K folder of the config's train prompts: the arithmetic task's train part, written
    under ``tmp`` as data/arithmetic.py writes it, or the config's own local folder."""
    source = step.data.get("source", "hub")
    if source == "arithmetic":
        variant = step.data.get("task_variant", DEFAULT_VARIANT)
        write_task(tmp / "arithmetic", seed=step.data.get("task_seed", 0), variant=variant)
        return str(tmp / "arithmetic")
    if source == "local" and step.data.get("path"):
        return str(step.data["path"])
    raise SystemExit(
        f"bench.servers: the config's data source {source!r} is not one it reads: give a config "
        "with data.source arithmetic, or local with data.path"
    )


def commands(args: argparse.Namespace, step: Step, data: str) -> dict[str, list[str]]:
    """Each side's command line: the same step, sync in process or async on the servers."""
    bench = [sys.executable, "-m", "forge_lightning.bench", "--data", data, *step.arguments()]
    shared = [*bench, "--steps", str(args.steps), "--no-references"]
    sync = [*shared, "--threads", str(args.threads)]
    servers = [
        *(*shared, "--threads", str(args.trainer_threads), "--rollout-mode", "async"),
        *("--max-staleness", str(args.lag), "--worker-threads", str(args.server_threads)),
        *("--rollout-servers", *args.servers),
    ]
    return {"sync": sync, "servers": servers}


def order(round_: int) -> tuple[str, str]:
    """The sides in the order ``round_`` runs them: sync first in even rounds."""
    return SIDES if round_ % 2 == 0 else SIDES[::-1]


def run_side(side: str, command: list[str], round_: int) -> dict[str, Any]:
    """Run one side's bench process (its torch threads as OMP_NUM_THREADS); its JSON line, with
    the side and the round."""
    env = {**os.environ, "OMP_NUM_THREADS": command[command.index("--threads") + 1]}
    shown = " ".join(part if " " not in part and "\n" not in part else repr(part) for part in command)
    print(f"round {round_}: {side}: {shown}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env)
    if done.returncode:
        raise SystemExit(
            f"bench.servers: {side} failed with exit status {done.returncode} (its log is above)"
        )
    line = json.loads(done.stdout.strip().splitlines()[-1])
    return {**line, "side": side, "round": round_}


def round_ratios(lines: Sequence[dict[str, Any]]) -> list[float]:
    """Each round's servers over sync trained completion tokens per second, in round order; a
    round missing a side has no ratio."""
    rounds: dict[int, dict[str, float]] = {}
    for line in lines:
        rounds.setdefault(line["round"], {})[line["side"]] = line["completion_tokens_per_s"]
    return [
        sides["servers"] / sides["sync"]
        for _, sides in sorted(rounds.items())
        if {"sync", "servers"} <= sides.keys()
    ]


def summary(
    args: argparse.Namespace, step: Step, lines: Sequence[dict[str, Any]], argv: list[str]
) -> dict[str, Any]:
    """The summary line: the median of the rounds' ratios, each round's, and the settings."""
    ratios = round_ratios(lines)
    settings = step.settings() | {
        "config": args.config,
        "steps": args.steps,
        "rounds": args.rounds,
        "sync_threads": args.threads,
        "trainer_threads": args.trainer_threads,
        "server_threads": args.server_threads,
        "servers": args.servers,
        "lag": args.lag,
    }
    return {
        "label": args.label,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m forge_lightning.bench.servers", *argv]),
        "vs_sync": statistics.median(ratios),
        "vs_sync_rounds": ratios,
        "settings": settings,
    }


def emit(line: dict[str, Any], out: Path) -> None:
    """Print ``line`` and append it to ``out``."""
    text = json.dumps(line)
    print(text, flush=True)
    with out.open("a", encoding="utf-8") as f:
        f.write(text + "\n")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    step = step_of(yaml.safe_load(Path(args.config).read_text()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-servers-") as tmp:
        sides = commands(args, step, prompts_folder(step, Path(tmp)))
        for round_ in range(args.rounds):
            for side in order(round_):
                line = run_side(side, sides[side], round_)
                emit(line, out)
                lines.append(line)
    result = summary(args, step, lines, argv)
    emit(result, out)
    return result


if __name__ == "__main__":
    main()
