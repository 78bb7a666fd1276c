"""Time to accuracy against TRL: each side trains for the same wall-clock budget on the same
threads, then every checkpoint of both is scored by the same greedy evaluator.

    python -m forge_lightning.bench.time_to_accuracy --trl-python <venv>/bin/python --seed 42 \
        --budget-s 1800 --threads 2 [--checkpoint-every-s 300] [--eval-problems 200] [--eval-jobs 2] \
        [--out notebooks/figures/time_to_accuracy.json] [--work runs/tta] \
        [--config configs/arithmetic_cpu.yaml] [--model embedded]

TRL runs in a virtual environment of its own, as for bench/versus_trl.py (``python3 -m venv V &&
V/bin/pip install torch==2.13.0 trl==1.16.0``), named by ``--trl-python``. The task is the
config's (the arithmetic task, its group, prompts a step, new tokens, temperature, learning rate,
KL weight and system prompt): this driver reads those from it and hands them to TRL's script
(bench/trl_time_reference.py) with the config's train part written as chat messages, in
``<work>/seed-<S>/prompts.jsonl``; our side is ``forge-lightning fit --config`` on the same
config. TRL's side runs first, then ours (``--first ours`` turns the order round), back to back,
each a process with ``OMP_NUM_THREADS=--threads``; each saves the model every
``--checkpoint-every-s`` of training (the clock starts at its first step) and at ``--budget-s``,
where it stops (bench/wall_clock_checkpoints.py for ours); the clock stops while a checkpoint is written. Then
``forge-lightning validate`` scores the untrained model (the point at 0 s of both sides) and every
checkpoint greedily on the first ``--eval-problems`` held-out problems (``--eval-jobs`` processes
at once, one thread each), and the record for ``--seed`` (time_to_accuracy_summary.py, with every
command) replaces that seed's in ``--out``, a JSON list. Each process's output goes to a ``.log``
file beside its folder.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from forge_lightning.bench.time_to_accuracy_summary import summarize
from forge_lightning.bench.wall_clock_checkpoints import WallClockCheckpoints, read_checkpoints
from forge_lightning.data.arithmetic import generate
from forge_lightning.models.loading import EMBEDDED, embedded_folder

TRL_SCRIPT = Path(__file__).with_name("trl_time_reference.py")
CLI = [sys.executable, "-m", "forge_lightning"]
# (config group, key, TRL script flag or None): the task settings both sides share, read from the config.
SHARED = (
    ("model", "group_size", "--group"),
    ("model", "max_new_tokens", "--max-new-tokens"),
    ("model", "temperature", "--temperature"),
    ("model", "learning_rate", "--learning-rate"),
    ("model", "kl_beta", "--kl-beta"),
    ("model", "lr_schedule", None),
    ("model", "system_prompt", None),
    ("data", "prompts_per_step", "--prompts-per-step"),
    ("data", "task_variant", None),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.bench.time_to_accuracy",
        description="Train TRL and us for the same wall-clock budget; record accuracy over time.",
    )
    add = parser.add_argument
    add("--trl-python", required=True, help="the python of a venv with trl==1.16.0 and torch==2.13.0")
    add("--seed", type=int, default=42, help="seed of both sides (our data.seed and seed_everything)")
    add("--budget-s", type=float, default=1800.0, help="training seconds per side")
    add("--threads", type=int, default=2)
    add("--checkpoint-every-s", type=float, default=300.0)
    add("--eval-problems", type=int, default=200, help="held-out problems each checkpoint is scored on")
    add("--eval-jobs", type=int, default=None, help="validates at once, one thread each; default --threads")
    add("--out", default="notebooks/figures/time_to_accuracy.json")
    add("--work", default="runs/tta", help="folder for the checkpoints, logs and answers")
    add("--config", default="configs/arithmetic_cpu.yaml")
    add("--model", default=EMBEDDED, help="embedded, or a model folder")
    add(
        "--first",
        choices=("trl", "ours"),
        default="trl",
        help="the side trained first (two seeds at once, one thread each: one's TRL beside the other's ours)",
    )
    args = parser.parse_args(argv)
    if not Path(args.trl_python).is_file():
        parser.error(f"--trl-python {args.trl_python}: no such file (make the venv as the docstring says)")
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    args.eval_jobs = args.eval_jobs or args.threads
    for name in ("budget_s", "checkpoint_every_s", "threads", "eval_problems", "eval_jobs"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def shared_settings(config: str) -> dict[str, Any]:
    """The task settings of ``SHARED`` from the config, plus its train-part size and task seed."""
    loaded = yaml.safe_load(Path(config).read_text())
    settings: dict[str, Any] = {}
    for group, key, _ in SHARED:
        if key not in (loaded.get(group) or {}):
            raise SystemExit(
                f"time_to_accuracy: {config} sets no {group}.{key}; both sides need it set there"
            )
        settings[key] = loaded[group][key]
    if settings["lr_schedule"] != "constant" or loaded["data"].get("source") != "arithmetic":
        raise SystemExit(f"time_to_accuracy: {config} must train on source arithmetic at a constant lr")
    settings["max_samples"] = loaded["data"].get("max_samples")
    settings["task_seed"] = loaded["data"].get("task_seed", 0)
    return settings


def write_prompts(settings: dict[str, Any], path: Path) -> int:
    """The train part the datamodule draws, one ``{"prompt": [system, user], "reference"}`` a line."""
    problems = generate(seed=settings["task_seed"], variant=settings["task_variant"])["train"]
    samples = [p.sample() for p in problems][: settings["max_samples"]]
    system = {"role": "system", "content": settings["system_prompt"]}
    with path.open("w") as f:
        for sample in samples:
            messages = [system, {"role": "user", "content": sample["prompt"]}]
            f.write(json.dumps({"prompt": messages, "reference": sample["reference"]}) + "\n")
    return len(samples)


def commands(
    args: argparse.Namespace, settings: dict[str, Any], model: str, work: Path
) -> dict[str, list[str]]:
    """Each side's training command line, at the same settings and budget."""
    clock = ["--budget-s", str(args.budget_s), "--checkpoint-every-s", str(args.checkpoint_every_s)]
    task = [item for _, key, flag in SHARED if flag for item in (flag, str(settings[key]))]
    trl = [
        *(args.trl_python, str(TRL_SCRIPT), "--model", model, "--prompts", str(work / "prompts.jsonl")),
        *("--out", str(work / "trl"), *clock, "--threads", str(args.threads), "--seed", str(args.seed)),
        *task,
    ]
    clock_args = {"every_s": args.checkpoint_every_s, "budget_s": args.budget_s}
    callback = {
        "class_path": f"{WallClockCheckpoints.__module__}.{WallClockCheckpoints.__name__}",
        "init_args": {"output_dir": str(work / "ours"), **clock_args},
    }
    ours = [
        *(*CLI, "fit", "--config", args.config, "--seed_everything", str(args.seed)),
        *("--data.seed", str(args.seed), "--model.model", model),
        *("--trainer.default_root_dir", str(work / "ours"), "--trainer.limit_val_batches", "0"),
        # The callback stops the fit at the budget; no step count or Lightning timer comes first.
        *("--trainer.max_steps", str(10**9), "--trainer.max_time", "null"),
        *("--trainer.enable_checkpointing", "false", "--checkpoint", "null", "--hf_checkpoint", "null"),
        f"--trainer.callbacks+={json.dumps(callback)}",
    ]
    return {"trl": trl, "ours": ours}


