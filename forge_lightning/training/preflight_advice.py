"""Whether the preflight's worst case (training/preflight.py) fits its limit and, where it does
not, what to change: the settings that bring it under, each sized from the measured cost per row
and per token of its training micro-batch, or per prompt of its generation."""

from __future__ import annotations

import math

import torch

from forge_lightning.training.context import StepContext
from forge_lightning.training.peak_memory import size_text
from forge_lightning.training.preflight import PreflightError, PreflightReport, WorstCase


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
        f"Preflight: the worst-case first step {case.described()} peaks at {size_text(report.peak)} "
        f"{report.memory}, over the limit of {size_text(report.limit)} (preflight_memory_gb): "
        f"{report.phases()}. To fit it, change one of:\n{lines}"
    )


def suggestions(report: PreflightReport, case: WorstCase, gradient_checkpointing: bool) -> list[str]:
    """The settings that bring ``report``'s peak under its limit, each sized from the measured
    cost per row and per token (the memory before the preflight and AdamW's state are fixed)."""
    room = report.limit - report.baseline - report.optimizer_state
    if room <= 0:
        fixed = size_text(report.baseline + report.optimizer_state)
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
            f"rows added {size_text(cost)})"
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
        out.append(f"train_micro_batch_size: {rows} (now {report.rows} rows; {size_text(per_row)} each)")
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
