"""One request inside the rollout server's decode loop (serving/decode.py): its rows, its own
generator, the logits processors ``generate`` would build for it, and its answer once done.

The processors are built as transformers' ``generate`` builds them for the in-process engine's
``GenerationConfig`` (rollout/engines/hf.py), in the same order; a setting whose processor is not
built here is refused by name instead of being sampled differently.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from forge_lightning.rollout.engines.hf import HFGenerate, StopStrings, completion_ends
from forge_lightning.serving.wire import GenerateAnswer, GenerateCall, decode_rng_state, encode_rng_state

# GenerationConfig fields whose logits processors are not built here, with when each is on.
_NOT_BUILT: dict[str, Callable[[Any], bool]] = {
    "guidance_scale": lambda v: v is not None and v != 1,
    "sequence_bias": lambda v: v is not None,
    "no_repeat_ngram_size": lambda v: bool(v),
    "bad_words_ids": lambda v: v is not None,
    "min_length": lambda v: bool(v),
    "min_new_tokens": lambda v: bool(v),
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "remove_invalid_values": lambda v: bool(v),
    "exponential_decay_length_penalty": lambda v: v is not None,
    "suppress_tokens": lambda v: v is not None,
    "begin_suppress_tokens": lambda v: v is not None,
    "top_h": lambda v: v is not None,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and v > 0,
    "eta_cutoff": lambda v: v is not None and v > 0,
    "watermarking_config": lambda v: v is not None,
    "renormalize_logits": lambda v: bool(v),
    "num_beams": lambda v: v is not None and v > 1,
}


@dataclass(eq=False)  # compared by identity: its fields are tensors
class Job:
    """One request in the loop: its rows' sequences so far and what it has recorded.

    ``ids``/``mask`` (N, W+t): the prompts left-padded to W and repeated ``group_size`` times
    (N = P*G), then the t sampled tokens; the last column is the one the model has not seen yet
    (the batch's cache covers the others). ``logits`` (N, V): the next token's, ready to sample.
    """

    call: GenerateCall
    future: Future[GenerateAnswer]
    generator: torch.Generator
    ids: Tensor
    mask: Tensor
    width: int
    processors: LogitsProcessorList
    sample: bool  # False: greedy
    stop: StopStrings | None
    unfinished: Tensor  # (N,) long: 1 while the row has not ended
    logits: Tensor | None = None
    fresh: bool = True  # not yet through the model (a resumed partial request is not)
    logp: list[Tensor] = field(default_factory=list)  # per step, (N,)
    versions: list[int] = field(default_factory=list)  # per step

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def steps(self) -> int:
        return self.ids.shape[1] - self.width


def new_job(call: GenerateCall, model: PreTrainedModel, engine: HFGenerate) -> Job:
    """``call``'s job: its prompts left-padded to its longest and repeated per group, as the
    in-process engine gets them. ValueError for a request the loop cannot sample as it would."""
    vocab = model.get_input_embeddings().num_embeddings
    if any(not 0 <= t < vocab for p in call.prompts for t in p):
        raise ValueError(
            f"request {call.request_id}: a prompt token id is outside the vocabulary (0..{vocab - 1})"
        )
    config = sampling_config(call, model, engine)
    width, pad, device = max(len(p) for p in call.prompts), engine.pad_token_id, model.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in call.prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in call.prompts], device=device)
    ids, mask = ids.repeat_interleave(call.group_size, 0), mask.repeat_interleave(call.group_size, 0)
    return Job(
        call=call,
        future=Future(),
        generator=generator(call),
        ids=ids,
        mask=mask,
        width=width,
        processors=processors(config, mask),
        sample=bool(config.do_sample),
        stop=engine._stop_strings(call.params, width),
        unfinished=torch.ones(ids.shape[0], dtype=torch.long, device=device),
    )


def sampling_config(call: GenerateCall, model: PreTrainedModel, engine: HFGenerate) -> GenerationConfig:
    """The request's GenerationConfig as ``generate`` completes it: hf.py's, its unset fields from
    the model's generation_config. ValueError naming a setting whose processor is not built here."""
    config = engine._config(call.params, 1, True)
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    on = not_built(lambda name: getattr(config, name, None))
    if on:
        raise ValueError(
            f"the rollout server does not sample with {on} (from the request's extra generation "
            "settings or the model's generation_config): drop them, or sample in-process"
        )
    return config


def not_built(value_of: Callable[[str], Any]) -> list[str]:
    """The settings the loop builds no processor for that are on, by the value ``value_of`` gives
    each name (a GenerationConfig's; a run's extra generation settings, checked before any server
    starts)."""
    return [name for name, is_on in _NOT_BUILT.items() if is_on(value_of(name))]


def generator(call: GenerateCall) -> torch.Generator:
    """The request's own CPU generator: the trainer's state, else its seed, else a fresh seed."""
    out = torch.Generator()
    if call.rng_state is not None:
        out.set_state(decode_rng_state(call.rng_state))
    elif call.seed is not None:
        out.manual_seed(call.seed)
    else:
        out.seed()
    return out


def processors(config: GenerationConfig, mask: Tensor) -> LogitsProcessorList:
    """The logits processors ``generate`` builds for ``config``, in its order: the repetition
    penalty (the prompt's left padding ignored), then, when sampling, temperature, top-k, top-p, min-p."""
    out = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        padding = None if bool((mask == 1).all()) else (mask != 0).int().argmax(dim=1)
        out.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=padding))
    if not config.do_sample:
        return out
    if config.temperature is not None and config.temperature != 1.0:
        out.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        out.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        out.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return out


def answer(job: Job, eos_ids: list[int]) -> GenerateAnswer:
    """The finished ``job``'s rows, each cut where it ends (its EOS, or its stop string)."""
    ids = job.ids[:, job.width :]  # (N, T)
    ends = completion_ends(ids, eos_ids, None if job.stop is None else job.stop.ends).tolist()
    logp = torch.stack(job.logp, dim=1).tolist() if job.call.logprobs else None
    return GenerateAnswer(
        request_id=job.call.request_id,
        completions=[row[:end] for row, end in zip(ids.tolist(), ends, strict=True)],
        logp=None if logp is None else [row[:end] for row, end in zip(logp, ends, strict=True)],
        versions=[job.versions[:end] for end in ends],
        truncated=[bool(u) for u in job.unfinished.tolist()],
        rng_state=None if job.call.rng_state is None else encode_rng_state(job.generator.get_state()),
    )
