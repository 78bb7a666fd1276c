"""TRL's GRPOTrainer trained for a wall-clock budget, saving the model at time marks: TRL's side of
the time-to-accuracy race (bench/time_to_accuracy.py).

    <trl venv>/bin/python forge_lightning/bench/trl_time_reference.py --model DIR \
        --prompts FILE.jsonl --out DIR --budget-s 1800 [--checkpoint-every-s 300] [--threads 2] \
        [--seed 42] [--group 8] [--prompts-per-step 4] [--max-new-tokens 96] [--temperature 0.8] \
        [--learning-rate 1.5e-5] [--kl-beta 0.0]

It runs in a virtual environment of its own (``trl==1.16.0``, ``torch==2.13.0``; TRL is no
dependency of forge_lightning), so it imports nothing of this package and nothing heavy at the top
(``--help`` works anywhere). ``--prompts`` holds one JSON object a line: ``prompt`` (the chat
messages, system prompt first, which TRL puts through the tokenizer's chat template as we do) and
``reference`` (the answer the reward checks).

The settings are ours (configs/arithmetic_cpu.yaml, which the driver reads and passes here):
``--prompts-per-step`` prompts x ``--group`` completions an optimizer step (one micro-batch, no
accumulation), completions end at EOS or ``--max-new-tokens``, sampling at ``--temperature`` with
top-p 1 and top-k 0, a constant learning rate, ``beta`` ``--kl-beta``, TRL's ``grpo`` loss (ours;
TRL's default is ``dapo``), no gradient checkpointing (TRL's default is on, ours off), float32 on
the CPU. The reward is :func:`correctness`, the same reading of the answer as our
``GSM8KAnswerReward`` (a test checks that the two agree).

The clock starts at the first step's ``on_step_begin`` (model load and TRL's set-up excluded) and
stops while a checkpoint is written. Every ``--checkpoint-every-s`` of it the model and tokenizer
are saved to ``<out>/<step>/``; the first step that ends at or past ``--budget-s`` is saved to
``<out>/final/`` and training stops there. ``<out>/checkpoints.jsonl`` gets one line per folder:
``{"name", "folder", "step", "elapsed_s"}``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

# The answer reading of forge_lightning.data.gsm8k.extract_answer, copied (this script cannot
# import the package); tests/bench/test_time_to_accuracy.py checks the two agree.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_ANSWER_LINE = re.compile(r"answer\s*:(.*)", re.IGNORECASE)
_BOXED = "\\boxed{"


def normalize_number(text: str) -> str | None:
    """Value-normalise a number string ("$1,800.50" -> "1800.5"); None if not a number."""
    cleaned = str(text).strip().replace(",", "").replace("$", "").replace("%", "").rstrip(".")
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    result = format(Decimal(cleaned).normalize(), "f")
    return "0" if result == "-0" else result


def _last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return normalize_number(matches[-1]) if matches else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def extract_answer(text: str) -> str | None:
    """Last ``\\boxed{}``, else the first number of the last ``Answer:`` line, else the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        number = normalize_number(boxed) or _last_number(boxed)
        if number is not None:
            return number
    answer_lines = _ANSWER_LINE.findall(text)
    if answer_lines:
        first = _NUMBER.search(answer_lines[-1])
        if first is not None:
            return normalize_number(first.group())
    return _last_number(text)


def correctness(completions: list[Any], reference: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion's answer equals the reference as a value, else 0.0 (TRL passes the
    dataset's ``reference`` column by name; a conversational completion is a list of messages)."""
    texts = [c if isinstance(c, str) else "".join(str(m.get("content", "")) for m in c) for c in completions]
    return [1.0 if extract_answer(t) == normalize_number(r) else 0.0 for t, r in zip(texts, reference)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train TRL's GRPOTrainer for a wall-clock budget.")
    add = parser.add_argument
    add("--model", required=True, help="a model folder (save_pretrained)")
    add("--prompts", required=True, help="JSONL, one {'prompt': [messages], 'reference': str} a line")
    add("--out", required=True, help="folder for the checkpoints and checkpoints.jsonl")
    add("--budget-s", type=float, required=True, help="training seconds, from the first step's start")
    add("--checkpoint-every-s", type=float, default=300.0)
    add("--threads", type=int, default=None)
    add("--seed", type=int, default=42)
    add("--group", type=int, default=8, help="completions per prompt (G)")
    add("--prompts-per-step", type=int, default=4)
    add("--max-new-tokens", type=int, default=96)
    add("--temperature", type=float, default=0.8)
    add("--learning-rate", type=float, default=1.5e-5)
    add("--kl-beta", type=float, default=0.0)
    return parser.parse_args(argv)


class StopWatch:
    """Seconds of training since ``start``, less the seconds spent in ``pause``d stretches."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._paused = 0.0

    def start(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def elapsed(self) -> float:
        return 0.0 if self._start is None else time.perf_counter() - self._start - self._paused

    def pause(self, since: float) -> None:
        self._paused += time.perf_counter() - since


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    clock = StopWatch()

    class WallClockCheckpoints(TrainerCallback):
        """Saves at every ``--checkpoint-every-s`` of training and at the budget, where it stops."""

        def __init__(self) -> None:
            self.next_mark = args.checkpoint_every_s
            self.final_saved = False

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            clock.start()

        def on_step_end(self, _args: Any, state: Any, control: Any, **__: Any) -> None:
            elapsed = clock.elapsed()
            if elapsed >= args.budget_s:
                self.save("final", state.global_step, elapsed)
                control.should_training_stop = True
            elif elapsed >= self.next_mark:
                self.save(str(state.global_step), state.global_step, elapsed)
                while self.next_mark <= elapsed:
                    self.next_mark += args.checkpoint_every_s

        def on_train_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            if not self.final_saved:  # training ran out of steps before the budget
                self.save("final", state.global_step, clock.elapsed())

        def save(self, name: str, step: int, elapsed: float) -> None:
            began = time.perf_counter()
            folder = out / name
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            line = {"name": name, "folder": str(folder), "step": step, "elapsed_s": round(elapsed, 3)}
            with open(out / "checkpoints.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            self.final_saved = name == "final"
            clock.pause(began)

    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=args.prompts_per_step * args.group,
        num_generations=args.group,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=args.kl_beta,
        loss_type="grpo",
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=10**9,  # the budget stops it
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default is on; ours is off: the same work
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=correctness,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[WallClockCheckpoints()],
    )
    trainer.train()
    print(json.dumps({"framework": f"trl {trl.__version__}", "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
