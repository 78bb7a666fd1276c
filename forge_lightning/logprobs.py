"""Per-token log-probabilities of sampled completions under a model (policy or reference).

Two ways to run the forward, with the same result:

- ``full``: every row is its prompt followed by its completion, one batched forward.
- ``shared_prefix``: the G completions of a prompt share it, so the prompt runs once per group and
  its keys/values are repeated G times for the completions' forward. The prompt is often most of
  the sequence (an instruction through a chat template), so this saves most of the work.

Only completion positions go through the LM head (``logits_to_keep``), and the float32 work of
:func:`forge_lightning.grpo.token_log_probs` is chunked, so the (rows, length, vocab) logits never
exist in float32 for the whole batch.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.grpo import token_log_probs
from forge_lightning.hf_compat import cache_kwarg, is_checkpointing, output_cache

log = logging.getLogger(__name__)

ForwardMode = Literal["full", "shared_prefix"]


def completion_log_probs(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    *,
    group_size: int,
    temperature: float = 1.0,
    mode: ForwardMode = "full",
    chunk_size: int | None = None,
) -> Tensor:
    """Log-probabilities of ``completion_ids`` given their prompts.

    prompt_ids, prompt_mask: (P, Lp) left-padded; completion_ids: (P*G, Lc), groups contiguous.
    Returns float32 (P*G, Lc); positions after a completion's EOS hold values the caller masks.
    """
    if completion_ids.shape[0] != prompt_ids.shape[0] * group_size:
        raise ValueError(
            f"{completion_ids.shape[0]} completions for {prompt_ids.shape[0]} prompts "
            f"x group_size {group_size}"
        )
    if mode == "shared_prefix":
        logits = _shared_prefix_logits(model, prompt_ids, prompt_mask, completion_ids, group_size)
    else:
        logits = _full_logits(model, prompt_ids, prompt_mask, completion_ids, group_size)
    return token_log_probs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)


def _positions(mask: Tensor) -> Tensor:
    """Position ids that skip left padding, as ``generate`` assigns them."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def _full_logits(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, group_size: int
) -> Tensor:
    completion_len = completion_ids.shape[1]
    input_ids = torch.cat(
        [prompt_ids.repeat_interleave(group_size, dim=0), completion_ids], dim=1
    )  # (N, Lp+Lc)
    # Tokens after a completion's EOS are padding that only later positions could see; causal
    # attention keeps them out of every position we score, so they need no mask.
    attention = torch.cat(
        [prompt_mask.repeat_interleave(group_size, dim=0), torch.ones_like(completion_ids)], dim=1
    )
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=_positions(attention),
        use_cache=False,
        logits_to_keep=completion_len + 1,
    )
    # The logit at position t predicts token t+1: drop the one after the last completion token.
    return out.logits[:, :-1]  # (N, Lc, V)


def _shared_prefix_logits(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, group_size: int
) -> Tensor:
    prompt_pos = _positions(prompt_mask)
    prompt_out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=prompt_pos,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = output_cache(prompt_out)
    cache.batch_repeat_interleave(group_size)
    first = prompt_out.logits.repeat_interleave(group_size, dim=0)  # (N, 1, V): predicts completion token 0
    if completion_ids.shape[1] == 1:
        return first
    rest_ids = completion_ids[:, :-1]  # (N, Lc-1): each predicts the next completion token
    attention = torch.cat(
        [prompt_mask.repeat_interleave(group_size, dim=0), torch.ones_like(rest_ids)], dim=1
    )
    start = prompt_pos[:, -1:].repeat_interleave(group_size, dim=0) + 1
    rest_pos = start + torch.arange(rest_ids.shape[1], device=rest_ids.device)
    rest_out = model(
        input_ids=rest_ids,
        attention_mask=attention,
        position_ids=rest_pos,
        use_cache=True,
        **{cache_kwarg(model): cache},
    )
    return torch.cat([first, rest_out.logits], dim=1)  # (N, Lc, V)


def supports_shared_prefix(model: PreTrainedModel) -> bool:
    """Prefix sharing needs a KV cache: off under gradient checkpointing or without cache support."""
    if is_checkpointing(model):
        return False
    return (
        bool(getattr(model, "_supports_cache_class", True))
        and getattr(model.config, "use_cache", True) is not False
    )
