"""TRL's GRPOTrainer step, timed the way our benchmark times ours: the reference of the comparison.

    <trl venv>/bin/python forge_lightning/bench/trl_reference.py --model DIR --prompts FILE.jsonl \
        [--group 8] [--prompts-per-step 1] [--max-new-tokens 64] [--steps 3] [--threads 2]

It runs in a virtual environment of its own (``trl==1.16.0``, ``torch==2.13.0``; TRL is no
dependency of forge_lightning), so it imports nothing of this package: python runs it as a
script. ``python -m forge_lightning.bench.versus_trl`` (bench/versus_trl.py) makes that
environment's inputs (the model folder, the prompts) and runs this script and our benchmark in
interleaved rounds.

The protocol: ``GRPOTrainer`` on the model folder and the prompts of ``--prompts`` (one JSON
object a line with a ``prompt``: a list of chat messages, which TRL puts through the tokenizer's
chat template as we do), ``--prompts-per-step`` prompts x ``--group`` completions an optimizer step
(one micro-batch, no accumulation), every completion ``--max-new-tokens`` long (``min_new_tokens``
in TRL's generation kwargs, as ``--fixed-length`` does for us), sampling at 0.9, ``beta`` 0.01
(so a reference model runs, as ours does), no gradient checkpointing (TRL turns it on by default;
our benchmark runs without), float32 on the CPU, ``--threads`` torch threads. One
warm-up step, then ``--steps`` timed ones: a step is TRL's ``on_step_begin`` to ``on_step_end``
(generation, reward, log-probs, loss, backward, optimizer). Exactly one JSON line goes to stdout:
medians over the timed steps and the settings; TRL's logs go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any


def distinct_characters(completions: list[Any], **kwargs: Any) -> list[float]:
    """A cheap reward with spread (so advantages are not all zero): distinct characters / 64."""
    texts = [c if isinstance(c, str) else " ".join(str(m.get("content", "")) for m in c) for c in completions]
    return [len(set(text)) / 64 for text in texts]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time TRL GRPOTrainer steps; print one JSON line.")
    add = parser.add_argument
    add("--model", required=True, help="a model folder (save_pretrained)")
    add("--prompts", required=True, help="JSONL, one {'prompt': [messages]} a line")
    add("--group", type=int, default=8, help="completions per prompt (G)")
    add("--prompts-per-step", type=int, default=1)
    add("--max-new-tokens", type=int, default=64)
    add("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    add("--threads", type=int, default=None)
    add("--temperature", type=float, default=0.9)
    add("--kl-beta", type=float, default=0.01)
    add("--seed", type=int, default=0)
    add("--label", default="trl")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # the JSON line stands alone on stdout
        result = run(args)
    print(json.dumps(result), file=stdout, flush=True)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    count = args.prompts_per_step * (args.steps + 1)
    rows = [rows[i % len(rows)] for i in range(count)]
    dataset = Dataset.from_list(rows)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl-reference-") as out:
        config = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts_per_step * args.group,
            num_generations=args.group,
            gradient_accumulation_steps=1,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            beta=args.kl_beta,
            learning_rate=1e-6,
            max_steps=args.steps + 1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            fp16=False,
            seed=args.seed,
            shuffle_dataset=False,
            disable_tqdm=True,
            gradient_checkpointing=False,  # TRL's default is on; ours is off: the same work
            generation_kwargs={"min_new_tokens": args.max_new_tokens},
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=distinct_characters,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.train()
    logged = trainer.state.log_history
    timed = timer.seconds[1:]  # the first step is the warm-up
    lengths = [entry["completions/mean_length"] for entry in logged if "completions/mean_length" in entry][1:]
    completions = args.prompts_per_step * args.group
    tokens = [length * completions for length in lengths]  # completion tokens of each timed step
    seconds = statistics.median(timed)
    result: dict[str, Any] = {
        "label": args.label,
        "framework": f"trl {trl.__version__}",
        "completion_tokens_per_s": statistics.median(tokens) / seconds if tokens else None,
        "seconds_per_step": seconds,
        "step_seconds": timed,
        "completion_tokens_per_step": tokens,
        "settings": {
            "prompts_per_step": args.prompts_per_step,
            "group": args.group,
            "max_new_tokens": args.max_new_tokens,
            "fixed_length": True,
            "threads": torch.get_num_threads(),
            "kl_beta": args.kl_beta,
            "temperature": args.temperature,
            "torch": torch.__version__,
        },
    }
    return result


if __name__ == "__main__":
    main()
