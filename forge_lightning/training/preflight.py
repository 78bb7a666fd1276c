"""A worst-case first step before training (``preflight``), so that a run too big for its machine
stops in minute one with sized suggestions, not hours in at its longest batch.

Two phases, each measured for its peak memory, in the order a step runs them:

- the engine's: a generate of ``max_new_tokens`` tokens (forced: no EOS ends it early) for the
  batch's P x G rows at the longest prompt length L, through the rollout engine itself. Skipped
  with asynchronous rollouts: the rollout servers sample, and their memory is not this one's.
- the training side's: one micro-batch of fake completions (P x G rows of L prompt and
  ``max_new_tokens`` completion tokens, all real, no padding, split into micro-batches as the
  step splits them) through the same loss passes
  (training/loss_passes.py) and backward as the step, with the reference's log-probs where the
  loss reads them. One micro-batch is enough: the step frees each one's activations before the
  next and every one here is as large as the first. The forwards without gradients a step may
  also run (the reference's, the old policy's) hold less than this one and are not run.

Nothing of the run changes: no optimizer step, the gradients put back as they were (None before
the first step), the loss passes' step normaliser restored, and torch's RNG streams (CPU and the
device's) forked around it, so a run with preflight takes the same steps as one without.

The memory is the process's peak resident set (CPU RSS) or on a GPU the allocator's peak
(training/peak_memory.py), the absolute peak, weights and all. AdamW's state, made
at the first optimizer step, is not there yet: 2 x the bytes of each trainable weight without
state is added to the peak. The total is compared with the limit; a run over it stops with a
:class:`PreflightError` naming the settings that bring it under, sized from the measured cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import GenerationBackend, GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.legacy import as_engine
from forge_lightning.rollout.types import Rollout
from forge_lightning.training.context import StepContext
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.peak_memory import PeakMemory, Phase, size_text

# The GenerationConfig / vLLM SamplingParams field that keeps a completion going to its cap.
FULL_LENGTH = {"hf": "min_new_tokens", "vllm": "min_tokens"}


class PreflightError(RuntimeError):
    """The worst-case first step is over the memory limit, or cannot be shaped; the message starts
    with ``Preflight:`` (the CLI exits with it, without a traceback)."""


@dataclass(frozen=True)
class WorstCase:
    """The batch the preflight runs: ``prompts`` x ``group_size`` rows of ``prompt_length``
    prompt tokens and ``new_tokens`` completion tokens."""

    prompt_length: int  # L: max_prompt_length, or the data's longest prompt
    new_tokens: int  # max_new_tokens
    prompts: int  # P: prompts per training batch
    group_size: int  # G

    def described(self) -> str:
        return (
            f"({self.prompts} prompts x {self.group_size} completions of {self.prompt_length} "
            f"prompt + {self.new_tokens} new tokens)"
        )


@dataclass(frozen=True)
class PreflightReport:
    """What the preflight measured: the memory before it, each phase, the rows and tokens of the
    micro-batch trained, the optimizer state still to come, and the limit."""

    memory: str  # "CPU RSS" or "GPU allocated"
    baseline: int  # bytes before the preflight: the weights, the reference, the process
    generation: Phase | None  # None: not measured here (rollout servers sample)
    training: Phase
    rows: int  # completions in the micro-batch trained
    tokens: int  # tokens its forward ran (a shared prompt once per group)
    optimizer_state: int  # bytes AdamW's first step will add
    limit: int  # bytes
    seconds: float

    @property
    def peak(self) -> int:
        """The run's expected peak: the larger phase's, plus the optimizer state still to come."""
        phases = [self.training.peak] + ([self.generation.peak] if self.generation else [])
        return max(phases) + self.optimizer_state

    @property
    def over(self) -> bool:
        return self.peak > self.limit

    def phases(self) -> str:
        """Where the peak comes from, phase by phase."""
        gen = "not measured here" if self.generation is None else size_text(self.generation.peak)
        return (
            f"the generation {gen}, the training micro-batch of {self.rows} rows "
            f"{size_text(self.training.peak)}, AdamW's state to come {size_text(self.optimizer_state)}"
        )

    def summary(self) -> str:
        """The line a preflight that passed logs."""
        return (
            f"Preflight: the worst case peaks at {size_text(self.peak)} {self.memory} of "
            f"{size_text(self.limit)} allowed ({self.phases()}), in {self.seconds:.1f} s"
        )


def longest_prompt(setting: int | None, data_longest: int | None) -> int:
    """L: ``max_prompt_length``, else the data's longest prompt in tokens; refused when neither is known."""
    if setting is not None:
        return setting
    if data_longest is not None:
        return data_longest
    raise PreflightError(
        "Preflight: the longest prompt is not known (no max_prompt_length, and the training data's "
        "prompts cannot be read ahead); set max_prompt_length"
    )


def data_longest_prompt(
    prompts: Sequence[Any], encode: Callable[[list[Any]], torch.Tensor], chunk: int = 256
) -> int | None:
    """The most tokens of any of ``prompts`` as ``encode`` (prompts -> their ``(n, Lp)`` mask)
    makes them, a chunk at a time; None for no prompts."""
    longest = None
    for start in range(0, len(prompts), chunk):
        width = int(encode(list(prompts[start : start + chunk])).sum(dim=1).max())
        longest = width if longest is None else max(longest, width)
    return longest


