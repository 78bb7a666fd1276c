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
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.grpo import token_log_probs, token_log_probs_and_entropy
from forge_lightning.models.hf_compat import cache_kwarg, output_cache, supports_shared_prefix
from forge_lightning.rollout.types import Rollout, left_padded_positions

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
    logits = completion_logits(
        model, prompt_ids, prompt_mask, completion_ids, group_size=group_size, mode=mode
    )
    return token_log_probs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)


def completion_logits(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    *,
    group_size: int,
    mode: ForwardMode = "full",
) -> Tensor:
    """The logits ``(P*G, Lc, V)`` that predict each completion token (see completion_log_probs)."""
    if completion_ids.shape[0] != prompt_ids.shape[0] * group_size:
        raise ValueError(
            f"{completion_ids.shape[0]} completions for {prompt_ids.shape[0]} prompts "
            f"x group_size {group_size}"
        )
    if mode == "shared_prefix":
        return _shared_prefix_logits(model, prompt_ids, prompt_mask, completion_ids, group_size)
    return _full_logits(model, prompt_ids, prompt_mask, completion_ids, group_size)


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
        position_ids=left_padded_positions(attention),
        use_cache=False,
        logits_to_keep=completion_len + 1,
    )
    # The logit at position t predicts token t+1: drop the one after the last completion token.
    return out.logits[:, :-1]  # (N, Lc, V)


def _shared_prefix_logits(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, group_size: int
) -> Tensor:
    prompt_pos = left_padded_positions(prompt_mask)
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


@dataclass(frozen=True)
class LogProbScorer:
    """Scores a rollout's completions under a model, micro-batch by micro-batch.

    The policy (with gradients) and the reference and old policy (without) all go through here,
    so prefix sharing, chunking, the temperature and the micro-batches are the same for each.

    Args:
        temperature: the temperature the log-probs are taken at.
        shared_prefix: run each group's prompt once (when the model and the rows allow it).
        chunk_size: rows per chunk of the float32 log-softmax; None for no chunks.
        micro_batch_size: completions per forward; None for the whole rollout at once.
    """

    temperature: float = 1.0
    shared_prefix: bool = True
    chunk_size: int | None = 8
    micro_batch_size: int | None = None

    def micro_batches(self, rollout: Rollout) -> list[tuple[int, int]]:
        """``[start, stop)`` completion rows of each micro-batch."""
        rows = rollout.completion_ids.shape[0]
        size = self.micro_batch_size or max(rows, 1)
        return [(a, min(a + size, rows)) for a in range(0, rows, size)]

    def log_probs(self, model: PreTrainedModel, rollout: Rollout, start: int, stop: int) -> Tensor:
        """Log-probs ``(stop-start, Lc)`` of completion rows ``[start, stop)`` under ``model``."""
        logits, targets = self._logits(model, rollout, start, stop)
        return token_log_probs(logits, targets, temperature=self.temperature, chunk_size=self.chunk_size)

    def log_probs_and_entropy(
        self, model: PreTrainedModel, rollout: Rollout, start: int, stop: int, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor]:
        """:meth:`log_probs` and each position's entropy ``(stop-start, Lc)`` at the same
        temperature, from the same float32 chunks (no extra forward; the entropy is detached
        unless ``entropy_grad``: an entropy term in the loss)."""
        logits, targets = self._logits(model, rollout, start, stop)
        return token_log_probs_and_entropy(
            logits,
            targets,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            entropy_grad=entropy_grad,
        )

    def _logits(
        self, model: PreTrainedModel, rollout: Rollout, start: int, stop: int
    ) -> tuple[Tensor, Tensor]:
        group = rollout.group_size
        # The prompt can be shared only by rows that hold whole groups.
        aligned = start % group == 0 and (stop % group == 0 or stop == rollout.completion_ids.shape[0])
        shared = aligned and group > 1 and self.shared_prefix and supports_shared_prefix(model)
        if shared:
            rows = slice(start // group, -(-stop // group))
            prompt_ids, prompt_mask = rollout.prompt_ids[rows], rollout.prompt_mask[rows]
        else:
            prompt_ids = rollout.prompt_ids.repeat_interleave(group, dim=0)[start:stop]
            prompt_mask = rollout.prompt_mask.repeat_interleave(group, dim=0)[start:stop]
        targets = rollout.completion_ids[start:stop]
        mode = "shared_prefix" if shared else "full"
        logits = completion_logits(
            model, prompt_ids, prompt_mask, targets, group_size=group if shared else 1, mode=mode
        )
        return logits, targets

    @torch.no_grad()
    def log_probs_no_grad(self, model: PreTrainedModel, rollout: Rollout) -> Tensor:
        """Log-probs ``(P*G, Lc)`` of every completion, without gradients (reference, old policy)."""
        return torch.cat([self.log_probs(model, rollout, a, b) for a, b in self.micro_batches(rollout)])
