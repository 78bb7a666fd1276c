"""The module's preflight (training/preflight.py) as its settings size it: the worst-case first
step of a fit, run once at its start; stops the fit where its peak memory is over the limit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import GenerationBackend, SamplingParams
from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.settings.groups import GRPOSettings
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.peak_memory import memory_limit
from forge_lightning.training.preflight import (
    Engine,
    WorstCase,
    data_longest_prompt,
    filler_token,
    longest_prompt,
    optimizer_state_bytes,
    run_preflight,
    training_prompts,
)
from forge_lightning.training.preflight_advice import check_preflight


def module_preflight(
    settings: GRPOSettings,
    model: PreTrainedModel,
    special_ids: Sequence[int],
    passes: LossPasses,
    engine: tuple[GenerationBackend | None, SamplingParams] | None,
    prompts: int,
    read_ahead: Callable[[], int | None],
    optimizer_state: dict[Any, Any],
    autocast: AbstractContextManager[Any],
    device: torch.device,
    context: Any,
) -> None:
    """The worst-case first step, ``prompts`` prompts per batch, the longest prompt the setting's
    or (``read_ahead``) the training data's; ``engine`` None where a worker process samples (its
    memory is its own). ``autocast``: the precision's training context, as in ``training_step``."""
    s = settings
    limit = s.prompts.max_prompt_length
    longest = longest_prompt(limit, None if limit is not None else read_ahead())
    case = WorstCase(longest, s.sampling.max_new_tokens, prompts, s.sampling.group_size)
    sampling = None if engine is None else Engine(engine[0], engine[1], s.engine.generation_backend)
    token = filler_token(model.config.vocab_size, special_ids)
    budget = memory_limit(s.preflight.preflight_memory_gb, device)
    state = optimizer_state_bytes(model, optimizer_state)
    with autocast:
        report = run_preflight(model, passes, sampling, case, token, context, budget, state)
    check_preflight(report, case, s.memory.gradient_checkpointing, context)
    rank_zero_info(report.summary())


def data_longest(loaders: Any, sampler: Any) -> int | None:
    """The training data's longest prompt in tokens, as the sampler encodes it (cut at the
    model's context less the longest completion); None where the data cannot be read ahead."""
    prompts = training_prompts(loaders)
    if prompts is None or not isinstance(sampler, RolloutSampler):
        return None
    return data_longest_prompt(prompts, lambda chunk: sampler.encode(chunk, torch.device("cpu"))[1])
