"""Tool-using rollouts: completions that call tools while they are sampled.

:class:`ToolRolloutSampler` is an episode runner (sources.EpisodeRunner) like
:class:`~forge_lightning.rollout.sampler.RolloutSampler`, whose encoding and engine it uses. Its first round
is the usual ``generate`` of G completions per prompt, with a stop at each call; the tool's answer
is tokenised (tools/protocol.py's protocol says how: the calculator's text alone, a function's result as
the chat template's ``tool`` turn) and appended to the calls' rows, and the unfinished rows
generate again until every row has ended: on HF generate from the last round's KV cache (only the
new tokens go through the model), elsewhere from their whole sequence so far. Asked for the
engine's log-probs (for the old policy's, or the rollout correction's), each round reports those of
the tokens it sampled; a tool's tokens get 0, and the loss gives them no weight. The calls of every
row that waits at the end of a round are answered at once (the tools may run them concurrently).
Everything happens in token ids: the transcript is never re-tokenised, so the log-prob forward
scores exactly the tokens that were sampled. The answer's tokens are in the completion (the model
reads them, the reward sees them) but not in the loss: ``Rollout.model_mask`` is 0 on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, StoppingCriteria

from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.rollout.tools.calculator import CalculatorTools, InlineCalculator
from forge_lightning.rollout.tools.protocol import Episode, ToolProtocol
from forge_lightning.rollout.types import Prompt, Rollout, left_pad

# A round on a cached engine ends once this share of its rows that have not ended wait for a tool:
# a waiting row idles while the others write, and going on costs the next round only a forward
# of its new tokens.
CUT_SHARE = 0.25


class RoundCut(StoppingCriteria):
    """The tools' stop (``inner``: rows at a call) for one ``generate`` call, which also ends the
    whole call (``cut``) once ``CUT_SHARE`` of the rows that have not ended (an EOS after no
    call) wait."""

    def __init__(self, inner: StoppingCriteria, eos_ids: Sequence[int]) -> None:
        self.inner, self.eos = inner, torch.tensor(sorted(eos_ids))
        self.waiting: Tensor | None = None  # (B,) bool, rows stopped at a call
        self.ended: Tensor | None = None  # (B,) bool, rows that wrote an EOS with no call before it
        self.cut = False

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs) -> Tensor:
        at_call = self.inner(input_ids, scores, **kwargs).cpu()
        last = input_ids[:, -1].cpu()
        if self.waiting is None:
            self.waiting = torch.zeros_like(at_call)
            self.ended = torch.zeros_like(at_call)
        self.waiting |= at_call  # a turn that ends with its calls waits (function tools' EOS)
        self.ended |= torch.isin(last, self.eos) & ~self.waiting
        going = int((~self.ended).sum())
        if self.waiting.any() and int(self.waiting.sum()) >= CUT_SHARE * going:
            self.cut = True
            return torch.ones_like(at_call).to(input_ids.device)
        return at_call.to(input_ids.device)


class ToolRolloutSampler:
    """Prompts in, a :class:`Rollout` of completions that may call ``tools`` out (a
    :class:`~forge_lightning.rollout.tools.protocol.ToolProtocol`; an InlineCalculator is its
    CalculatorTools).

    ``max_new_tokens`` is each completion's budget over all its rounds, the policy's tokens and the
    tools' together; an answer that would cross it is cut and the completion counts as
    truncated. A completion makes at most ``max_tool_calls`` calls; after that a call is just text
    (a turn that wrote several calls past it has the extra ones answered as errors, not run).
    A failed call (a refused expression, a tool that raised) is answered and counted in ``tool_errors``;
    one abandoned at its timeout in this process, whose thread runs on, in ``tool_threads_abandoned`` too.
    """

    def __init__(
        self, sampler: RolloutSampler, tools: ToolProtocol | InlineCalculator, max_tool_calls: int = 4
    ) -> None:
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        self.sampler = sampler
        if isinstance(tools, InlineCalculator):
            tools = CalculatorTools(tools, sampler.tokenizer)
        self.tools = tools
        self.max_tool_calls = max_tool_calls
        # An engine that cannot stop rows at a call still works: a calculator row is cut at its
        # first call below (it just samples tokens that are thrown away); a function tool's turn
        # ends at its EOS on every engine.
        capabilities = sampler.generator.capabilities
        self._engine_stops = capabilities.stop_rule
        # HF generate also hands back its KV cache, so that a round goes on from the last one's.
        self._engine_continues = capabilities.stop_rule and capabilities.continues

    def __call__(
        self,
        model: PreTrainedModel,
        prompts: list[Prompt],
        params: SamplingParams,
        group_size: int,
        engine_logprobs: bool = False,
        rows: dict[str, list[Any]] | None = None,
    ) -> Rollout:
        """Sample ``group_size`` completions per prompt, each calling the tools as it writes;
        ``rows``: the batch's fields (an environment's ``reset`` takes its prompt's). With
        ``engine_logprobs`` the rollout's ``old_logp`` holds the engine's log-prob of each token
        the policy sampled, 0 on the tools' tokens (which the loss mask leaves out)."""
        generator = self.sampler.generator
        if engine_logprobs and not generator.capabilities.logprobs:
            raise ValueError(
                f"use_engine_logprobs/rollout_correction need an engine that reports log-probs "
                f"(its capabilities' logprobs); {type(generator).__name__} does not"
            )
        if params.stop:
            # A round's rows would end at a stop string with no end an episode could read.
            raise ValueError("tool-using rollouts do not support stop strings: leave stop empty")
        if is_sharded(model) and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "tool-using rollouts under a sharded model are not supported: the ranks would make "
                "different numbers of generate calls, and each forward needs all of them"
            )
        device = next(model.parameters()).device
        prompt_ids, prompt_mask, contexts = self.tools.begin(
            self.sampler, prompts, rows or {}, group_size, device
        )
        episodes = [Episode(context=context, max_calls=self.max_tool_calls) for context in contexts]
        run = self._run_cached if self._engine_continues else self._run
        run(model, prompt_ids, prompt_mask, group_size, params, episodes, engine_logprobs)
        return self._rollout(
            prompt_ids, prompt_mask, episodes, group_size, params.max_new_tokens, engine_logprobs
        )

    def _run_cached(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        episodes: list[Episode],
        logprobs: bool = False,
    ) -> None:
        """The rounds on an engine that hands back its KV cache (HF generate): each round goes on
        from the last one's cache, so only a row's new tokens (the tool's answer, the token
        sampled last) go through the model; and a round ends once ``CUT_SHARE`` of its rows that
        have not ended wait for a tool, the others going on in the next round where they are."""
        budget = params.max_new_tokens
        rows = list(range(len(episodes)))  # the episode of each batch row
        ids, mask, cache, groups = prompt_ids, prompt_mask, None, group_size
        while rows:
            room = max(budget - len(episodes[r].ids) for r in rows)
            stop = RoundCut(self._stop(ids.shape[1], [episodes[r] for r in rows]), self.sampler.eos_ids)
            request = GenerationRequest(
                ids,
                mask,
                groups,
                replace(params, max_new_tokens=room),
                logprobs=logprobs,
                stop_rule=[stop],
                continuing=True,
                cache=cache,
            )
            out = self.sampler.generator.generate(model, request)
            cache, logp = out.cache, out.logp
            # (B, L): the input (a first round's G-fold, as generate repeats it), then the new tokens
            sequences = torch.cat([ids.repeat_interleave(groups, dim=0), out.ids], dim=1)
            if groups > 1:
                mask = mask.repeat_interleave(groups, dim=0)  # the first round's prompts, G-fold
            groups, width = 1, ids.shape[1]
            cached = cache.get_seq_length()
            mask = torch.cat([mask, torch.zeros_like(sequences[:, width:])], dim=1)
            before = [len(episodes[row].ids) for row in rows]
            stops = [
                (
                    episodes[row],
                    self._take(
                        episodes[row],
                        sequences[k, width:].tolist(),
                        budget,
                        stop.cut,
                        None if logp is None else logp[k].tolist(),
                    ),
                )
                for k, row in enumerate(rows)
            ]
            self._answer([(e, call) for e, call in stops if call is not None], budget)
            kept, pending = [], []
            for k, row in enumerate(rows):
                e = episodes[row]
                taken = sum(e.model[before[k] :])  # this round's sampled tokens come first
                mask[k, width : width + taken] = 1
                if not e.done:
                    # What the cache lacks: the row's real tokens past it, then the tool's answer.
                    tail = sequences[k, cached:][mask[k, cached:].bool()].tolist()
                    kept.append(k)
                    pending.append(tail + e.ids[before[k] + taken :])
            if not kept:
                return
            keep = torch.tensor(kept, device=sequences.device)
            block, block_mask = left_pad(pending, self.sampler.tokenizer.pad_token_id)
            ids = torch.cat([sequences[keep, :cached], block.to(sequences.device)], dim=1)
            mask = torch.cat([mask[keep, :cached], block_mask.to(sequences.device)], dim=1)
            cache.batch_select_indices(keep)
            rows = [rows[k] for k in kept]

    def _run(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        episodes: list[Episode],
        logprobs: bool = False,
    ) -> None:
        """The rounds on an engine with no cache to go on from: each round reads the unfinished
        rows whole again, left-padded."""
        heads = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        budget = params.max_new_tokens
        rows = list(range(len(episodes)))
        new, logp = self._generate(model, prompt_ids, prompt_mask, group_size, params, episodes, logprobs)
        while rows:
            stops = [
                (episodes[row], self._take(episodes[row], ids, budget, logp=lp))
                for row, ids, lp in zip(rows, new, logp)
            ]
            self._answer([(e, call) for e, call in stops if call is not None], budget)
            rows = [r for r, e in enumerate(episodes) if not e.done]
            if rows:
                sequences = [heads[r // group_size] + episodes[r].ids for r in rows]
                ids, mask = left_pad(sequences, self.sampler.tokenizer.pad_token_id)
                room = max(budget - len(episodes[r].ids) for r in rows)
                new, logp = self._generate(
                    model,
                    ids.to(prompt_ids.device),
                    mask.to(prompt_ids.device),
                    1,
                    replace(params, max_new_tokens=room),
                    [episodes[r] for r in rows],
                    logprobs,
                )

    def _generate(
        self,
        model: PreTrainedModel,
        input_ids: Tensor,
        input_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        episodes: list[Episode],
        logprobs: bool = False,
    ) -> tuple[list[list[int]], list[list[float] | None]]:
        """One round's new tokens of the rows ``episodes`` (in order), stopped at calls where the
        engine can stop rows, and each row's log-probs of them (``logprobs``; else None). Another
        engine's rows are cut at their call here."""
        stop_rule = [self._stop(input_ids.shape[1], episodes)] if self._engine_stops else []
        request = GenerationRequest(
            input_ids, input_mask, group_size, params, logprobs=logprobs, stop_rule=stop_rule
        )
        out = self.sampler.generator.generate(model, request)
        logp = [None] * out.ids.shape[0] if out.logp is None else out.logp.tolist()
        return out.ids.tolist(), logp

    def _stop(self, start: int, episodes: list[Episode]) -> StoppingCriteria:
        """The tools' stop for a ``generate`` of the rows ``episodes`` whose input is ``start`` wide."""
        enabled = [e.calls < self.max_tool_calls for e in episodes]
        prior, segments = [len(e.ids) for e in episodes], [e.segment for e in episodes]
        return self.tools.stop(start, prior, enabled, segments, self.sampler.eos_ids)

    def _take(
        self,
        episode: Episode,
        new: list[int],
        budget: int,
        resumable: bool = False,
        logp: list[float] | None = None,
    ) -> Any | None:
        """Add a round's tokens (with the engine's ``logp`` of each, if reported) to ``episode`` up
        to its stop (an EOS, a call, the budget; what the engine wrote after it is padding); the
        call to answer when the stop is one with room left. ``resumable``: the round was cut, and
        a row with none of those stops goes on."""
        if not episode.model or not episode.model[-1]:
            episode.turns += 1  # the policy's first turn, or its turn after a tool's answer
        room = budget - len(episode.ids)
        may_call = episode.calls < self.max_tool_calls
        call, taken = None, new[:room]
        for k, token in enumerate(taken):
            if token in self.sampler.eos_ids:
                taken, episode.ended_with_eos = taken[: k + 1], True
                if may_call and self.tools.calls_before_eos:  # a call, then the end of the turn
                    call = self.tools.call_at(episode, episode.ids + taken[:k])
                break
            if may_call and self.tools.may_end_a_call(token):
                call = self.tools.call_at(episode, episode.ids + taken[: k + 1])
                if call is not None:
                    taken = taken[: k + 1]
                    break
        episode.add(taken, sampled=True, logp=logp)
        room -= len(taken)
        if call is None or room <= 0:
            # An EOS, the budget spent, or (an engine's early stop) nothing more; unless the round
            # was cut while this row was still writing.
            episode.done = not (resumable and call is None and room > 0 and not episode.ended_with_eos)
            return None
        return call

    def _answer(self, calls: list[tuple[Episode, Any]], budget: int) -> None:
        """Answer the calls of every row that stopped at one, at once, and append each answer
        (cut to the row's budget)."""
        if not calls:
            return
        for (episode, _), answer in zip(calls, self.tools.answer(calls)):
            room = budget - len(episode.ids)
            episode.calls += len(answer.entries)  # a turn may have written several
            episode.errors += sum(not entry["ok"] for entry in answer.entries)
            episode.log += answer.entries
            episode.ended_with_eos = False  # the turn goes on after the answer
            episode.add(answer.ids[:room], sampled=False)
            if answer.ends_turn:
                episode.segment = len(episode.ids)
            episode.done = len(answer.ids) >= room

    def _rollout(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        episodes: list[Episode],
        group_size: int,
        budget: int,
        logprobs: bool = False,
    ) -> Rollout:
        """The episodes as a :class:`Rollout`: right-padded ids, the completion mask on every real
        token, the model mask on the sampled ones, the decoded transcripts, and (``logprobs``) the
        engine's log-probs as ``old_logp``, 0 on the tools' tokens and the padding."""
        device = prompt_ids.device
        pad = self.sampler.tokenizer.pad_token_id
        width = max(1, *(len(e.ids) for e in episodes))
        ids = torch.full((len(episodes), width), pad, dtype=torch.long)
        real = torch.zeros((len(episodes), width), dtype=torch.long)
        sampled = torch.zeros((len(episodes), width), dtype=torch.long)
        logp = torch.zeros((len(episodes), width), dtype=torch.float32)
        for row, e in enumerate(episodes):
            ids[row, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
            real[row, : len(e.ids)] = 1
            sampled[row, : len(e.ids)] = torch.tensor(e.model, dtype=torch.long)
            logp[row, : len(e.ids)] = torch.tensor(e.logp, dtype=torch.float32)
        truncated = [not e.ended_with_eos and len(e.ids) >= budget for e in episodes]
        texts = self.sampler.tokenizer.batch_decode([e.ids for e in episodes], skip_special_tokens=True)
        per_tool = {
            f"tool_calls/{name}": torch.tensor([sum(c["name"] == name for c in e.log) for e in episodes])
            for name in self.tools.names
        }
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=ids.to(device),
            completion_mask=real.to(device),
            group_size=group_size,
            completions=texts,
            truncated=torch.tensor(truncated, device=device),
            model_mask=sampled.to(device),
            old_logp=logp.to(device) if logprobs else None,
            tool_stats={
                "tool_calls": torch.tensor([e.calls for e in episodes], device=device),
                "tool_errors": torch.tensor([e.errors for e in episodes], device=device),
                "turns": torch.tensor([e.turns for e in episodes], device=device),
                "tool_results_cut": torch.tensor(
                    [sum(bool(c.get("truncated")) for c in e.log) for e in episodes], device=device
                ),
                "tool_threads_abandoned": torch.tensor(
                    [sum(bool(c.get("abandoned")) for c in e.log) for e in episodes], device=device
                ),
                **{key: counts.to(device) for key, counts in per_tool.items()},
            },
            tool_calls=[e.log for e in episodes],
            transcripts=[self._transcript(e) for e in episodes],
            environments=[getattr(e.context, "environment", None) for e in episodes],
        )

    def _transcript(self, episode: Episode) -> list[dict[str, Any]]:
        """``episode`` as TRL's messages: its finished assistant and tool turns, then the last
        assistant turn (a calculator's completion is one turn, its answers inline)."""
        last = episode.ids[episode.segment :]
        if episode.messages and not last:
            return list(episode.messages)
        text = self.sampler.tokenizer.decode(last, skip_special_tokens=True)
        return [*episode.messages, {"role": "assistant", "content": text}]
