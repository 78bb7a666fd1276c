"""Generation engines: a small interface so that HF ``generate`` (the default, and the CPU path)
and other engines (vLLM) produce the same completions for a :class:`~forge_lightning.rollout.Rollout`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteria, StoppingCriteriaList
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.hf_compat import (
    cache_kwarg,
    is_checkpointing,
    output_cache,
    set_checkpointing,
    supports_shared_prefix,
)
from forge_lightning.sampling import GenerationBackend, SamplingParams

# The engine protocols live in sampling.py (a leaf, so engines and rollouts share them without an
# import circle); the one this file does not use is named here still, where it was first defined.
from forge_lightning.sampling import LogProbGenerationBackend as LogProbGenerationBackend
from forge_lightning.sharding import is_sharded


class HFGenerate:
    """Sampling with ``model.generate``: eval mode, no grad, KV cache on, then back to train mode."""

    def __init__(self, pad_token_id: int, eos_token_ids: Sequence[int]) -> None:
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        stopping_criteria: Sequence[StoppingCriteria] | None = None,
    ) -> Tensor:
        """Completions ``(P*G, Lc)``; ``stopping_criteria`` may end rows early (a tool call:
        tool_rollout.py), each stopped row then padded with the pad token like a finished one."""
        return self._generate(
            model, prompt_ids, prompt_mask, group_size, params, scores=False, stopping=stopping_criteria
        )[0]

    def generate_continuing(
        self,
        model: PreTrainedModel,
        input_ids: Tensor,
        input_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        stopping_criteria: Sequence[StoppingCriteria],
        cache: Any = None,
    ) -> tuple[Tensor, Any]:
        """:meth:`generate` for a caller that comes back to the same rows with a few more tokens
        each (tool_rollout.py): returns the whole sequences ``(B, L)`` and the KV cache of their
        first ``cache.get_seq_length()`` columns. Given a ``cache`` of a previous call (rows
        selected, ``group_size`` 1), only the columns of ``input_ids`` past it go through the
        model; ``input_mask`` may hold zeros anywhere (a row's padding after a stop)."""
        groups = group_size if cache is None else 1
        out = self._generate(
            model, input_ids, input_mask, groups, params, False, stopping_criteria, cache=cache, full=True
        )
        return out.sequences, output_cache(out)

    def generate_with_logprobs(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
    ) -> tuple[Tensor, Tensor]:
        """Completions and the log-prob each token was sampled with, from the scores ``generate``
        sampled from (after its temperature and any top-k/top-p cut): with ``top_p`` 1 and
        ``top_k`` 0, the policy's log-probs at ``params.temperature``, without another forward."""
        completion_ids, scores = self._generate(
            model, prompt_ids, prompt_mask, group_size, params, scores=True
        )
        logp = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        for t, step in enumerate(scores):  # (P*G, V) per generated position
            picked = completion_ids[:, t : t + 1]
            logp[:, t] = (
                step.float().gather(1, picked) - torch.logsumexp(step.float(), dim=-1, keepdim=True)
            )[:, 0]
        return completion_ids, logp

    def _generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        scores: bool,
        stopping: Sequence[StoppingCriteria] | None = None,
        cache: Any = None,
        full: bool = False,
    ) -> Any:
        """The completions and the scores (``full``: ``generate``'s whole output); ``cache``
        covers the first columns of ``prompt_ids`` (generate_continuing)."""
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
                out = model.generate(
                    **(inputs or {"input_ids": prompt_ids, "attention_mask": prompt_mask}),
                    generation_config=self._config(params, repeats, scores),
                    stopping_criteria=StoppingCriteriaList(stopping or []),
                    # A sharded model gathers its weights from every rank in each forward: all
                    # ranks must run the same number of decoding steps, so a rank whose
                    # completions have all ended keeps stepping until every rank's have.
                    synced_gpus=is_sharded(model) and torch.distributed.get_world_size() > 1,
                )
        finally:
            if checkpointing:
                set_checkpointing(model, True)
            model.train(was_training)
        if full:
            return out
        return out.sequences[:, prompt_ids.shape[1] :], tuple(out.scores or ()) if scores else ()

    def _config(self, params: SamplingParams, num_return_sequences: int, scores: bool) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            top_k=params.top_k if not params.greedy else None,
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


def generation_backend(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    vllm_gpu_memory_utilization: float = 0.3,
) -> GenerationBackend:
    """The sampling engine ``name`` (``hf`` or ``vllm``) names."""
    eos = eos_token_ids(tokenizer, model)
    if name == "vllm":
        from forge_lightning.vllm_backend import VLLMGenerate

        return VLLMGenerate(tokenizer, eos, gpu_memory_utilization=vllm_gpu_memory_utilization)
    return HFGenerate(tokenizer.pad_token_id, eos)
