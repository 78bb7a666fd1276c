"""Agent episodes as a :class:`~forge_lightning.rollout.types.Rollout` (agents/runner.py runs them).

Each episode is one completion: its chain (agents/episodes.py) from the end of its group's prompt
on, the tokens the policy sampled in ``model_mask``, the turns the agent inserted out of it. A
group's prompt is the longest prefix its episodes' first prompts share; the rest of an episode's
first prompt opens its completion, masked. A failed episode's completion is empty.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.agents.episodes import Chain, EpisodeLog
from forge_lightning.rollout.types import Rollout, left_pad

log = logging.getLogger(__name__)


@dataclass
class AgentOutcome:
    """How one episode ended: the agent's return value, or why it failed."""

    returned: float | None = None
    error: str | None = None

    def get_reward(self) -> float:
        """The episode's score: what the agent returned; 0 for a failed episode."""
        return 0.0 if self.error is not None or self.returned is None else self.returned


def episodes_rollout(
    tokenizer: PreTrainedTokenizerBase,
    logs: list[EpisodeLog],
    outcomes: list[AgentOutcome],
    group_size: int,
    device: torch.device,
    prompt_ids: Callable[[int], list[int]],
) -> Rollout:
    """The rollout of the episodes ``logs`` (groups contiguous), each of which ended as its
    outcome says; ``prompt_ids(i)``: prompt ``i`` encoded, the prompt of a group whose every
    episode failed. An episode that made no call fails; the failures and the calls dropped are logged."""
    chains: list[Chain | None] = []
    for outcome, episode_log in zip(outcomes, logs):
        chain = episode_log.episode()
        if chain is None and outcome.error is None:
            outcome.error = "made no call to the endpoint"
        chains.append(None if outcome.error is not None else chain)
    heads, rows, sampled = [], [], []
    for i in range(len(logs) // group_size):
        group = slice(i * group_size, (i + 1) * group_size)
        head = shared_head(chains[group], outcomes[group])
        heads.append(head or prompt_ids(i))
        for n in range(group.start, group.stop):
            if outcomes[n].error is not None:
                chains[n] = None
            ids, model = chains[n].tokens(len(head)) if chains[n] is not None else ([], [])
            rows.append(ids)
            sampled.append(model)
    failed = [o.error for o in outcomes if o.error is not None]
    dropped = [episode_log.dropped() for episode_log in logs]
    if failed or sum(dropped):
        log.warning(
            "agent episodes: %d of %d failed (first: %s); %d calls dropped outside their episode's chain",
            len(failed), len(outcomes), failed[0] if failed else "-", sum(dropped),
        )  # fmt: skip
    calls = [_tool_calls(c) for c in chains]
    stats = {
        "tool_calls": [len(c) for c in calls],
        "turns": [0 if c is None else len(c.calls) for c in chains],
        "agent_errors": [int(o.error is not None) for o in outcomes],
        "agent_calls_dropped": dropped,
    }
    pad = tokenizer.pad_token_id
    prompt, prompt_mask = left_pad(heads, pad)
    ids, real, model = _right_padded(rows, sampled, pad)
    return Rollout(
        prompt_ids=prompt.to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=ids.to(device),
        completion_mask=real.to(device),
        group_size=group_size,
        completions=tokenizer.batch_decode(rows, skip_special_tokens=True),
        truncated=torch.tensor([c is not None and c.budget_hit for c in chains], device=device),
        model_mask=model.to(device),
        tool_stats={key: torch.tensor(values, device=device) for key, values in stats.items()},
        tool_calls=calls,
        transcripts=[_transcript(c) for c in chains],
        environments=outcomes,
    )


def shared_head(group: list[Chain | None], outcomes: list[AgentOutcome]) -> list[int]:
    """The longest prefix of the group's first prompts; an episode sharing not even the first
    token with the group's first one fails (its group's prompt would be empty)."""
    firsts = [(k, c.calls[0].prompt_ids) for k, c in enumerate(group) if c is not None]
    if not firsts:
        return []
    head = firsts[0][1]
    for k, ids in firsts:
        if ids[0] != head[0]:
            outcomes[k].error = "its first prompt shares no token with its group's first episode's"
            continue
        n = next((j for j, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids)))
        head = head[:n]
    return head


def _right_padded(
    rows: list[list[int]], sampled: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, Lc) each: the rows right-padded with ``pad``, 1 on their tokens, 1 on their sampled ones."""
    width = max(1, *(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    model = torch.zeros((len(rows), width), dtype=torch.long)
    for n, (row, mask) in enumerate(zip(rows, sampled)):
        ids[n, : len(row)] = torch.tensor(row, dtype=torch.long)
        real[n, : len(row)] = 1
        model[n, : len(row)] = torch.tensor(mask, dtype=torch.long)
    return ids, real, model


def _tool_calls(chain: Chain | None) -> list[dict[str, Any]]:
    """The tool calls of the chain's replies as function tools' calls are logged (name, arguments
    as a dict), each with the result the agent sent back for it (None where it sent none); ``ok``
    is whether a result came back."""
    if chain is None:
        return []
    results: dict[str, Any] = {}
    for call in chain.calls:
        for m in call.messages:
            if m.get("role") == "tool" and m.get("tool_call_id") is not None:
                results[m["tool_call_id"]] = m.get("content")
    entries = []
    for call in chain.calls:
        for c in call.reply.get("tool_calls", []):
            result = results.get(c["id"])
            entries.append(
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]),
                 "result": result, "ok": result is not None}
            )  # fmt: skip
    return entries


def _transcript(chain: Chain | None) -> list[dict[str, Any]]:
    """The episode's turns after its first request's messages, as TRL's messages: the replies and
    what the agent added between them."""
    if chain is None:
        return []
    first, last = chain.calls[0], chain.calls[-1]
    added = [dict(m) for m in last.messages[len(first.messages) :]]
    return [*added, dict(last.reply)]