def evaluate_command(args: argparse.Namespace, model: str, root: Path) -> list[str]:
    """Our greedy validation of ``model`` on the first ``--eval-problems`` held-out problems."""
    return [
        *(*CLI, "validate", "--config", args.config, "--model.model", model),
        *("--data.val_part", "heldout", "--data.val_max_samples", str(args.eval_problems)),
        *("--data.seed", str(args.seed), "--trainer.default_root_dir", str(root)),
        *("--trainer.enable_checkpointing", "false", "--checkpoint", "null", "--hf_checkpoint", "null"),
    ]


def run(command: list[str], threads: int, log: Path) -> None:
    """Run one process at ``threads`` threads, its output to ``log``; exit with a line if it fails."""
    print(f"time_to_accuracy: {shlex.join(command)} (log: {log})", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        raise SystemExit(f"time_to_accuracy: exit status {done.returncode} from the process logged in {log}")


def evaluate(args: argparse.Namespace, model: str, root: Path) -> float:
    """Accuracy of ``model``: the share of ``correct`` answers in the validate's answers file."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run(evaluate_command(args, model, root), 1, root.with_suffix(".log"))
    answers = sorted((root / "validation").glob("validate-*.jsonl"))
    if not answers:
        raise SystemExit(f"time_to_accuracy: the validate of {model} wrote no answers file under {root}")
    rows = [json.loads(line) for line in answers[-1].read_text().splitlines() if line.strip()]
    return sum(bool(row["correct"]) for row in rows) / len(rows)


def side_points(args: argparse.Namespace, work: Path, model: str) -> dict[str, list[tuple[float, float]]]:
    """Each side's ``(elapsed_s, accuracy)``: the untrained model at 0 s, then its checkpoints.
    The validates run ``--eval-jobs`` at a time (they are not timed)."""
    checkpoints = {side: read_checkpoints(work / side) for side in ("trl", "ours")}
    jobs = {("base", "base"): (model, work / "base-eval")}
    for side, lines in checkpoints.items():
        jobs |= {
            (side, str(line["name"])): (str(line["folder"]), work / side / "eval" / str(line["name"]))
            for line in lines
        }
    with ThreadPoolExecutor(max_workers=args.eval_jobs) as pool:
        futures = {key: pool.submit(evaluate, args, folder, root) for key, (folder, root) in jobs.items()}
        accuracy = {key: future.result() for key, future in futures.items()}
    base = accuracy["base", "base"]
    return {
        side: [(0.0, base)]
        + [(float(line["elapsed_s"]), accuracy[side, str(line["name"])]) for line in lines]
        for side, lines in checkpoints.items()
    }


def write_record(path: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Put ``record`` in the JSON list at ``path``, replacing the record of the same seed. The file
    is locked from reading to writing, so seeds run at once (one thread each) keep each other's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        records = json.loads(text) if text.strip() else []
        records = [r for r in records if r["seed"] != record["seed"]] + [record]
        records.sort(key=lambda r: r["seed"])
        f.seek(0)
        f.truncate()
        f.write(json.dumps(records, indent=2) + "\n")
    return records


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = shared_settings(args.config)
    model = str(embedded_folder()) if args.model == EMBEDDED else args.model
    work = Path(args.work) / f"seed-{args.seed}"
    for side in ("trl", "ours"):
        shutil.rmtree(work / side, ignore_errors=True)  # a rerun's checkpoint logs start empty
        (work / side).mkdir(parents=True)
    prompts = write_prompts(settings, work / "prompts.jsonl")
    sides = commands(args, settings, model, work)
    order = ("trl", "ours") if args.first == "trl" else ("ours", "trl")
    for name in order:  # back to back
        run(sides[name], args.threads, work / f"{name}.log")
    points = side_points(args, work, model)
    record = {
        "seed": args.seed,
        "threads": args.threads,
        "budget_s": args.budget_s,
        "first": args.first,
        **summarize(points["ours"], points["trl"]),
        "base_accuracy": points["ours"][0][1],
        "ours_points": points["ours"],
        "trl_points": points["trl"],
        "checkpoint_every_s": args.checkpoint_every_s,
        "eval_problems": args.eval_problems,
        "train_prompts": prompts,
        "settings": settings,
        "date": datetime.date.today().isoformat(),
        "commands": {
            "driver": "python -m forge_lightning.bench.time_to_accuracy " + shlex.join(argv or sys.argv[1:]),
            **{name: shlex.join(command) for name, command in sides.items()},
            "evaluate": shlex.join(
                evaluate_command(args, "<checkpoint folder>", work / "<side>/eval/<name>")
            ),
        },
    }
    write_record(Path(args.out), record)
    print(json.dumps({key: record[key] for key in ("seed", "ours_final", "trl_final", "ratio")}), flush=True)
    return record


if __name__ == "__main__":
    main()
