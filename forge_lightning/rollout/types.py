"""A rollout, what the rollout layer hands out: the prompts and their G sampled completions as
padded token tensors, and the helpers on such tensors (completion masks, left padding)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor

# What a reward may ask for by name about each completion (Rollout.facts).
FACTS = ("completion_ids", "completion_lengths", "truncated", "tool_calls", "completions", "environments")


# A prompt: the user message as text, or a whole conversation of {"role", "content"} messages.
Prompt: TypeAlias = "str | list[dict[str, Any]]"


@dataclass
class Rollout:
    """One batch of prompts and their sampled completions.

    Completions of a prompt are contiguous: rows ``[i*G, (i+1)*G)`` of the completion tensors
    belong to prompt ``i``.
    """

    prompt_ids: Tensor  # (P, Lp) left-padded
    prompt_mask: Tensor  # (P, Lp) 1 on real prompt tokens
    completion_ids: Tensor  # (P*G, Lc) right-padded with the pad token
    completion_mask: Tensor  # (P*G, Lc) 1 up to and including the first EOS or stop string
    group_size: int
    completions: list[str]  # decoded completions, special tokens removed, P*G of them
    # (P*G, Lc) the sampling engine's log-prob of each completion token, when it reported them;
    # the loss then measures its ratio against these instead of recomputing them.
    old_logp: Tensor | None = None
    # (P*G,) True for a completion cut off at max_new_tokens, with no EOS or stop string; None: none is.
    truncated: Tensor | None = None
    # (P*G, Lc) log-probs under the older weights that sampled the rollout (asynchronous rollouts,
    # rollout/async_worker.py), for the loss's behaviour weight; None: sampled by the weights trained.
    behav_logp: Tensor | None = None
    # (P*G, Lc) 1 where the policy sampled the token, 0 on tokens a tool wrote into the completion
    # (rollout/tool_sampler.py); None: the policy sampled every token the completion mask covers.
    model_mask: Tensor | None = None
    # Per-completion counts of a tool-using rollout, each (P*G,): ``tool_calls``, ``tool_errors``,
    # ``turns`` (generate rounds); None for a rollout of one round.
    tool_stats: dict[str, Tensor] | None = None
    # Per completion of a tool-using rollout: its calls ({name, arguments, result, ok} each), its
    # turns as TRL's messages (assistant and tool), and the environment it ran in (or None).
    tool_calls: list[list[dict[str, Any]]] | None = None
    transcripts: list[list[dict[str, Any]]] | None = None
    environments: list[Any] | None = None

    @property
    def completion_lengths(self) -> Tensor:  # (P*G,)
        """Tokens the policy sampled in each completion (a tool's tokens are not counted)."""
        if self.model_mask is None:
            return self.completion_mask.sum(dim=1)
        return (self.completion_mask.bool() & self.model_mask.bool()).sum(dim=1)

    @property
    def truncation(self) -> Tensor:  # (P*G,) bool
        if self.truncated is None:
            return torch.zeros(
                self.completion_ids.shape[0], dtype=torch.bool, device=self.completion_ids.device
            )
        return self.truncated

    def loss_mask(self, drop_truncated: bool = False) -> Tensor:
        """(P*G, Lc) bool: the completion tokens the loss weighs; without the truncated
        completions' when ``drop_truncated`` (the module's setting to mask them)."""
        mask = self.completion_mask.bool()
        if self.model_mask is not None:  # a tool's tokens were not sampled: no policy or KL weight
            mask = mask & self.model_mask.bool()
        return mask & ~self.truncation.unsqueeze(1) if drop_truncated else mask

    def select_groups(self, keep: Tensor) -> Rollout:
        """The rollout of the prompts where ``keep`` (P,) is True, with their G completions each."""
        rows = keep.repeat_interleave(self.group_size)  # (P*G,)
        picked = rows.nonzero().flatten().tolist()
        return Rollout(
            prompt_ids=self.prompt_ids[keep],
            prompt_mask=self.prompt_mask[keep],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            group_size=self.group_size,
            completions=[self.completions[i] for i in picked],
            old_logp=None if self.old_logp is None else self.old_logp[rows],
            truncated=None if self.truncated is None else self.truncated[rows],
            behav_logp=None if self.behav_logp is None else self.behav_logp[rows],
            model_mask=None if self.model_mask is None else self.model_mask[rows],
            tool_stats=None if self.tool_stats is None else {k: v[rows] for k, v in self.tool_stats.items()},
            tool_calls=_pick(self.tool_calls, picked),
            transcripts=_pick(self.transcripts, picked),
            environments=_pick(self.environments, picked),
        )

    def facts(self) -> dict[str, list]:
        """Per-completion facts a reward may ask for by naming them: ``completion_ids`` (each
        completion's tokens up to and including its EOS, a tool's among them),
        ``completion_lengths`` (tokens the policy sampled), ``truncated`` (cut off at the cap),
        and, from a tool-using rollout only, ``tool_calls`` (its calls), ``completions`` (TRL's
        messages: the assistant and tool turns) and ``environments`` (None without one). A rollout
        without tools leaves those out, so a reward's ``**kwargs`` gets what it got before tools."""
        ends = self.completion_mask.sum(dim=1).tolist()
        facts = {
            "completion_ids": [ids[:n] for ids, n in zip(self.completion_ids.tolist(), ends)],
            "completion_lengths": self.completion_lengths.tolist(),
            "truncated": self.truncation.tolist(),
        }
        if self.tool_calls is not None:
            size = len(self.completions)
            facts["tool_calls"] = self.tool_calls
            facts["completions"] = self.transcripts or [
                [{"role": "assistant", "content": c}] for c in self.completions
            ]
            facts["environments"] = self.environments or [None] * size
        return facts


def _pick(values: list[Any] | None, rows: list[int]) -> list[Any] | None:
    return None if values is None else [values[i] for i in rows]


def warn_when_few_tokens_count(rollout: Rollout) -> None:
    """Warn when under 25% of the rollout's completion tokens keep weight once the truncated
    completions are masked: the cap is likely too short for the task."""
    share = float(rollout.loss_mask(True).sum() / rollout.loss_mask().sum().clamp(min=1))
    if share < 0.25:
        warnings.warn(
            f"only {share:.0%} of this batch's completion tokens keep weight: the others belong to "
            "completions cut off at the length cap, which masking the truncated completions drops; the "
            "cap may be too short for the task",
            stacklevel=3,
        )


def truncated_rows(completion_ids: Tensor, eos_ids: Sequence[int], max_new_tokens: int) -> Tensor:
    """(N,) True where a completion has no EOS and reached ``max_new_tokens`` tokens."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    return ~is_eos.any(dim=1) & torch.tensor(completion_ids.shape[1] >= max_new_tokens, device=is_eos.device)


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


def mask_of_ends(ends: Tensor, width: int) -> Tensor:
    """(N, width) long: 1 on each row's first ``ends[i]`` positions, ``ends`` (N,)."""
    return (torch.arange(width, device=ends.device) < ends.unsqueeze(1)).long()


def cut_at_stop(text: str, stop: Sequence[str]) -> str | None:
    """``text`` up to and including the first stop string to complete in it; None if none occurs."""
    ends = [at + len(s) for s in stop if (at := text.find(s)) >= 0]
    return text[: min(ends)] if ends else None


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


def left_padded_positions(mask: Tensor) -> Tensor:
    """Position ids that skip left padding, as ``generate`` assigns them."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)
