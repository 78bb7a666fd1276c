"""Throughput of GRPO training steps: completion tokens per second, seconds per phase, memory.

    python -m forge_lightning.bench --data ../shared/data/gsm8k [--prompts-per-step 4] [...]

The real :class:`~forge_lightning.module.GRPOLightningModule` trains inside a real Lightning
``Trainer`` on the first GSM8K train prompts: one warm-up step, then ``--steps`` timed ones. A
callback takes each step's wall time; the split into generate, reward, logprob (every forward),
backward and optimizer is the module's own, timed by the trainer's
:class:`~forge_lightning.reporting.profiler.PhaseProfiler` (``module.last_step.phases``). Right after each
timed step, two references are measured on the very sequences that step sampled:

- ``generate``: plain ``model.generate`` of the step's batch, held to the same number of tokens;
- ``straightforward``: that generate, plus one padded policy forward+backward (each prompt repeated
  for each of its completions, ``logits_to_keep``, a float32 log-softmax) and one reference
  forward: a GRPO step written the obvious way.

Exactly one JSON line goes to stdout (medians over the timed steps, peak memory during the
steps, the settings); every log goes to stderr.

``--rollout-mode async`` times asynchronous rollouts instead (rollout/sources.py's pipeline on
rollout servers, serving/: ``--rollout-servers``, default ``local:1``, a child process that samples
while the trainer trains; each server the trainer starts runs ``--worker-threads``, default half of
``--threads``, and the trainer keeps the threads its CPU servers do not take): after the warm-up
step, which also fills the pipeline, each timed step trains one rollout the servers sampled during
the step before. The references are skipped; the line adds ``trainer_wait_share``, the generate
phase's share of the step (handing a batch over, collecting the one due; the servers report no
waits of theirs). ``--rollout-mode compare`` runs sync, then async, at the same settings, and prints
both lines, the async one with ``vs_sync`` (its completion tokens/s over sync's). ``--sync-threads``
gives sync its own thread count there. bench/servers.py drives it against sync, interleaved.

``--steps-per-generation S`` samples each generation for S optimizer steps of ``--prompts-per-step``
prompts (a batch of S x P prompts; ``--steps`` then counts optimizer steps and must be a multiple
of S), and ``--engine-logprobs`` takes the old policy's log-probs from generate's own scores.
``--generation-compare`` runs four lines at the same settings, interleaved ``--rounds`` times so
that each round's lines share the machine's load: S = 1 and S = 4 at one prompt per optimizer
step, S = 4 with the engine's log-probs, and S = 1 with four prompts per step. Each line adds
``generate_share``, the generate phase's share of the timed seconds.

``--tools PATH [PATH ...]`` gives the policy function tools (import paths) through the built-in tool
loop, ``--agent PATH`` runs a user's agent (``async def agent(client, row)``) through the
OpenAI-compatible endpoint (rollout/agents/); each line then adds ``sampled_tokens_per_s``, the
policy's own tokens (a tool's are not sampled) per second of the step, and
``generate_tokens_per_s``, per second of its generate phase. ``--endpoint-compare --agent A
--tools T ...`` runs the two routes at the same settings, interleaved ``--rounds`` times, the agent
line with ``vs_tool_loop`` (its ``generate_tokens_per_s`` over the tool loop's before it): the cost
of the HTTP layer. References are skipped on these lines.

``--rollout-precision int8`` (or ``bf16``) samples with a low-precision copy of the policy
(rollout/engines/quantized.py) and sets ``rollout_correction: truncate`` (TIS, cap 3) itself; the
references still time the policy's own ``generate``. ``--gradient-checkpointing`` recomputes each
layer's activations in the backward (the module's activation checkpointing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from forge_lightning.bench.peak_rss import PeakPhaseProfiler, current_rss_mb
from forge_lightning.bench.step_timer import RecordingRollouts, StepTimer
from forge_lightning.data import collate_records, load_gsm8k
from forge_lightning.models.loading import load_model
from forge_lightning.module import GRPOLightningModule
from forge_lightning.reporting.profiler import PHASES, PhaseProfiler
from forge_lightning.rollout.in_flight import split_threads
from forge_lightning.rollout.types import Rollout

log = logging.getLogger("forge_lightning.bench")

# Generation engines the benchmark can drive, as the module's ``generation_backend`` names them
# (``vllm`` needs a GPU and the vllm extra).
BACKENDS = ("hf", "vllm")
ROLLOUT_MODES = ("sync", "async", "compare")
ROLLOUT_PRECISIONS = ("int8", "bf16")  # rollout_precision: a low-precision sampler, with TIS
# The bench's flag for each module setting of a run's config that decides what a step costs
# (bench/servers.py times a config's step with them); "model" is the module's model spec.
SETTING_FLAGS = {
    "model": "--model",
    "group_size": "--group",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "kl_beta": "--kl-beta",
    "system_prompt": "--system-prompt",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.bench",
        description="Time GRPO training steps of GRPOLightningModule; print one JSON line.",
    )
    add = parser.add_argument
    add("--data", required=True, help="GSM8K folder (with train.jsonl or .parquet) or file")
    add("--model", default="embedded", help="model spec (embedded, folder, hub id, .gguf, random:...)")
    add("--prompts-per-step", type=int, default=1, help="prompts per training step (P)")
    add("--group", type=int, default=8, help="completions per prompt (G)")
    add("--max-new-tokens", type=int, default=64)
    add("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    add("--device", default=None, help="cpu or cuda[:i]; the GPU when there is one")
    add("--backend", choices=BACKENDS, default="hf", help="generation engine")
    add("--fixed-length", action="store_true", help="every completion runs to --max-new-tokens")
    add("--train-micro-batch-size", type=int, default=None, help="completions per forward/backward")
    add("--no-prefix-sharing", action="store_true", help="full forward for every completion")
    add("--temperature", type=float, default=0.9)
    add("--kl-beta", type=float, default=0.01)
    add("--no-references", action="store_true", help="skip the references (memory-only runs)")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add("--seed", type=int, default=0)
    add("--rollout-mode", choices=ROLLOUT_MODES, default="sync", help="sync, async, or both (compare)")
    add("--max-staleness", type=int, default=1, help="async: optimizer steps a rollout may lag")
    add("--worker-threads", type=int, default=None, help="async: each server's threads (default: half)")
    add("--sync-threads", type=int, default=None, help="compare: sync's threads (default: --threads)")
    add(
        "--rollout-servers",
        nargs="+",
        default=None,
        help="async: rollout servers (local:N, host:port, ray:N; default local:1); --worker-threads each",
    )
    add("--steps-per-generation", type=int, default=1, help="optimizer steps per generation (S)")
    add("--engine-logprobs", action="store_true", help="old-policy log-probs from generate's scores")
    add("--generation-compare", action="store_true", help="S = 1 | 4 | 4 with engine log-probs | P = 4")
    add(
        "--lm-head-chunk-size",
        type=int,
        default=None,
        help="lm_head_chunk_size: 0 for the full logits (default: the module's)",
    )
    add("--phase-memory", action="store_true", help="the peak RSS of each phase (generate, logprob, ...)")
    add("--gradient-checkpointing", action="store_true", help="recompute activations in the backward")
    add("--rounds", type=int, default=1, help="generation-compare, endpoint-compare: rounds of their lines")
    add("--tools", nargs="+", default=None, help="function tools by import path (the built-in tool loop)")
    add("--agent", default=None, help="an agent by import path, through the OpenAI-compatible endpoint")
    add("--max-tool-calls", type=int, default=4, help="tools: the calls one completion may make")
    add("--system-prompt", default=None, help="the system message of every prompt")
    add("--endpoint-compare", action="store_true", help="--tools against --agent, interleaved --rounds times")
    add(
        "--rollout-precision",
        choices=ROLLOUT_PRECISIONS,
        default=None,
        help="sample with an int8/bf16 copy (TIS)",
    )
    args = parser.parse_args(argv)
    if not Path(args.data).exists():
        parser.error(f"--data {args.data}: no such file or folder (give a GSM8K folder or .jsonl file)")
    for name in ("prompts_per_step", "group", "max_new_tokens", "steps", "steps_per_generation", "rounds"):
        if getattr(args, name) < 1 or (name == "group" and args.group < 2):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    spans = (
        GENERATION_LINES if args.generation_compare else [{"steps_per_generation": args.steps_per_generation}]
    )
    for line in spans:
        if args.steps % line["steps_per_generation"]:
            spg = line["steps_per_generation"]
            parser.error(f"--steps {args.steps} is not a multiple of steps per generation {spg}")
    if (args.generation_compare or args.steps_per_generation > 1) and args.rollout_mode != "sync":
        parser.error("--steps-per-generation and --generation-compare time sync rollouts")
    if args.endpoint_compare and not (args.tools and args.agent):
        parser.error("--endpoint-compare compares --tools with --agent: give both")
    if args.tools and args.agent and not args.endpoint_compare:
        parser.error("--tools and --agent are two routes: give one, or both with --endpoint-compare")
    if args.endpoint_compare and (args.generation_compare or args.rollout_mode != "sync"):
        parser.error("--endpoint-compare times sync rollouts alone")
    if args.rollout_servers and args.rollout_mode != "async":
        parser.error("--rollout-servers times asynchronous rollouts on servers: add --rollout-mode async")
    if args.rollout_precision and (args.engine_logprobs or args.generation_compare):
        parser.error(
            "--rollout-precision corrects by the sampler's log-probs: leave out --engine-logprobs "
            "and --generation-compare"
        )
    return args


# The lines of --generation-compare, each a change to the arguments.
GENERATION_LINES = [
    {"steps_per_generation": 1, "engine_logprobs": False, "prompts_per_step": 1},
    {"steps_per_generation": 4, "engine_logprobs": False, "prompts_per_step": 1},
    {"steps_per_generation": 4, "engine_logprobs": True, "prompts_per_step": 1},
    {"steps_per_generation": 1, "engine_logprobs": False, "prompts_per_step": 4},
]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print its JSON line on stdout and return it as a dict."""
    args = parse_args(argv)
    stdout = sys.stdout
    # Lightning and transformers print to stdout in places; the JSON line must stand alone there.
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    compare = args.rollout_mode == "compare"
    results: list[dict[str, Any]] = []
    for changes, extra in _lines(args):
        with contextlib.redirect_stdout(sys.stderr):
            result = run(argparse.Namespace(**{**vars(args), **changes})) | extra
        if compare and results:  # async against the sync line before it
            result["vs_sync"] = result["completion_tokens_per_s"] / results[0]["completion_tokens_per_s"]
        if args.endpoint_compare and result["settings"]["agent"]:  # against the tool loop before it
            result["vs_tool_loop"] = result["generate_tokens_per_s"] / results[-1]["generate_tokens_per_s"]
        print(json.dumps(result), file=stdout, flush=True)
        results.append(result)
    return results[-1]


