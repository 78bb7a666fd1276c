"""The HF engine: the policy's own ``generate`` (the default, and the CPU path), sampling the same
completions for a :class:`~forge_lightning.rollout.types.Rollout` as the other engines (vLLM)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.hf_compat import (
    cache_kwarg,
    is_checkpointing,
    output_cache,
    set_checkpointing,
    supports_shared_prefix,
)
from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    EngineOptions,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.types import completion_mask


class StopStrings(StoppingCriteria):
    """Stops each row once its completion ends with one of ``stop`` and records where.

    The match is transformers' ``StopStringCriteria`` on the generated columns only (those from
    ``start``, the input's width), so that, as in vLLM, a stop string never reaches into the prompt.
    ``ends`` (B,): how many tokens the row had generated when its first stop string completed, -1
    for a row that has not stopped. Counted from the width, not from calls, so that it holds
    however ``generate`` began (a prefilled prompt starts from its last token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], start: int) -> None:
        self.match = StopStringCriteria(tokenizer, list(stop))
        self.start = start
        self.ends: Tensor | None = None

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> Tensor:
        hit = self.match(input_ids[:, self.start :], scores)  # (B,) bool
        if self.ends is None:
            self.ends = torch.full(hit.shape, -1, dtype=torch.long, device=hit.device)
        first = hit & (self.ends < 0)
        self.ends = torch.where(first, input_ids.shape[1] - self.start, self.ends)
        return hit


def completion_ends(completion_ids: Tensor, eos_ids: Sequence[int], stop_ends: Tensor | None) -> Tensor:
    """(N,) each completion's length: through its first EOS, or through the token that completed
    its stop string (``stop_ends`` (N,), -1 where none did) where that comes first."""
    ends = completion_mask(completion_ids, eos_ids).sum(dim=1)
    if stop_ends is None:
        return ends
    stopped = stop_ends >= 0
    return torch.where(stopped, torch.minimum(stop_ends.to(ends.device), ends), ends)


