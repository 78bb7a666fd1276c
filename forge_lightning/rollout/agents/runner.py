"""Rollouts of a user's agent: ``async def agent(client, row) -> float`` run G times per prompt,
its calls served by the policy through an OpenAI-compatible endpoint (agents/endpoint.py).

:class:`AgentRunner` is an episode runner (sources.EpisodeRunner) like
:class:`~forge_lightning.rollout.sampler.RolloutSampler` and
:class:`~forge_lightning.rollout.tool_sampler.ToolRolloutSampler`. For a batch it starts the
endpoint, runs every episode concurrently (each with an ``openai.AsyncOpenAI`` client of its own
base URL, and the prompt's row: ``prompt`` and the batch's fields), samples their requests in
batches on this thread, and turns each episode's chain of calls (agents/episodes.py) into one
completion of the :class:`Rollout`: the tokens the policy sampled are trained (``model_mask`` 1),
the turns the agent inserted (tool results, user turns) are read but masked. A group's prompt is the
longest prefix its episodes' first prompts share; the rest of an episode's first prompt opens its
completion, masked.

The agent's return value is the episode's score where the run's reward reads it (each completion's
``environments`` entry is its :class:`AgentOutcome`, whose ``get_reward()``
:class:`~forge_lightning.rewards.environment.EnvironmentReward` reads; ``scored_by_agent``), else
the agent returns None. An agent that raises, returns something else, or makes no call fails its
episode: counted (``agent_errors``), its completion left empty (no token trained) and its score 0.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.agents.endpoint import AgentEndpoint, Pending
from forge_lightning.rollout.agents.episodes import Chain, EpisodeLog
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.rollout.types import Prompt, Rollout, completion_mask, left_pad
from forge_lightning.run.user_code import is_async, trl_kwargs

log = logging.getLogger(__name__)

Agent = Callable[[Any, dict[str, Any]], Any]


def load_agent(path: str) -> Agent:
    """The agent the import path ``path`` (``package.module.function``) names; ValueError naming
    the ``agent`` setting where it is not found or not an ``async def``."""
    module, _, name = str(path).rpartition(".")
    try:
        agent = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"agent={path!r}: cannot import it ({err}); give package.module.function") from err
    if agent is None or not is_async(agent):
        raise ValueError(
            f"agent={path!r} must name an async def agent(client, row) (package.module.function), "
            f"got {agent!r:.100}"
        )
    return agent


@dataclass
class AgentOutcome:
    """How one episode ended: the agent's return value, or why it failed."""

    returned: float | None = None
    error: str | None = None

    def get_reward(self) -> float:
        """The episode's score: what the agent returned; 0 for a failed episode."""
        return 0.0 if self.error is not None or self.returned is None else self.returned


