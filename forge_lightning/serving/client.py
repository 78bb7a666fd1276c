"""The trainer's engine over N rollout servers: :class:`RemoteEngine`, a
:class:`~forge_lightning.rollout.engines.base.GenerationBackend` whose ``generate`` spreads a
request's prompts over the servers that are alive and whose ``sync_weights`` pushes each new
version of the weights to them.

What it keeps from the in-process engines: with one server in sync mode a request carries the
trainer's CPU generator state and the trainer takes back the state after it, so the server
samples exactly what ``HFGenerate`` would have here; with several, each share of a request has a
seed derived from the run's seed (rollout/async_worker.py's ``rollout_seed``), so a run repeats.

Faults: a server that cannot be reached, or stops answering its probe while it samples, is marked
dead (a warning names it, ``failures`` counts it) and its share of the request goes to the others;
its answer, if any ever came, is never used, so no prompt is lost or sampled twice. With none
left the request fails naming every server. Where the servers run is serving/placement.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.in_flight import Finished, rollout_seed
from forge_lightning.serving.balance import balanced, prompt_cost, share_seed, stream_seed
from forge_lightning.serving.connection import Connection, EventLoop, Server, ServerDown
from forge_lightning.serving.placement import Placement, trainer_rank
from forge_lightning.serving.pusher import WeightPusher, walk_in_step
from forge_lightning.serving.rows import Sampled, joined, padded, rows_by_prompt, unpadded_prompts
from forge_lightning.serving.served_weights import served_tensors
from forge_lightning.serving.wire import (
    GenerateAnswer,
    GenerateCall,
    decode_rng_state,
    differences,
    encode_rng_state,
    fingerprint,
)


class NoServerLeft(RuntimeError):
    """Every rollout server of the run is dead: the fit stops (and saves ``last.ckpt``:
    callbacks/defaults.py)."""


def wait_for_rank_zero() -> None:
    """Every rank of the trainer's world waits here for the others (nothing outside one)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class RemoteEngine:
    """Generation on the rollout servers ``placement`` names (a GenerationBackend).

    ``connect(model)`` (on the first ``generate`` otherwise) starts the servers that placement
    starts itself, refuses any whose model or tokenizer is not the trainer's, naming what differs,
    and pushes the weights as ``version`` (0 in a new run). After each optimizer step
    ``sync_weights`` makes the next version; rank 0 pushes it, and every rank asks the servers
    for at least it (``min_version``), so no rank samples from weights older than its own.
    ``partial``: a request's rows may go on with weights that arrive while they are sampled
    (partial rollouts), each token's version and log-prob kept.
    """

    # Where its rows end (stop strings included) is known from the answer; a tool loop's ending rule
    # and a continuing cache are the caller's (rollout/tool_sampler.py cuts and resends rows).
    capabilities = EngineCapabilities(logprobs=True, stop_strings=True)

    def __init__(
        self,
        placement: Placement,
        tokenizer: Any = None,
        *,
        partial: bool = False,
        probe_timeout_s: float = 5.0,
        probe_every_s: float = 2.0,
    ) -> None:
        self.placement = placement
        self.tokenizer = tokenizer
        self.partial = partial
        self.version = 0  # the newest version of the weights (rank 0 pushed it, or will)
        self.lag = 0  # how many versions behind the newest a server may answer (async rollouts)
        self.servers: list[Server] = []
        self.failures = 0  # servers this process found dead, in all
        self._failures_taken = 0
        self._probe = (probe_timeout_s, probe_every_s)
        self._loop: EventLoop | None = None
        self._http: Connection | None = None
        self._pusher: WeightPusher | None = None
        self._rank = 0
        self._stream = 0  # this rank's sampling seed when the servers get seeds
        self._requests = itertools.count()
        self._tickets: dict[int, Any] = {}
        # The tool loops of async batches (remote_episodes.py's RemoteEpisodes, which imports this).
        self.episodes: Any = None

    # -- connecting -----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return bool(self.servers)

    def connect(self, model: PreTrainedModel, version: int | None = None) -> None:
        """Start (or reach) the servers, check each holds ``model``'s architecture and tokenizer,
        and (rank 0) push ``model``'s weights as ``version`` (default: the current one)."""
        if self.tokenizer is None:
            raise RuntimeError("RemoteEngine needs the policy's tokenizer before it connects: bind() it")
        if version is not None:
            self.version = version
        if self.running:
            return
        self._rank = trainer_rank()
        self._stream = stream_seed(int(os.environ.get("PL_GLOBAL_SEED", "0")), self._rank)
        self._loop, self._http = EventLoop(), Connection(self.placement.secret, *self._probe)
        self.servers = [
            Server(address, name) for name, address in self.placement.start(model, self.tokenizer)
        ]
        self._check_fingerprints(fingerprint(model, self.tokenizer))
        if self._rank == 0:
            self._pusher = WeightPusher(self._http, self._loop, folder=self.placement.folder)
            self._push(model)
        elif is_sharded(model):
            walk_in_step(served_tensors(model))  # rank 0's gathers need every rank
        # No rank asks before the servers hold this version: a server's own weights (a resumed run's
        # servers still hold the killed run's) would answer a request for it otherwise.
        wait_for_rank_zero()

    def bind(self, tokenizer: Any) -> None:
        """The policy's tokenizer, for the fingerprint and the padding of what comes back."""
        self.tokenizer = tokenizer

    def _check_fingerprints(self, mine: dict[str, Any]) -> None:
        """Refuse a server that holds another model or tokenizer; one that cannot be reached is dead."""
        infos = self._loop.run(self._gather(self._http.info))
        for server, info in zip(self.servers, infos):
            if isinstance(info, ServerDown):
                self._mark_dead(server, str(info), 0)
                continue
            if isinstance(info, BaseException):
                raise info
            differ = differences(mine, info.fingerprint)
            if differ:
                raise ValueError(
                    f"rollout server {server.name} holds another model or tokenizer than the trainer's "
                    f"({'; '.join(differ)}): start it with the run's own config and --model flags"
                )
        self._live()  # none left: the error that names them

    async def _gather(self, call: Any) -> list[Any]:
        return await asyncio.gather(*(call(s) for s in self.servers), return_exceptions=True)

    # -- weights ------------------------------------------------------------------------------

    def sync_weights(self, model: PreTrainedModel) -> None:
        """The next version of the weights (after each optimizer step): rank 0 pushes it to every
        live server; the other ranks ask for it with their next requests."""
        if not self.running:
            return
        self.version += 1
        if self._rank == 0:
            self._push(model)
        elif is_sharded(model):
            walk_in_step(served_tensors(model))  # rank 0's gathers need every rank

    def _push(self, model: PreTrainedModel) -> None:
        """``model``'s weights as ``self.version`` to each live server, each over its own group,
        so that a dead one stalls no other; a server that fails its probe or its push is dead."""
        push = self._pusher.push_gathered if is_sharded(model) else self._pusher.push
        # Not self._live(): a sharded push walks the gathers with every rank even with none left.
        for server, problem in push(model, self.version, [s for s in self.servers if s.alive]):
            self._mark_dead(server, problem, 0)
        self._live()

    # -- sampling -------------------------------------------------------------------------------

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        """Sample ``request`` on the servers (``model`` is only used to connect: they hold their
        own weights). One server: with the trainer's generator state, taken back after it."""
        self.capabilities.check(request, type(self).__name__)
        self.connect(model)
        rng = len(self.servers) == 1 and not request.params.greedy
        seed = None if rng else share_seed(self._stream, next(self._requests) + 1)
        state = encode_rng_state(torch.get_rng_state()) if rng else None
        sampled, state = self.sample(request, seed, state)
        if state is not None:
            torch.set_rng_state(decode_rng_state(state))
        return sampled.completions(self._pad_id, request.prompt_ids.device)

    def sample(
        self, request: GenerationRequest, seed: int | None, rng_state: str | None = None
    ) -> tuple[Sampled, str | None]:
        """``request`` sampled on the servers with ``seed`` (or, one server, ``rng_state``), from
        weights within ``lag`` versions of the newest, from any thread: the rows as they came back,
        and the generator state after them where one was sent."""
        prompts = unpadded_prompts(request.prompt_ids, request.prompt_mask)
        return self._loop.run(
            self._sample(prompts, request.group_size, request.params, request.logprobs, seed, rng_state)
        )

    @property
    def _pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    async def _sample(
        self,
        prompts: list[list[int]],
        group_size: int,
        params: SamplingParams,
        logprobs: bool,
        seed: int | None,
        rng_state: str | None = None,
        min_version: int | None = None,
    ) -> tuple[Sampled, str | None]:
        """Every prompt's group sampled by one live server: the shares of a server found dead go
        to the others until every prompt is answered once, or none is left."""
        floor = self.version - self.lag if min_version is None else min_version
        call = GenerateCall("", [], group_size, params, logprobs, seed, rng_state, floor, self.partial)
        costs = [prompt_cost(len(p), params.max_new_tokens, group_size) for p in prompts]
        answered: dict[int, Any] = {}
        todo, state_after, round_ = list(range(len(prompts))), None, 0
        while todo:
            live = self._live()
            shares = balanced([costs[i] for i in todo], [s.outstanding for s in live])
            parts = [(s, [todo[i] for i in share]) for s, share in zip(live, shares) if share]
            calls = [
                self._share(call, [prompts[i] for i in part], n + round_ * len(live))
                for n, (_, part) in enumerate(parts)
            ]
            results = await asyncio.gather(
                *(
                    self._part(server, c, sum(costs[i] for i in part))
                    for (server, part), c in zip(parts, calls)
                ),
                return_exceptions=True,
            )
            todo = []
            for (server, part), result in zip(parts, results):
                if isinstance(result, ServerDown):  # its share goes to the others next round
                    self._mark_dead(server, str(result), len(part))
                    todo += part
                elif isinstance(result, BaseException):
                    raise result
                else:
                    answered.update(rows_by_prompt(part, result, group_size))
                    state_after = result.rng_state
            todo.sort()
            round_ += 1
        return joined(answered, len(prompts), logprobs), state_after

    def _share(self, call: GenerateCall, prompts: list[list[int]], number: int) -> GenerateCall:
        """``call`` for the ``number``-th share of its request (each round of resends numbers on):
        its prompts, its id, and its own seed where the request has one."""
        seed = None if call.seed is None else share_seed(call.seed, number)
        return replace(call, request_id=f"r{self._rank}-{call.seed}-{number}", prompts=prompts, seed=seed)

    async def _part(self, server: Server, call: GenerateCall, cost: int) -> GenerateAnswer:
        server.outstanding += cost
        try:
            return await self._http.generate(server, call)
        finally:
            server.outstanding -= cost

    # -- faults -------------------------------------------------------------------------------

    def _live(self) -> list[Server]:
        """The servers still alive; none is the error that names every one."""
        live = [s for s in self.servers if s.alive]
        if not live:
            names = ", ".join(s.name for s in self.servers) or "none were given"
            raise NoServerLeft(
                f"no rollout server is left (all of {names} stopped answering): restart them, or "
                "resume from last.ckpt with live servers listed"
            )
        return live

    def _mark_dead(self, server: Server, problem: str, prompts: int) -> None:
        if not server.alive:
            return
        server.alive = False
        self.failures += 1
        moved = f"; its {prompts} prompt(s) go to the other servers" if prompts else ""
        warnings.warn(f"rollout server {server.name} is marked dead ({problem}){moved}", stacklevel=3)
        self.placement.lost(server.address)

    def take_failures(self) -> int:
        """The servers found dead since the last call (a training batch's ``server_failures``)."""
        new, self._failures_taken = self.failures - self._failures_taken, self.failures
        return new

    # -- the async pipeline's calls (sources.AsyncRollouts) ------------------------------------

    def submit(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        *,
        seed: int,
        version: int | None = None,
        logprobs: bool = True,
    ) -> int:
        """Hand a batch to the servers, sampled with ``seed`` from weights no more than
        ``lag`` versions older than the newest (or at least ``version``); its ticket."""
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        if self._rank > 0:  # the ranks' batches share their indices in the run: not their draws
            seed = rollout_seed(seed, self._rank)
        ticket = next(self._requests)
        self._tickets[ticket] = self._loop.submit(
            self._sample(prompts, group_size, params, logprobs, seed, min_version=version)
        )
        return ticket

    def submit_episodes(
        self,
        prompts: list[Any],
        rows: dict[str, list[Any]],
        group_size: int,
        params: SamplingParams,
        *,
        seed: int,
    ) -> int:
        """Hand a tool-using batch over: its tool loop runs here, each round sampled by the servers
        (serving/remote_episodes.py, which ``episodes`` holds); its ticket."""
        if self.episodes is None:
            raise RuntimeError("submit_episodes needs the run's tool loop (RemoteEngine.episodes)")
        if self._rank > 0:
            seed = rollout_seed(seed, self._rank)
        ticket = next(self._requests)
        self._tickets[ticket] = self.episodes.submit(prompts, rows, group_size, params, seed)
        return ticket

    def collect(self, ticket: int) -> Finished:
        """Wait for ``ticket``'s rows: ids, the log-probs they were sampled with, the oldest
        version that sampled a token of them, and where each row ends (its EOS or stop string);
        a tool-using batch's whole rollout as its loop made it."""
        result = self._tickets.pop(ticket).result()
        if isinstance(result, Finished):
            return result
        sampled, _ = result
        logp = None if sampled.logp is None else padded(sampled.logp, 0.0, torch.float32)
        ids = padded(sampled.ids, self._pad_id, torch.long)
        ends = torch.tensor([len(row) for row in sampled.ids], dtype=torch.long)
        return Finished(ids, logp, sampled.oldest_version, ends=ends)

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop what placement started (the servers the user started stay up); twice is once."""
        if self.episodes is not None:
            self.episodes.close()
        if self._loop is not None:
            if self._pusher is not None:
                self._pusher.close()
            self._loop.run(self._http.close())
            self._loop.close()
        self._loop = self._http = self._pusher = None
        self.servers, self._tickets = [], {}
        self.placement.close()
