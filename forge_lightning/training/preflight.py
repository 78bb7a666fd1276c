"""A worst-case first step before training (``preflight``), so that a run too big for its machine
stops in minute one with sized suggestions, not hours in at its longest batch.

Two phases, each measured for its peak memory, in the order a step runs them:

- the engine's: a generate of ``max_new_tokens`` tokens (forced: no EOS ends it early) for the
  batch's P x G rows at the longest prompt length L, through the rollout engine itself. Skipped
  under ``rollout_mode: async``: the worker process samples, and its memory is not this one's.
- the training side's: one micro-batch of fake completions (P x G rows of L prompt and
  ``max_new_tokens`` completion tokens, all real, no padding, split as the step splits them by
  ``train_micro_batch_size`` / ``train_micro_batch_tokens``) through the same loss passes
  (training/loss_passes.py) and backward as the step, with the reference's log-probs where the
  loss reads them. One micro-batch is enough: the step frees each one's activations before the
  next and every one here is as large as the first.

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

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import GenerationBackend, SamplingParams
from forge_lightning.rollout.types import Rollout
from forge_lightning.training.context import StepContext
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.peak_memory import GB, PeakMemory, Phase

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


@dataclass(frozen=True)
class PreflightReport:
    """What the preflight measured: the memory before it, each phase, the rows and tokens of the
    micro-batch trained, the optimizer state still to come, and the limit."""

    memory: str  # "CPU RSS" or "GPU allocated"
    baseline: int  # bytes before the preflight: the weights, the reference, the process
    generation: Phase | None  # None: not measured here (an async worker samples)
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
        gen = "not measured here" if self.generation is None else _size(self.generation.peak)
        return (
            f"the generation {gen}, the training micro-batch of {self.rows} rows "
            f"{_size(self.training.peak)}, AdamW's state to come {_size(self.optimizer_state)}"
        )

    def summary(self) -> str:
        """The line a preflight that passed logs."""
        return (
            f"Preflight: the worst case peaks at {_size(self.peak)} {self.memory} of "
            f"{_size(self.limit)} allowed ({self.phases()}), in {self.seconds:.1f} s"
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
    return next(i for i in range(vocab_size) if i not in set(special))


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
    name: str  # generation_backend: which field forces a full-length completion


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
    with torch.random.fork_rng(devices=devices):
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


def _generate(model: PreTrainedModel, engine: Engine, case: WorstCase, token: int, device: Any) -> None:
    """The batch's generation at its longest: every completion runs to ``new_tokens``."""
    full = {FULL_LENGTH.get(engine.name, FULL_LENGTH["hf"]): case.new_tokens}
    params = replace(engine.sampling, stop=(), extra={**(engine.sampling.extra or {}), **full})
    prompts = torch.full((case.prompts, case.prompt_length), token, dtype=torch.long, device=device)
    engine.backend.generate(model, prompts, torch.ones_like(prompts), case.group_size, params)


