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

``--tool`` makes it a tool-using step: the trainer gets the function tool :func:`multiply` and a
system prompt (``TOOL_SYSTEM_PROMPT``) that asks for it, TRL's tool loop (HF generate, parse the
Hermes-style call, call, generate on) runs inside the timed step, at most ``--max-tool-calls``
rounds, and completions end where the model ends them (no forced length). TRL parses calls only
for chat templates it knows: the model folder must carry one (versus_trl gives both sides the
folder with TRL's ``qwen2_5`` template, whose ``<|im_start|>`` turns SmolLM2's tokenizer has).
Completion tokens are then TRL's logged ``completions/mean_length`` x completions (a tool's result
tokens included, as TRL's completions hold them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any

TOOL_SYSTEM_PROMPT = "Use the multiply tool for every product."


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


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
    add("--tool", action="store_true", help="the multiply tool through TRL's tool loop")
    add("--max-tool-calls", type=int, default=4, help="--tool: TRL's max_tool_calling_iterations")
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
    if args.tool:
        system = {"role": "system", "content": TOOL_SYSTEM_PROMPT}
        rows = [{"prompt": [system, *(m for m in row["prompt"] if m["role"] != "system")]} for row in rows]
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
            generation_kwargs={} if args.tool else {"min_new_tokens": args.max_new_tokens},
            **({"max_tool_calling_iterations": args.max_tool_calls} if args.tool else {}),
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=distinct_characters,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
            **({"tools": [multiply]} if args.tool else {}),
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
            "fixed_length": not args.tool,
            "tool": args.tool,
            "threads": torch.get_num_threads(),
            "kl_beta": args.kl_beta,
            "temperature": args.temperature,
            "torch": torch.__version__,
        },
    }
    if args.tool:  # TRL's share of completions that called a tool, per timed step
        calls = [entry["tools/call_frequency"] for entry in logged if "tools/call_frequency" in entry]
        result["tool_call_frequency"] = calls[1:]
    return result


if __name__ == "__main__":
    main()
