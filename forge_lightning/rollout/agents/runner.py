"""Rollouts of a user's agent: ``async def agent(client, row) -> float`` run G times per prompt,
its calls served by the policy through an OpenAI-compatible endpoint (agents/endpoint.py).

:class:`AgentRunner` is an episode runner (sources.EpisodeRunner) like
:class:`~forge_lightning.rollout.sampler.RolloutSampler` and
:class:`~forge_lightning.rollout.tool_sampler.ToolRolloutSampler`. For a batch it starts the
endpoint, runs every episode concurrently (each with an ``openai.AsyncOpenAI`` client of its own
base URL that carries the endpoint's key, and the prompt's row: ``prompt`` and the batch's fields),
samples their requests in
batches on this thread, and turns each episode's chain of calls (agents/episodes.py) into one
completion of the :class:`Rollout` (agents/assemble.py): the tokens the policy sampled are trained
(``model_mask`` 1), the turns the agent inserted (tool results, user turns) are read but masked.

The agent's return value is the episode's score where the run's reward reads it (each completion's
``environments`` entry is its :class:`AgentOutcome`, whose ``get_reward()``
:class:`~forge_lightning.rewards.environment.EnvironmentReward` reads; ``scored_by_agent``), else
the agent returns None. An agent that raises, returns something else, or makes no call fails its
episode: counted (``agent_errors``), its completion left empty (no token trained) and its score 0.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import numbers
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.agents.assemble import AgentOutcome, episodes_rollout
from forge_lightning.rollout.agents.endpoint import AgentEndpoint, Pending
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.rollout.types import Prompt, Rollout, completion_mask, left_pad
from forge_lightning.run.user_code import is_async, trl_kwargs

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


class AgentRunner:
    """Prompts in, a :class:`Rollout` of ``group_size`` agent episodes each out (module docstring).

    Args:
        sampler: the run's sampler: its tokenizer (with a chat template), engine and EOS ids.
        agent: ``async def agent(client, row) -> float | None``.
        scored_by_agent: the agent's return value is the score: it must return a finite number;
            else it must return None (the run's reward scores the episode).
        call_format: how the policy writes a tool call (a name in rollout/tools/parsers.py).
        timeout: seconds an episode may take; a longer one is cancelled and fails. None: no limit.
    """

    def __init__(
        self,
        sampler: RolloutSampler,
        agent: Agent,
        scored_by_agent: bool = True,
        call_format: str = "hermes",
        timeout: float | None = 600.0,
    ) -> None:
        if not is_async(agent):
            raise ValueError(
                f"agent {getattr(agent, '__name__', agent)!r} must be an async def agent(client, row): "
                "it is awaited once per episode, with an openai.AsyncOpenAI client"
            )
        if not getattr(sampler.tokenizer, "chat_template", None):
            raise ValueError("an agent's calls are chat messages: the tokenizer needs a chat template")
        self.sampler, self.agent = sampler, agent
        self.scored_by_agent, self.call_format, self.timeout = scored_by_agent, call_format, timeout
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
        return episodes_rollout(self.tokenizer, logs, outcomes, group_size, device, self._prompt_ids(prompts))

    def _prompt_ids(self, prompts: list[Prompt]) -> Callable[[int], list[int]]:
        """Prompt ``i``'s ids as the run's prompt format encodes it: the prompt of a group whose
        every episode failed."""
        return lambda i: self.sampler.encode([prompts[i]], torch.device("cpu"))[0][0].tolist()

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
        client = AsyncOpenAI(base_url=url, api_key=endpoint.api_key, max_retries=0, http_client=http)
        try:
            return await asyncio.wait_for(self.agent(client, dict(row)), self.timeout)
        except asyncio.TimeoutError:
            return TimeoutError(f"the episode took longer than agent_timeout={self.timeout:g}s")
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
        at its own ``max_new_tokens``. Requests of one prompt (a group's first calls) are one
        prompt sampled ``len(batch)`` times, which the engine reads once (prefix sharing)."""
        device = next(model.parameters()).device
        prompts = [p.prompt_ids for p in batch]
        alike = all(p == prompts[0] for p in prompts)
        ids, mask = left_pad(prompts[:1] if alike else prompts, self.tokenizer.pad_token_id)
        room = max(p.max_new_tokens for p in batch)
        request = GenerationRequest(
            ids.to(device), mask.to(device), len(batch) if alike else 1, replace(params, max_new_tokens=room)
        )
        out = self.sampler.generator.generate(model, request).ids
        ends = completion_mask(out, self.sampler.eos_ids).sum(dim=1).tolist()
        results = []
        for row, pending, end in zip(out.tolist(), batch, ends):
            kept = row[: min(end, pending.max_new_tokens)]
            results.append((kept, bool(kept) and kept[-1] in self.sampler.eos_ids))
        return results
