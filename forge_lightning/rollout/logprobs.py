"""Per-token log-probabilities of sampled completions under a model (policy or reference).

Two ways to run the forward, with the same result:

- ``full``: every row is its prompt followed by its completion, one batched forward.
- ``shared_prefix``: the G completions of a prompt share it, so the prompt runs once per group and
  its keys/values are repeated G times for the completions' forward. The prompt is often most of
  the sequence (an instruction through a chat template), so this saves most of the work.

Only completion positions go through the LM head (``logits_to_keep``), and the float32 work of
:func:`forge_lightning.grpo.token_log_probs` is chunked, so the (rows, length, vocab) logits never
exist in float32 for the whole batch. Where the model's head allows it (models/lm_head.py), the
scorer goes further: it takes the decoder's hidden states and runs the head a chunk of positions
at a time, so the logits never exist for the whole batch at all, in the training pass either.

The scorer runs a rollout micro-batch by micro-batch (rollout/micro_batches.py): by count or by a
token budget, each running only the columns its rows need.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.grpo import token_log_probs, token_log_probs_and_entropy
from forge_lightning.grpo.linear_log_probs import linear_token_log_probs
from forge_lightning.models.hf_compat import cache_kwarg, output_cache, supports_shared_prefix
from forge_lightning.models.lm_head import plain_head_weight
from forge_lightning.rollout.micro_batches import MicroBatch, plan_micro_batches
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
    logits = completion_states(
        model, prompt_ids, prompt_mask, completion_ids, group_size=group_size, mode=mode
    )
    return token_log_probs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)


def completion_states(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    *,
    group_size: int,
    mode: ForwardMode = "full",
    hidden: bool = False,
) -> Tensor:
    """The logits ``(P*G, Lc, V)`` that predict each completion token or, with ``hidden``, the
    decoder's final hidden states ``(P*G, Lc, H)`` the LM head makes them of."""
    if completion_ids.shape[0] != prompt_ids.shape[0] * group_size:
        raise ValueError(
            f"{completion_ids.shape[0]} completions for {prompt_ids.shape[0]} prompts "
            f"x group_size {group_size}"
        )
    if mode == "shared_prefix":
        return _shared_prefix_states(model, prompt_ids, prompt_mask, completion_ids, group_size, hidden)
    return _full_states(model, prompt_ids, prompt_mask, completion_ids, group_size, hidden)


def _last_states(
    model: PreTrainedModel, hidden: bool, keep: int, cache: Any = None, **inputs: Any
) -> tuple[Tensor, Any]:
    """A forward's logits, or (``hidden``) its decoder's final hidden states, at its last ``keep``
    positions (0: all), and the forward's output (its KV cache)."""
    runner = model.get_decoder() if hidden else model
    if cache is not None:
        inputs[cache_kwarg(runner)] = cache
    if not hidden:
        out = runner(**inputs, logits_to_keep=keep)
        return out.logits, out
    out = runner(**inputs)
    states = out.last_hidden_state
    return (states[:, -keep:] if keep else states), out