class AgentRunner:
    """Prompts in, a :class:`Rollout` of ``group_size`` agent episodes each out (module docstring).

    Args:
        sampler: the run's sampler: its tokenizer (with a chat template), engine and EOS ids.
        agent: ``async def agent(client, row) -> float | None``.
        scored_by_agent: the agent's return value is the score: it must return a finite number;
            else it must return None (the run's reward scores the episode).
        call_format: how the policy writes a tool call (``tool_call_format``).
    """

    def __init__(
        self, sampler: RolloutSampler, agent: Agent, scored_by_agent: bool = True, call_format: str = "hermes"
    ) -> None:
        if not is_async(agent):
            raise ValueError(
                f"agent {getattr(agent, '__name__', agent)!r} must be an async def agent(client, row): "
                "it is awaited once per episode, with an openai.AsyncOpenAI client"
            )
        if not getattr(sampler.tokenizer, "chat_template", None):
            raise ValueError("an agent's calls are chat messages: the tokenizer needs a chat template")
        self.sampler, self.agent = sampler, agent
        self.scored_by_agent, self.call_format = scored_by_agent, call_format
        self.tokenizer = sampler.tokenizer

    def __call__(
        self,
        model: PreTrainedModel,
        prompts: list[Prompt],
        params: SamplingParams,
        group_size: int,
        engine_logprobs: bool = False,
        rows: dict[str, list[Any]] | None = None,
    ) -> Rollout:
        """Run ``group_size`` episodes of the agent per prompt; ``rows``: the batch's fields."""
        if engine_logprobs:
            raise ValueError("agent rollouts have no engine log-probs: set use_engine_logprobs false")
        if params.stop:
            raise ValueError("agent rollouts do not support stop strings: leave stop empty")
        if is_sharded(model) and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "agent rollouts under a sharded model are not supported: the ranks would make "
                "different numbers of generate calls, and each forward needs all of them"
            )
        keys = [f"{i}-{k}" for i in range(len(prompts)) for k in range(group_size)]
        inputs = [self._row(prompts, rows or {}, i) for i in range(len(prompts)) for _ in range(group_size)]
        with AgentEndpoint(self.tokenizer, self.call_format) as endpoint:
            logs = [endpoint.open(key, params.max_new_tokens) for key in keys]
            episodes = endpoint.run(self._episodes(endpoint, keys, inputs))
            returned = endpoint.serve(episodes, lambda batch: self._generate(model, params, batch))
        outcomes = [self._checked(value) for value in returned]
        device = next(model.parameters()).device
        return self._rollout(prompts, logs, outcomes, group_size, device)

    @staticmethod
    def _row(prompts: list[Prompt], rows: dict[str, list[Any]], i: int) -> dict[str, Any]:
        """Prompt ``i``'s row as the agent gets it: ``prompt`` and the batch's fields (a dataset's
        ``reference`` both as ``references`` and as ``reference``)."""
        return {"prompt": prompts[i], **trl_kwargs({key: values[i] for key, values in rows.items()})}

    async def _episodes(
        self, endpoint: AgentEndpoint, keys: list[str], inputs: list[dict[str, Any]]
    ) -> list[Any]:
        """Every episode at once, their clients on one HTTP connection pool (a pool each costs more
        than a short episode's calls)."""
        from openai import DefaultAsyncHttpxClient  # the dev extra's; an agent written for it has it

        async with DefaultAsyncHttpxClient() as http:
            runs = (self._episode(endpoint, key, row, http) for key, row in zip(keys, inputs))
            return list(await asyncio.gather(*runs))

    async def _episode(self, endpoint: AgentEndpoint, key: str, row: dict[str, Any], http: Any) -> Any:
        """One run of the agent: what it returned, or the error it raised (its episode's failure,
        not the batch's)."""
        from openai import AsyncOpenAI

        url = endpoint.base_url(key)
        client = AsyncOpenAI(base_url=url, api_key="forge-lightning", max_retries=0, http_client=http)
        try:
            return await self.agent(client, dict(row))
        except Exception as err:
            return err
        finally:
            endpoint.ended(key)

    def _checked(self, returned: Any) -> AgentOutcome:
        """What an episode's agent returned (or raised) as its outcome; ValueError where it gives
        a score while the run's reward scores the episodes, or none while it is the score."""
        if isinstance(returned, Exception):
            return AgentOutcome(error=f"raised {returned!r}")
        if returned is None and self.scored_by_agent:
            raise ValueError(
                "the agent returned None: with no reward set (model.reward), the agent's return value "
                "is the episode's score; return a number, or set model.reward to score the episodes"
            )
        if returned is not None and not self.scored_by_agent:
            raise ValueError(
                f"the agent returned {returned!r} while model.reward scores the episodes: two scores "
                "for one episode; return None from the agent, or unset model.reward (or add "
                "EnvironmentReward to it) so that the agent's return value is the score"
            )
        if returned is None:
            return AgentOutcome()
        number = isinstance(returned, numbers.Real) and not isinstance(returned, bool)
        if not number or not math.isfinite(returned):
            return AgentOutcome(error=f"returned {returned!r}, not a finite number")
        return AgentOutcome(returned=float(returned))

    def _generate(
        self, model: PreTrainedModel, params: SamplingParams, batch: list[Pending]
    ) -> list[tuple[list[int], bool]]:
        """One ``generate`` of every request waiting: each completion cut after its first EOS and
        at its own ``max_new_tokens``."""
        device = next(model.parameters()).device
        ids, mask = left_pad([p.prompt_ids for p in batch], self.tokenizer.pad_token_id)
        room = max(p.max_new_tokens for p in batch)
        out = self.sampler.generator.generate(
            model, ids.to(device), mask.to(device), 1, replace(params, max_new_tokens=room)
        )
        ends = completion_mask(out, self.sampler.eos_ids).sum(dim=1).tolist()
        results = []
        for row, pending, end in zip(out.tolist(), batch, ends):
            kept = row[: min(end, pending.max_new_tokens)]
            results.append((kept, bool(kept) and kept[-1] in self.sampler.eos_ids))
        return results

    def _rollout(
        self,
        prompts: list[Prompt],
        logs: list[EpisodeLog],
        outcomes: list[AgentOutcome],
        group_size: int,
        device: torch.device,
    ) -> Rollout:
        """The episodes as a Rollout (module docstring)."""
        chains: list[Chain | None] = []
        for outcome, episode_log in zip(outcomes, logs):
            chain = episode_log.episode()
            if chain is None and outcome.error is None:
                outcome.error = "made no call to the endpoint"
            chains.append(None if outcome.error is not None else chain)
        heads, rows, sampled = [], [], []
        for i in range(len(prompts)):
            group = slice(i * group_size, (i + 1) * group_size)
            head = self._shared_head(chains[group], outcomes[group])
            heads.append(head or self.sampler.encode([prompts[i]], torch.device("cpu"))[0][0].tolist())
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
        return self._assemble(heads, rows, sampled, chains, logs, outcomes, group_size, dropped, device)

    @staticmethod
    def _shared_head(group: list[Chain | None], outcomes: list[AgentOutcome]) -> list[int]:
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

    def _assemble(
        self,
        heads: list[list[int]],
        rows: list[list[int]],
        sampled: list[list[int]],
        chains: list[Chain | None],
        logs: list[EpisodeLog],
        outcomes: list[AgentOutcome],
        group_size: int,
        dropped: list[int],
        device: torch.device,
    ) -> Rollout:
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad(heads, pad)
        width = max(1, *(len(r) for r in rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        real = torch.zeros((len(rows), width), dtype=torch.long)
        model = torch.zeros((len(rows), width), dtype=torch.long)
        for n, (row, mask) in enumerate(zip(rows, sampled)):
            ids[n, : len(row)] = torch.tensor(row, dtype=torch.long)
            real[n, : len(row)] = 1
            model[n, : len(row)] = torch.tensor(mask, dtype=torch.long)
        calls = [_tool_calls(c) for c in chains]
        stats = {
            "tool_calls": [len(c) for c in calls],
            "turns": [0 if c is None else len(c.calls) for c in chains],
            "agent_errors": [int(o.error is not None) for o in outcomes],
            "agent_calls_dropped": dropped,
        }
        return Rollout(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=ids.to(device),
            completion_mask=real.to(device),
            group_size=group_size,
            completions=self.tokenizer.batch_decode(rows, skip_special_tokens=True),
            truncated=torch.tensor([c is not None and c.budget_hit for c in chains], device=device),
            model_mask=model.to(device),
            tool_stats={key: torch.tensor(values, device=device) for key, values in stats.items()},
            tool_calls=calls,
            transcripts=[_transcript(c) for c in chains],
            environments=outcomes,
        )


def _tool_calls(chain: Chain | None) -> list[dict[str, Any]]:
    """The tool calls of the chain's replies, each with the result the agent sent back for it
    (None where it sent none); ``ok`` is whether a result came back."""
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
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"], "result": result,
                 "ok": result is not None}
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