class HFGenerate:
    """Sampling with ``model.generate``: eval mode, no grad, KV cache on, then back to train mode.

    ``tokenizer`` is needed only for stop strings (``SamplingParams.stop``): they are matched on
    its tokens' text.
    """

    def __init__(
        self,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer

    capabilities = EngineCapabilities(logprobs=True, stop_strings=True, stop_rule=True, continues=True)

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        """Completions ``(P*G, Lc)`` of ``request``: its stop rule (a tool call:
        rollout/tool_sampler.py) and stop strings may end rows early, each stopped row then padded
        with the pad token like a finished one; with stop strings ``ends`` says where each row
        ends (None without: every row ends at its first EOS).

        ``request.logprobs``: the log-prob each token was sampled with, from the scores
        ``generate`` sampled from (after its temperature, top-k/top-p/min-p cut and repetition
        penalty): with those off, the policy's log-probs at ``params.temperature``, without
        another forward. ``request.continuing``: for a caller that comes back to the same rows with
        a few more tokens each, the KV cache of the first ``cache.get_seq_length()`` columns of the
        whole sequences (the input, then the new tokens); given a ``request.cache`` of a previous
        call (rows selected), only the input's columns past it go through the model."""
        r = request
        width = r.prompt_ids.shape[1]
        stop = self._stop_strings(r.params, width)
        stopping = [*r.stop_rule, *([] if stop is None else [stop])]
        groups = r.group_size if r.cache is None else 1
        out = self._generate(
            model, r.prompt_ids, r.prompt_mask, groups, r.params, r.logprobs, stopping, r.cache
        )
        ids = out.sequences[:, width:]
        return Completions(
            ids,
            ends=None if stop is None else completion_ends(ids, self.eos_token_ids, stop.ends),
            logp=sampled_logprobs(ids, out.scores) if r.logprobs else None,
            cache=output_cache(out) if r.continuing else None,
        )

    def _generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        scores: bool,
        stopping: Sequence[StoppingCriteria],
        cache: Any = None,
    ) -> Any:
        """``model.generate``'s whole output (sequences, and with ``scores`` the scores) stopped by
        ``stopping``; ``cache`` covers the first columns of ``prompt_ids``."""
        was_training = model.training
        # Gradient checkpointing switches the KV cache off; generation without a cache is
        # quadratic, so checkpointing is paused while sampling and restored afterwards.
        checkpointing = is_checkpointing(model)
        if checkpointing:
            set_checkpointing(model, False)
        model.eval()
        try:
            with torch.no_grad():
                if cache is not None:
                    inputs = {
                        "input_ids": prompt_ids,
                        "attention_mask": prompt_mask,
                        cache_kwarg(model): cache,
                    }
                else:
                    inputs = self._prefilled_inputs(model, prompt_ids, prompt_mask, group_size)
                repeats = group_size if inputs is None else 1
                return model.generate(
                    **(inputs or {"input_ids": prompt_ids, "attention_mask": prompt_mask}),
                    generation_config=self._config(params, repeats, scores),
                    stopping_criteria=StoppingCriteriaList(stopping),
                    # A sharded model gathers its weights from every rank in each forward: all
                    # ranks must run the same number of decoding steps, so a rank whose
                    # completions have all ended keeps stepping until every rank's have.
                    synced_gpus=is_sharded(model) and torch.distributed.get_world_size() > 1,
                )
        finally:
            if checkpointing:
                set_checkpointing(model, True)
            model.train(was_training)

    def _stop_strings(self, params: SamplingParams, start: int) -> StopStrings | None:
        """The stop-string criterion of a ``generate`` whose input is ``start`` wide; None without."""
        if not params.stop:
            return None
        if self.tokenizer is None:
            raise ValueError(
                f"stop strings {list(params.stop)} need the tokenizer to match them: build "
                "HFGenerate(pad_token_id, eos_token_ids, tokenizer=...) (generation_backend() does)"
            )
        return StopStrings(self.tokenizer, params.stop, start)

    def _config(self, params: SamplingParams, num_return_sequences: int, scores: bool) -> GenerationConfig:
        """The ``GenerationConfig`` of ``params``; stop strings are not in it but a criterion of
        their own (:class:`StopStrings`), which also records where each row stopped."""
        if params.greedy:
            knobs: dict[str, Any] = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            knobs = dict(
                **(params.extra or {}),  # the extra keys: checked not to name the settings below
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p or None,  # None: off
                repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
            )
        return GenerationConfig(
            **knobs,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=num_return_sequences,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids,
            use_cache=True,
            output_scores=scores,
            return_dict_in_generate=True,
        )

    @staticmethod
    def _prefilled_inputs(
        model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int
    ) -> dict[str, Any] | None:
        """``generate`` inputs for the G-fold batch whose prompts already went through the model.

        ``num_return_sequences`` would run every prompt's forward G times, which on a CPU costs
        more than all the decoding of a short completion. Instead all of each prompt but its last
        token runs once, its cache is repeated for the group, and ``generate`` starts from the
        last prompt token. None where that does not apply: a group of one, one-token prompts, a
        sharded model (every rank must make the same calls), a model without a cache.
        """
        if (
            group_size == 1
            or prompt_ids.shape[1] < 2
            or is_sharded(model)
            or not supports_shared_prefix(model)
        ):
            return None
        head_mask = prompt_mask[:, :-1]
        out = model(
            input_ids=prompt_ids[:, :-1],
            attention_mask=head_mask,
            position_ids=(head_mask.cumsum(dim=-1) - 1).clamp(min=0),  # skip left padding, as generate does
            use_cache=True,
            logits_to_keep=1,
        )
        cache = output_cache(out)
        cache.batch_repeat_interleave(group_size)
        return {
            "input_ids": prompt_ids.repeat_interleave(group_size, dim=0),  # (P*G, Lp)
            "attention_mask": prompt_mask.repeat_interleave(group_size, dim=0),
            cache_kwarg(model): cache,
        }

    def sync_weights(self, model: PreTrainedModel) -> None:
        # generate reads the live weights: nothing to copy.
        pass


def sampled_logprobs(completion_ids: Tensor, scores: Sequence[Tensor]) -> Tensor:
    """(N, Lc) float32: the log-prob of each completion token under the scores it was sampled
    from, one ``(N, V)`` per generated position."""
    logp = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    for t, step in enumerate(scores):
        step = step.float()
        picked = step.gather(1, completion_ids[:, t : t + 1])[:, 0]
        logp[:, t] = picked - step.logsumexp(dim=-1)
    return logp


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> list[int]:
    """Every token id that ends a completion: the tokenizer's EOS plus the model's generation EOS."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.extend(int(i) for i in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    if not ids:
        raise ValueError("no EOS token: set tokenizer.eos_token so completions can end")
    return sorted(set(ids))


def build(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], options: EngineOptions) -> HFGenerate:
    """The policy's own ``generate`` (the ``hf`` engine): needs nothing of ``options``."""
    return HFGenerate(tokenizer.pad_token_id, eos_ids, tokenizer)