def _lines(args: argparse.Namespace) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The bench lines to run, in order: each as changes to the arguments and what its JSON line
    adds. ``--generation-compare``: GENERATION_LINES, ``--rounds`` times; ``compare``: sync
    (with ``--sync-threads``), then async; else the arguments as given."""
    if args.generation_compare:
        return [(line, {"round": r}) for r in range(args.rounds) for line in GENERATION_LINES]
    if args.endpoint_compare:
        routes = [{"agent": None, "route": "tool_loop"}, {"tools": None, "route": "endpoint"}]
        return [(route, {"round": r}) for r in range(args.rounds) for route in routes]
    if args.rollout_mode == "compare":
        sync = {"rollout_mode": "sync", "threads": args.sync_threads or args.threads}
        return [(sync, {}), ({"rollout_mode": "async"}, {})]
    return [({}, {})]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps + 1`` steps under the timer; the summary of the timed ones."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pl.seed_everything(args.seed, verbose=False)
    asynchronous = args.rollout_mode == "async"
    # Async trains each batch max_staleness batches after it is handed: that many more batches.
    # With S steps per generation a batch (S x P prompts) takes S optimizer steps.
    spg = args.steps_per_generation
    batches = args.steps // spg + 1 + (args.max_staleness if asynchronous else 0)
    records = _prompts(args.data, args.prompts_per_step * spg * batches)
    model, tokenizer = load_model(args.model, dtype=dtype)
    if args.fixed_length:
        # generate() takes unset settings from the model's generation config: no EOS before the end.
        model.generation_config.min_new_tokens = args.max_new_tokens
    module = GRPOLightningModule(
        model=model,
        tokenizer=tokenizer,
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        kl_beta=args.kl_beta,
        gradient_accumulation_steps=1,
        train_micro_batch_size=args.train_micro_batch_size,
        prefix_sharing=not args.no_prefix_sharing,
        generation_backend=args.backend,
        rollout_mode="async" if asynchronous else "sync",
        max_staleness=args.max_staleness,
        rollout_worker_threads=args.worker_threads,
        rollout_servers=args.rollout_servers,
        steps_per_generation=spg,
        use_engine_logprobs=args.engine_logprobs,
        rollout_precision=args.rollout_precision,
        rollout_correction="truncate" if args.rollout_precision else None,  # TIS at the default cap 3
        tools=args.tools,
        agent=args.agent,
        **_head_chunks(args.lm_head_chunk_size),
        gradient_checkpointing=args.gradient_checkpointing,
        max_tool_calls=args.max_tool_calls,
        system_prompt=args.system_prompt,
    )
    recording = module.rollout_source = RecordingRollouts(module.rollout_source)
    setup_rss = current_rss_mb()
    routes = args.tools or args.agent  # no plain generate to hold them against
    timer = StepTimer(
        args, with_references=not args.no_references and args.rollout_mode == "sync" and not routes
    )
    with tempfile.TemporaryDirectory(prefix="forge-bench-") as root:
        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=[device.index or 0] if device.type == "cuda" else 1,
            max_steps=args.steps + spg,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
            callbacks=[timer],
            profiler=PeakPhaseProfiler() if args.phase_memory else PhaseProfiler(),
        )
        loader = DataLoader(records, batch_size=args.prompts_per_step * spg, collate_fn=collate_records)
        trainer.fit(module, loader)
    # The first batch that trains is the warm-up (and, async, the ones before it fill the pipeline).
    first = next(i for i, step in enumerate(timer.steps) if step["trained"])
    steps, rollouts = timer.steps[first + 1 :], recording.kept[1:]
    memory = {"setup_rss_mb": setup_rss, "peak_rss_mb": timer.peak_rss_mb, "peak_gpu_mb": timer.peak_gpu_mb}
    if args.phase_memory:  # each phase's own peak over the timed steps
        memory["phases"] = timer.phase_peaks
    result = _summary(args, steps, rollouts, timer.references, memory, device, dtype)
    if asynchronous:
        result["trainer_wait_share"] = _server_wait_share(steps)
        # Each server the trainer started runs --worker-threads (None: half of --threads); the
        # trainer keeps the threads its servers on this machine's CPU do not take.
        placement = module.engine.placement
        settings = result["settings"]
        settings["rollout_servers"] = args.rollout_servers or ["local:1"]
        settings["trainer_threads"] = split_threads(settings["threads"], placement.cpu_threads_here())[0]
        settings["worker_threads"] = placement.config.threads
    return result


def _server_wait_share(steps: list[dict[str, float]]) -> float:
    """The share of the timed seconds the trainer waited for rollout servers: its generate phase
    (handing each batch over, collecting the one due), as the servers report no waits of theirs."""
    return sum(s["generate"] for s in steps) / sum(s["seconds"] for s in steps)


def _summary(
    args: argparse.Namespace,
    steps: list[dict[str, float]],
    rollouts: list[Rollout],
    references: list[dict[str, float]],
    memory: dict[str, float | None],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    tokens = [int(r.completion_mask.sum()) for r in rollouts]
    seconds = [s["seconds"] for s in steps]

    result: dict[str, Any] = {
        "completion_tokens_per_s": sum(tokens) / sum(seconds),
        "generate_share": sum(s["generate"] for s in steps) / sum(seconds),
        "seconds_per_step": statistics.median(seconds),
        **{f"time_{p}_s": statistics.median(s[p] for s in steps) for p in PHASES},
    }
    for name in ("generate", "straightforward") if references else ():
        result[f"{name}_seconds_per_step"] = statistics.median(r[name] for r in references)
        # The median of each step's own ratio: the two sides of a ratio ran back to back.
        result[f"vs_{name}"] = statistics.median(t / r[name] for t, r in zip(seconds, references))
    result |= {
        "completion_tokens_per_step": statistics.median(tokens),
        "setup_rss_mb": memory["setup_rss_mb"],
        "peak_rss_mb": memory["peak_rss_mb"],
        "peak_rss_increase_mb": memory["peak_rss_mb"] - memory["setup_rss_mb"],
    }
    if memory["peak_gpu_mb"] is not None:
        result["peak_gpu_mb"] = memory["peak_gpu_mb"]
    for phase, peak in memory.get("phases", {}).items():  # above the RSS the loaded model holds
        result[f"peak_rss_{phase}_increase_mb"] = peak - memory["setup_rss_mb"]
    if args.tools or args.agent:  # the policy's own tokens: a tool's or an agent's turns are not sampled
        sampled = [int(r.completion_lengths.sum()) for r in rollouts]
        result["sampled_tokens_per_s"] = sum(sampled) / sum(seconds)
        result["generate_tokens_per_s"] = sum(sampled) / sum(s["generate"] for s in steps)
        result["sampled_tokens_per_step"] = statistics.median(sampled)
    result["settings"] = {
        "model": args.model,
        "data": str(args.data),
        "prompts_per_step": args.prompts_per_step,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.steps,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "backend": args.backend,
        "fixed_length": args.fixed_length,
        "train_micro_batch_size": args.train_micro_batch_size,
        "prefix_sharing": not args.no_prefix_sharing,
        "temperature": args.temperature,
        "kl_beta": args.kl_beta,
        "seed": args.seed,
        "rollout_mode": args.rollout_mode,
        "steps_per_generation": args.steps_per_generation,
        "engine_logprobs": args.engine_logprobs,
        "rollout_precision": args.rollout_precision,
        "lm_head_chunk_size": args.lm_head_chunk_size,
        "gradient_checkpointing": args.gradient_checkpointing,
        "tools": args.tools,
        "agent": args.agent,
    }
    if args.rollout_mode == "async":
        result["settings"]["max_staleness"] = args.max_staleness
    return result


def _prompts(path: str, count: int) -> list[dict[str, str]]:
    """The first ``count`` GSM8K train records (cycled when the file holds fewer)."""
    rows = load_gsm8k(split="train", max_samples=count, path=path)
    return [rows[i % len(rows)] for i in range(count)]


def _head_chunks(size: int | None) -> dict[str, int | None]:
    """The module's ``lm_head_chunk_size`` as ``--lm-head-chunk-size`` gives it: its default when
    not given, None (the full logits) for 0."""
    return {} if size is None else {"lm_head_chunk_size": size or None}