def _full_states(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    group_size: int,
    hidden: bool,
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
    states, _ = _last_states(
        model,
        hidden,
        completion_len + 1,
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=left_padded_positions(attention),
        use_cache=False,
    )
    # The state at position t predicts token t+1: drop the one after the last completion token.
    return states[:, :-1]  # (N, Lc, V or H)


def _shared_prefix_states(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    group_size: int,
    hidden: bool,
) -> Tensor:
    prompt_pos = left_padded_positions(prompt_mask)
    prompt_states, prompt_out = _last_states(
        model,
        hidden,
        1,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=prompt_pos,
        use_cache=True,
    )
    cache = output_cache(prompt_out)
    cache.batch_repeat_interleave(group_size)
    first = prompt_states.repeat_interleave(group_size, dim=0)  # (N, 1, V or H): predicts completion token 0
    if completion_ids.shape[1] == 1:
        return first
    rest_ids = completion_ids[:, :-1]  # (N, Lc-1): each predicts the next completion token
    attention = torch.cat(
        [prompt_mask.repeat_interleave(group_size, dim=0), torch.ones_like(rest_ids)], dim=1
    )
    start = prompt_pos[:, -1:].repeat_interleave(group_size, dim=0) + 1
    rest_pos = start + torch.arange(rest_ids.shape[1], device=rest_ids.device)
    rest, _ = _last_states(
        model,
        hidden,
        0,
        cache,
        input_ids=rest_ids,
        attention_mask=attention,
        position_ids=rest_pos,
        use_cache=True,
    )
    return torch.cat([first, rest], dim=1)  # (N, Lc, V or H)


@dataclass(frozen=True)
class LogProbScorer:
    """Scores a rollout's completions under a model, micro-batch by micro-batch.

    The policy (with gradients) and the reference and old policy (without) all go through here,
    so prefix sharing, chunking, the temperature and the micro-batches are the same for each.

    Args:
        temperature: the temperature the log-probs are taken at.
        shared_prefix: run each group's prompt once (when the model and the rows allow it).
        chunk_size: rows per chunk of the float32 log-softmax of the model's own logits (without
            ``head_chunk_size``); None for no chunks.
        micro_batch_size: completions per forward; None for the whole rollout at once (or, with
            ``micro_batch_tokens``, no limit on the rows).
        micro_batch_tokens: pack the completions into micro-batches of at most this many tokens,
            padding included (rollout/micro_batches.py); None: by ``micro_batch_size``.
        head_chunk_size: positions per chunk through the LM head and its float32 log-softmax,
            from the decoder's hidden states (grpo/linear_log_probs.py), where the model allows it
            (models/lm_head.py); None: the model's own forward, every position's logits at once.
    """

    temperature: float = 1.0
    shared_prefix: bool = True
    chunk_size: int | None = 8
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    head_chunk_size: int | None = 256

    def micro_batches(self, rollout: Rollout, model: PreTrainedModel) -> list[MicroBatch]:
        """The rollout's micro-batches; prefix-shared where the model allows it and they hold whole groups."""
        shared = self.shared_prefix and supports_shared_prefix(model)
        return plan_micro_batches(
            rollout, size=self.micro_batch_size, tokens=self.micro_batch_tokens, shared=shared
        )

    def log_probs(self, model: PreTrainedModel, rollout: Rollout, batch: MicroBatch) -> Tensor:
        """Log-probs ``(n, Lc)`` of ``batch``'s rows under ``model`` (0 after its completion width)."""
        return self._score(model, rollout, batch, with_entropy=False)[0]

    def log_probs_and_entropy(
        self, model: PreTrainedModel, rollout: Rollout, batch: MicroBatch, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor]:
        """:meth:`log_probs` and each position's entropy ``(n, Lc)`` at the same temperature, from
        the same float32 chunks (no extra forward). Through the head's chunks the entropy has a
        gradient; from the model's own logits it is detached unless ``entropy_grad`` (an entropy
        term in the loss; grpo.token_log_probs_and_entropy)."""
        logp, entropy = self._score(model, rollout, batch, with_entropy=True, entropy_grad=entropy_grad)
        assert entropy is not None
        return logp, entropy

    def _score(
        self,
        model: PreTrainedModel,
        rollout: Rollout,
        batch: MicroBatch,
        with_entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        group = rollout.group_size
        prompts = batch.rows[:: batch.share] // group  # the prompt of each run of rows sharing it
        columns = slice(rollout.prompt_ids.shape[1] - batch.prompt_width, None)  # its prompts' own
        targets = rollout.completion_ids[batch.rows, : batch.completion_width]
        head = plain_head_weight(model) if self.head_chunk_size else None
        states = completion_states(
            model,
            rollout.prompt_ids[prompts, columns],
            rollout.prompt_mask[prompts, columns],
            targets,
            group_size=batch.share,
            mode="shared_prefix" if batch.shared else "full",
            hidden=head is not None,
        )
        if head is not None:
            logp, entropy = linear_token_log_probs(
                states, head, targets, self.temperature, self.head_chunk_size, with_entropy
            )
        elif with_entropy:
            logp, entropy = token_log_probs_and_entropy(
                states, targets, self.temperature, self.chunk_size, entropy_grad=entropy_grad
            )
        else:
            logp, entropy = token_log_probs(states, targets, self.temperature, self.chunk_size), None
        # The columns after the micro-batch's longest completion were not run: no value there.
        after = (0, rollout.completion_ids.shape[1] - batch.completion_width)
        return F.pad(logp, after), None if entropy is None else F.pad(entropy, after)

    @torch.no_grad()
    def log_probs_no_grad(self, model: PreTrainedModel, rollout: Rollout) -> Tensor:
        """Log-probs ``(P*G, Lc)`` of every completion, without gradients (reference, old policy)."""
        scored = [(b.rows, self.log_probs(model, rollout, b)) for b in self.micro_batches(rollout, model)]
        dtype = scored[0][1].dtype if scored else torch.float32  # float64 for a float64 model
        out = torch.zeros(rollout.completion_ids.shape, dtype=dtype, device=rollout.completion_ids.device)
        for rows, logp in scored:
            out[rows] = logp
        return out
