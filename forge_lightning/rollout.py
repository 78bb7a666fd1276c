"""Rollouts: prompts in, G sampled completions per prompt out, as padded token tensors.

The generation backend is a small interface so that HF ``generate`` (the default, and the CPU path)
and other engines can produce the same :class:`Rollout`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.hf_compat import cache_kwarg, is_checkpointing, output_cache, set_checkpointing
from forge_lightning.logprobs import supports_shared_prefix
from forge_lightning.sharding import is_sharded


@dataclass
class SamplingParams:
    """How completions are drawn. ``greedy`` ignores temperature/top_p/top_k (used for evaluation)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


@dataclass
class Rollout:
    """One batch of prompts and their sampled completions.

    Completions of a prompt are contiguous: rows ``[i*G, (i+1)*G)`` of the completion tensors
    belong to prompt ``i``.
    """

    prompt_ids: Tensor  # (P, Lp) left-padded
    prompt_mask: Tensor  # (P, Lp) 1 on real prompt tokens
    completion_ids: Tensor  # (P*G, Lc) right-padded with the pad token
    completion_mask: Tensor  # (P*G, Lc) 1 up to and including the first EOS
    group_size: int
    completions: list[str]  # decoded completions, special tokens removed, P*G of them
    # (P*G, Lc) the sampling engine's log-prob of each completion token, when it reported them;
    # the loss then measures its ratio against these instead of recomputing them.
    old_logp: Tensor | None = None

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def completion_lengths(self) -> Tensor:  # (P*G,)
        return self.completion_mask.sum(dim=1)


class GenerationBackend(Protocol):
    """What the module needs from a generation engine."""

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
    ) -> Tensor:
        """Return completion token ids ``(P*G, Lc)``, groups contiguous, right-padded."""
        ...

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Called after every optimizer step; engines holding their own weights copy them here."""
        ...


class LogProbGenerationBackend(GenerationBackend, Protocol):
    """A backend that can also report the log-prob it sampled each completion token with."""

    def generate_with_logprobs(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
    ) -> tuple[Tensor, Tensor]:
        """Completion ids as ``generate`` returns them and their log-probs, both ``(P*G, Lc)``."""
        ...


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
    ) -> Tensor:
        was_training = model.training
        # Gradient checkpointing switches the KV cache off; generation without a cache is
        # quadratic, so checkpointing is paused while sampling and restored afterwards.
        checkpointing = is_checkpointing(model)
        if checkpointing:
            set_checkpointing(model, False)
        model.eval()
        try:
            with torch.no_grad():
                inputs = self._prefilled_inputs(model, prompt_ids, prompt_mask, group_size)
                repeats = group_size if inputs is None else 1
                out = model.generate(
                    **(inputs or {"input_ids": prompt_ids, "attention_mask": prompt_mask}),
                    generation_config=self._config(params, repeats),
                    # A sharded model gathers its weights from every rank in each forward: all
                    # ranks must run the same number of decoding steps, so a rank whose
                    # completions have all ended keeps stepping until every rank's have.
                    synced_gpus=is_sharded(model) and torch.distributed.get_world_size() > 1,
                )
        finally:
            if checkpointing:
                set_checkpointing(model, True)
            model.train(was_training)
        return out[:, prompt_ids.shape[1] :]

    def _config(self, params: SamplingParams, num_return_sequences: int) -> GenerationConfig:
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


def completion_mask(completion_ids: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """1 on every completion token up to and including the first EOS, 0 after it.

    Built from EOS positions, not from ``ids != pad``: when the pad token is the EOS (as for
    SmolLM2), a pad-based mask would hide the EOS itself and the model would never learn to stop.

    completion_ids: (N, Lc) -> mask (N, Lc), same integer dtype as ``long``.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    # Count of EOS tokens strictly before each position; a token is kept while that count is 0.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists into ``(ids, mask)``, each ``(N, max_len)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    use_chat_template: bool,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "left",
) -> tuple[Tensor, Tensor]:
    """Tokenize prompts (through the chat template when asked) into left-padded ``(ids, mask)``.

    Prompts longer than ``max_prompt_length`` keep their last tokens (the question and the cue to
    answer sit at the end) with a warning, or raise when ``truncation="error"``.
    """
    if use_chat_template:
        texts = [
            tokenizer.apply_chat_template(
                _messages(p, system_prompt), tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        token_lists = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        token_lists = [tokenizer(p)["input_ids"] for p in prompts]
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("a prompt encodes to zero tokens; empty prompts cannot be trained on")
    if max_prompt_length is not None:
        too_long = [i for i, t in enumerate(token_lists) if len(t) > max_prompt_length]
        if too_long and truncation == "error":
            raise ValueError(
                f"{len(too_long)} prompt(s) exceed max_prompt_length={max_prompt_length} tokens "
                f"(first: index {too_long[0]}, {len(token_lists[too_long[0]])} tokens)"
            )
        if too_long:
            warnings.warn(
                f"{len(too_long)} prompt(s) longer than max_prompt_length={max_prompt_length} tokens were "
                "truncated from the left",
                stacklevel=2,
            )
            token_lists = [t[-max_prompt_length:] for t in token_lists]
    return left_pad(token_lists, tokenizer.pad_token_id)


def _messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": prompt}]


def decode_completions(tokenizer: PreTrainedTokenizerBase, completion_ids: Tensor, mask: Tensor) -> list[str]:
    """Decode each completion up to its first EOS, without special tokens."""
    rows = [ids[: int(n)].tolist() for ids, n in zip(completion_ids, mask.sum(dim=1))]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