def _train_one_micro_batch(
    model: PreTrainedModel, loss_passes: LossPasses, case: WorstCase, token: int, context: StepContext
) -> tuple[int, int]:
    """The loss passes' backward over the first micro-batch of the worst-case batch, its gradients
    then put back; returns its rows and the tokens its forward ran."""
    whole = worst_case_rollout(case.prompts, case.group_size, case, token, context.device)
    first = loss_passes.micro_batches(whole, model)[0]  # every one as large: all rows are full
    rows = len(first.rows)
    # The micro-batch alone: its whole groups (a shared prompt), or its rows each with its prompt.
    groups, size = (rows // case.group_size, case.group_size) if first.shared else (rows, 1)
    part = worst_case_rollout(groups, size, case, token, context.device)
    reference = None
    if loss_passes.loss.needs_reference:  # its values do not matter to the memory, only its shape
        reference = torch.zeros(part.completion_ids.shape, device=context.device)
    params = [p for p in model.parameters() if p.requires_grad]
    grads, count = [p.grad for p in params], loss_passes.count
    try:
        advantages = torch.ones(rows, device=context.device)
        loss_passes.backward(model, part, advantages, None, reference, context.backward, context.profile)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        loss_passes.count = count
    tokens = groups * case.prompt_length + rows * case.new_tokens
    return rows, tokens


def check_preflight(
    report: PreflightReport, case: WorstCase, gradient_checkpointing: bool, context: StepContext
) -> None:
    """Raise :class:`PreflightError` with sized suggestions when ``report`` is over its limit on
    any rank (every rank then stops, none waiting for the others at the first step)."""
    over = torch.tensor(float(report.over), device=context.device)
    if context.reduce(over, "max").item() == 0:
        return
    if not report.over:
        raise PreflightError("Preflight: another rank's worst-case first step is over its memory limit")
    lines = "\n".join(f"  {line}" for line in suggestions(report, case, gradient_checkpointing))
    raise PreflightError(
        f"Preflight: the worst-case first step ({case.prompts} prompts x {case.group_size} completions "
        f"of {case.prompt_length} prompt + {case.new_tokens} new tokens) peaks at {_size(report.peak)} "
        f"{report.memory}, over the limit of {_size(report.limit)} (preflight_memory_gb): "
        f"{report.phases()}. To fit it, change one of:\n{lines}"
    )


def suggestions(report: PreflightReport, case: WorstCase, gradient_checkpointing: bool) -> list[str]:
    """The settings that bring ``report``'s peak under its limit, each sized from the measured
    cost per row and per token (the memory before the preflight and AdamW's state are fixed)."""
    room = report.limit - report.baseline - report.optimizer_state
    if room <= 0:
        fixed = _size(report.baseline + report.optimizer_state)
        return [
            f"the process before the preflight (the weights, the reference, the libraries) and AdamW's "
            f"state take {fixed} alone: train a LoRA adapter (peft), a smaller model, or raise "
            "preflight_memory_gb"
        ]
    out: list[str] = []
    if report.training.peak + report.optimizer_state > report.limit:
        out += _training_suggestions(report, case, gradient_checkpointing, room)
    generation = report.generation
    if generation is not None and generation.peak + report.optimizer_state > report.limit:
        out.append(_generation_suggestion(generation.peak - report.baseline, case, room))
    return out or ["raise preflight_memory_gb"]


def _generation_suggestion(cost: int, case: WorstCase, room: int) -> str:
    """Fewer prompts per batch or, where one prompt's group is over already, fewer new tokens:
    the generation's memory (its KV cache, its logits) grows with rows x tokens."""
    per_prompt = max(cost, 1) / case.prompts
    prompts = math.floor(room / per_prompt)
    if 1 <= prompts < case.prompts:
        return (
            f"data.prompts_per_step: {prompts} (now {case.prompts}; gradient_accumulation_steps "
            f"up to keep the step's prompts; the generation of {case.prompts * case.group_size} "
            f"rows added {_size(cost)})"
        )
    per_token = per_prompt / (case.prompt_length + case.new_tokens)
    new_tokens = math.floor(room / per_token) - case.prompt_length
    if 1 <= new_tokens < case.new_tokens:
        return f"max_new_tokens: {new_tokens} (now {case.new_tokens}; one prompt's generation is over)"
    return f"group_size below {case.group_size} (one prompt's generation is over the limit)"


def _training_suggestions(
    report: PreflightReport, case: WorstCase, gradient_checkpointing: bool, room: int
) -> list[str]:
    """Sized micro-batches, gradient checkpointing, shorter prompts: what lowers the training side."""
    cost = max(report.training.peak - report.baseline, 1)  # what its micro-batch added
    per_row, per_token = cost / report.rows, cost / report.tokens
    out = []
    rows = math.floor(room / per_row)
    row_tokens = case.prompt_length + case.new_tokens
    if 1 <= rows < report.rows:
        out.append(f"train_micro_batch_size: {rows} (now {report.rows} rows; {_size(per_row)} each)")
        budget = math.floor(room / per_token)
        if budget >= row_tokens:
            out.append(f"train_micro_batch_tokens: {budget} (a row of the worst case is {row_tokens})")
    if not gradient_checkpointing:
        out.append("gradient_checkpointing: true (each layer's activations recomputed in the backward)")
    # The same micro-batch with shorter prompts: its tokens are units x L + rows x new tokens,
    # a unit being a group sharing its prompt or a row with its own.
    units = (report.tokens - report.rows * case.new_tokens) / case.prompt_length
    prompt = math.floor((room / per_token - report.rows * case.new_tokens) / units)
    if 1 <= prompt < case.prompt_length:
        out.append(f"max_prompt_length: {prompt} (now {case.prompt_length}; longer prompts are cut)")
    return out


def _size(value: float) -> str:
    """Bytes in GiB, or MiB under a tenth of one."""
    return f"{value / GB:.2f} GiB" if value >= GB / 10 else f"{value / 2**20:.1f} MiB"
