"""Our step against TRL's GRPOTrainer step, side by side in interleaved rounds.

    python -m forge_lightning.bench.versus_trl --trl-python <venv>/bin/python \
        --data ../shared/data/gsm8k [--prompts-per-step 1] [--group 8] [--max-new-tokens 64] \
        [--steps 3] [--rounds 2] [--threads 2]

TRL is not a dependency of this package: its side runs in a virtual environment of its own, made
once with ``python3 -m venv V && V/bin/pip install torch==2.13.0 trl==1.16.0`` and named by
``--trl-python``. This driver writes what both sides read (the model as a folder: ``embedded``
is converted once; the first GSM8K train prompts as chat messages, which each side puts through
the same chat template), then, ``--rounds`` times, runs TRL's step (bench/trl_reference.py, a
script that imports nothing of this package) and ours (``python -m forge_lightning.bench
--fixed-length --no-references``) one after the other at the same settings, so that each round's
two lines share the machine's load. Each process warms up with one step and times ``--steps``.
``--rollout-precision bf16`` (or ``int8``) has our side sample with a low-precision copy of the
policy, corrected by TIS (the bench's flag of that name); TRL's side samples with the policy.

``--tool`` times a tool-using step instead: both sides get the function tool ``multiply``
(trl_reference.py) and the system prompt that asks for it, TRL through its tool loop, ours through
``--tools``; completions end where the model ends them. TRL parses calls only for chat templates it
knows, so both sides read a copy of the model folder whose tokenizer carries TRL's own ``qwen2_5``
template (ChatML turns, which SmolLM2's tokenizer has, and Hermes ``<tool_call>`` calls, our
default call format).

Every line goes to stdout as it comes (each side's own JSON line, with ``round``), then one
summary line: ``vs_trl``, ours over TRL's completion tokens/s, each round's and their median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from forge_lightning.bench.throughput import ROLLOUT_PRECISIONS
from forge_lightning.bench.trl_reference import TOOL_SYSTEM_PROMPT, multiply
from forge_lightning.data.gsm8k import load_gsm8k
from forge_lightning.models.loading import EMBEDDED, embedded_folder

TRL_SCRIPT = Path(__file__).with_name("trl_reference.py")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.bench.versus_trl",
        description="Time our GRPO step and TRL's, interleaved; print JSON lines.",
    )
    add = parser.add_argument
    add("--trl-python", required=True, help="the python of a venv with trl==1.16.0 and torch==2.13.0")
    add("--data", required=True, help="GSM8K folder (with train.jsonl) or file")
    add("--model", default=EMBEDDED, help="embedded, or a model folder")
    add("--prompts-per-step", type=int, default=1)
    add("--group", type=int, default=8)
    add("--max-new-tokens", type=int, default=64)
    add("--steps", type=int, default=3, help="timed steps per process, after one warm-up step")
    add("--rounds", type=int, default=2)
    add("--threads", type=int, default=2)
    add("--tool", action="store_true", help="a tool-using step: the multiply tool on both sides")
    add("--max-tool-calls", type=int, default=4)
    add(
        "--rollout-precision",
        choices=ROLLOUT_PRECISIONS,
        default=None,
        help="our side samples with a low-precision copy of the policy, corrected by TIS",
    )
    add("--label", default="versus-trl")
    args = parser.parse_args(argv)
    if not Path(args.trl_python).is_file():
        parser.error(f"--trl-python {args.trl_python}: no such file (make the venv as the docstring says)")
    if not Path(args.data).exists():
        parser.error(f"--data {args.data}: no such file or folder")
    for name in ("prompts_per_step", "max_new_tokens", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.group < 2:
        parser.error("--group must be >= 2")
    return args


def commands(args: argparse.Namespace, model: str, prompts: Path) -> dict[str, list[str]]:
    """Each side's command line, at the same settings."""
    shared = [
        *("--prompts-per-step", str(args.prompts_per_step), "--group", str(args.group)),
        *("--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps)),
        *("--threads", str(args.threads)),
    ]
    trl = [args.trl_python, str(TRL_SCRIPT), "--model", model, "--prompts", str(prompts), *shared]
    ours = [sys.executable, "-m", "forge_lightning.bench", "--data", args.data, "--model", model, *shared]
    if args.rollout_precision:
        ours += ["--rollout-precision", args.rollout_precision]
    if args.tool:
        calls = ["--max-tool-calls", str(args.max_tool_calls)]
        trl += ["--tool", *calls]
        tool = f"{multiply.__module__}.{multiply.__name__}"
        ours += ["--tools", tool, "--system-prompt", TOOL_SYSTEM_PROMPT, "--no-references", *calls]
    else:
        ours += ["--fixed-length", "--no-references"]
    return {"trl": trl, "forge_lightning": ours}


def with_trl_template(trl_python: str, model: str, folder: Path) -> str:
    """A copy of ``model`` (its files linked) whose tokenizer carries TRL's ``qwen2_5`` chat
    template, read from TRL's own package: the template TRL parses tool calls of."""
    found = subprocess.run(
        [trl_python, "-c", "import pathlib, trl; print(pathlib.Path(trl.__file__).parent)"],
        stdout=subprocess.PIPE, text=True, check=True,
    )  # fmt: skip
    template = (Path(found.stdout.strip()) / "chat_templates" / "qwen2_5.jinja").read_text()
    folder.mkdir()
    for item in Path(model).iterdir():
        if not item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / item.name).symlink_to(item.resolve())
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return str(folder)


def write_prompts(data: str, count: int, path: Path) -> None:
    """The first ``count`` GSM8K train prompts, one ``{"prompt": [user message]}`` a line: the
    prompts our benchmark trains on, as chat messages."""
    rows = load_gsm8k(split="train", max_samples=count, path=data)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}]}) + "\n")


def run_side(name: str, command: list[str], round_: int) -> dict[str, Any]:
    """Run one side's process; its JSON line, with the round and the side's name."""
    env = {**os.environ, "OMP_NUM_THREADS": command[command.index("--threads") + 1]}
    print(f"round {round_}: {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"versus_trl: {name} failed with exit status {done.returncode} (its log is above)")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    return {**line, "side": name, "round": round_}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = str(embedded_folder()) if args.model == EMBEDDED else args.model
    lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="versus-trl-") as tmp:
        if args.tool:
            model = with_trl_template(args.trl_python, model, Path(tmp) / "model")
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(args.data, args.prompts_per_step * (args.steps + 1), prompts)
        sides = commands(args, model, prompts)
        for round_ in range(args.rounds):
            for name, command in sides.items():
                line = run_side(name, command, round_)
                print(json.dumps(line), flush=True)
                lines.append(line)
    ratios = [
        ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"]
        for trl, ours in zip(lines[::2], lines[1::2])
    ]
    summary = {
        "label": args.label,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m forge_lightning.bench.versus_trl", *(argv or sys.argv[1:])]),
        "vs_trl": statistics.median(ratios),
        "vs_trl_rounds": ratios,
        "settings": {
            key: getattr(args, key)
            for key in (
                *("prompts_per_step", "group", "max_new_tokens", "steps", "rounds", "threads"),
                *("tool", "rollout_precision"),
            )
        },
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