def training_prompts(loaders: Any) -> list[Any] | None:
    """Every ``prompt`` of the training loader's dataset, read ahead; None where it cannot be (an
    iterable dataset, rows without a ``prompt`` field)."""
    loader = loaders[0] if isinstance(loaders, Sequence) and loaders else loaders
    dataset = getattr(loader, "dataset", None)
    try:
        return [dataset[i]["prompt"] for i in range(len(dataset))]  # type: ignore[index, arg-type]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


def worst_case_rollout(prompts: int, group_size: int, case: WorstCase, token: int, device: Any) -> Rollout:
    """``prompts`` x ``group_size`` completions, every prompt and completion of full length."""
    rows = prompts * group_size
    prompt = torch.full((prompts, case.prompt_length), token, dtype=torch.long, device=device)
    completion = torch.full((rows, case.new_tokens), token, dtype=torch.long, device=device)
    return Rollout(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt),
        completion_ids=completion,
        completion_mask=torch.ones_like(completion),
        group_size=group_size,
        completions=[""] * rows,
    )


def filler_token(vocab_size: int, special: Sequence[int]) -> int:
    """A token id that ends nothing: the smallest that is not a special token."""
    special = set(special)
    return next(i for i in range(vocab_size) if i not in special)


def optimizer_state_bytes(model: PreTrainedModel, state: dict[Any, Any]) -> int:
    """What AdamW adds at its first step: two tensors (its moments) per trainable weight without
    state yet (a resumed run's state is already in memory)."""
    fresh = [p for p in model.parameters() if p.requires_grad and not state.get(p)]
    return sum(2 * p.numel() * p.element_size() for p in fresh)


@dataclass(frozen=True)
class Engine:
    """The rollout engine the preflight generates with, and the sampling it is asked for."""

    backend: GenerationBackend
    sampling: SamplingParams  # training's
    name: str  # the engine's name: which field forces a full-length completion


def run_preflight(
    model: PreTrainedModel,
    loss_passes: LossPasses,
    engine: Engine | None,
    case: WorstCase,
    token: int,
    context: StepContext,
    limit: int,
    optimizer_state: int,
) -> PreflightReport:
    """Generate and train the worst case ``case`` once (see the module doc), leaving the weights,
    their gradients, the loss passes' normaliser and torch's RNG streams as they were. ``engine``
    None: the generation is not measured here. Returns what was measured (:class:`PreflightReport`)."""
    memory, began = PeakMemory(context.device), time.perf_counter()
    devices = [context.device] if context.device.type == "cuda" else []
    baseline = memory.reset()
    with torch.random.fork_rng(devices=devices), _out_of_memory_stops(case, memory.name):
        generation = None
        if engine is not None:
            with memory.phase() as measured, torch.no_grad():
                _generate(model, engine, case, token, context.device)
            generation = measured[0]
        with memory.phase() as measured:
            rows, tokens = _train_one_micro_batch(model, loss_passes, case, token, context)
    return PreflightReport(
        memory.name, baseline, generation, measured[0], rows, tokens, optimizer_state, limit,
        time.perf_counter() - began,
    )  # fmt: skip


@contextmanager
def _out_of_memory_stops(case: WorstCase, memory: str) -> Iterator[None]:
    """A GPU out of memory in the worst case is the preflight's stop, not a traceback: its peak is
    then unknown, so the suggestions are the settings to lower, unsized."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as err:
        raise PreflightError(
            f"Preflight: the worst-case first step {case.described()} ran out of memory ({memory}): "
            "lower train_micro_batch_size or train_micro_batch_tokens, set gradient_checkpointing: "
            f"true, or shorten max_prompt_length or max_new_tokens. {err}"
        ) from None


def _generate(model: PreTrainedModel, engine: Engine, case: WorstCase, token: int, device: Any) -> None:
    """The batch's generation at its longest: every completion runs to ``new_tokens``."""
    full = {FULL_LENGTH.get(engine.name, FULL_LENGTH["hf"]): case.new_tokens}
    params = replace(engine.sampling, stop=(), extra={**(engine.sampling.extra or {}), **full})
    prompts = torch.full((case.prompts, case.prompt_length), token, dtype=torch.long, device=device)
    request = GenerationRequest(prompts, torch.ones_like(prompts), case.group_size, params)
    as_engine(engine.backend).generate(model, request)


def _train_one_micro_batch(
    model: PreTrainedModel, loss_passes: LossPasses, case: WorstCase, token: int, context: StepContext
) -> tuple[int, int]:
    """The loss passes' backward over the largest micro-batch of the worst-case batch, its
    gradients then put back; returns its rows and the tokens its forward ran."""
    whole = worst_case_rollout(case.prompts, case.group_size, case, token, context.device)
    # All rows are full, so micro-batches differ only in how many prompts they run: one across two
    # groups' border runs a prompt a row where one inside a group shares it.
    first = max(loss_passes.micro_batches(whole, model), key=lambda b: b.tokens)
    rows = len(first.rows)
    # The micro-batch alone: its rows in runs that share a prompt (whole groups, a part of one), or
    # each with its prompt.
    groups, size = rows // first.share, first.share
    part = worst_case_rollout(groups, size, case, token, context.device)
    reference = None
    if loss_passes.loss.needs_reference:  # its values do not matter to the memory, only its shape
        reference = torch.zeros(part.completion_ids.shape, device=context.device)
    params = [p for p in model.parameters() if p.requires_grad]
    # Copies: a backward adds into an existing gradient in place (None at a fit's start: no copy).
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    count = loss_passes.count
    try:
        advantages = torch.ones(rows, device=context.device)
        loss_passes.backward(model, part, advantages, None, reference, context.backward, context.profile)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        loss_passes.count = count
    tokens = groups * case.prompt_length + rows * case.new_tokens
    return rows, tokens
