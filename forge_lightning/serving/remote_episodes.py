"""Tool episodes of asynchronous rollouts on the rollout servers.

In async mode a batch's tool loop runs here, on the trainer's side, in a
thread of its own while the trainer trains: each round of the loop is one request to the servers
(:class:`EpisodeEngine`), and the calls are answered by the run's own tools, in this process or in
its isolation workers, as in sync mode. So no tool's state, and no tool, goes to a server: a server samples
tokens and nothing else.

Each batch's episodes run in the order they were handed over, one batch at a time; each round is
seeded from the batch's seed and the round's number, so a run repeats. A round may be answered
by weights up to the staleness bound behind the newest (partial rollouts: even newer ones mid-row);
the batch's version is the oldest that sampled any of its tokens, which the pipeline
(rollout/sources.py's AsyncRollouts) holds against the bound as it does for a batch without tools.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import Completions, GenerationRequest, SamplingParams
from forge_lightning.rollout.in_flight import Finished
from forge_lightning.rollout.sources import on_device
from forge_lightning.serving.balance import share_seed

if TYPE_CHECKING:
    from forge_lightning.rollout.sources import EpisodeRunner
    from forge_lightning.serving.client import RemoteEngine


class EpisodeEngine:
    """The servers as one batch's engine: each ``generate`` (a round of the tool loop) is a request
    seeded from the batch's seed and the round's number; ``oldest`` is the oldest version of the
    weights that sampled a token of the batch so far."""

    def __init__(self, remote: RemoteEngine) -> None:
        self.remote = remote
        self.capabilities = remote.capabilities
        self.seed, self.oldest = 0, -1
        self._rounds = itertools.count()

    def begin(self, seed: int) -> None:
        """A new batch, seeded ``seed``."""
        self.seed, self.oldest, self._rounds = seed, -1, itertools.count()

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        self.capabilities.check(request, type(self).__name__)
        sampled, _ = self.remote.sample(request, share_seed(self.seed, next(self._rounds)))
        if sampled.oldest_version >= 0:
            known = [v for v in (self.oldest, sampled.oldest_version) if v >= 0]
            self.oldest = min(known)
        return sampled.completions(self.remote._pad_id, request.prompt_ids.device)

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Nothing: the servers get the weights from the trainer's RemoteEngine."""


class RemoteEpisodes:
    """Runs the tool loop of each batch handed over, in order, in a daemon thread, with the
    servers as its engine; ``runner``: the run's episode runner around an :class:`EpisodeEngine`
    (settings/assembly.py's tools, built by the source), ``model``: the trainer's policy, which
    the loop reads its device from (the servers hold their own weights)."""

    def __init__(self, engine: EpisodeEngine, runner: EpisodeRunner, model: PreTrainedModel) -> None:
        self.engine, self.runner, self.model = engine, runner, model
        self._jobs: queue.Queue[tuple[Future[Finished], tuple[Any, ...]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(
        self,
        prompts: list[Any],
        rows: dict[str, list[Any]],
        group: int,
        params: SamplingParams,
        seed: int,
    ) -> Future[Finished]:
        """The batch's episodes, to be run after those handed before; its future ``Finished``."""
        if self._thread is None or not self._thread.is_alive():  # the first batch, or a fit after close
            self._thread = threading.Thread(
                target=self._run, args=(self._jobs,), name="forge-episodes", daemon=True
            )
            self._thread.start()
        future: Future[Finished] = Future()
        self._jobs.put((future, (prompts, rows, group, params, seed)))
        return future

    def _run(self, jobs: queue.Queue) -> None:
        while (job := jobs.get()) is not None:
            future, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._episodes(*args))
            except BaseException as error:  # noqa: BLE001 (the trainer raises it at collect)
                future.set_exception(error)

    def _episodes(
        self,
        prompts: list[Any],
        rows: dict[str, list[Any]],
        group: int,
        params: SamplingParams,
        seed: int,
    ) -> Finished:
        """One batch's tool loop: the rollout, on the CPU as the pipeline keeps it, with the
        servers' log-prob of each sampled token (0 on a tool's) as the sampling policy's."""
        self.engine.begin(seed)
        rollout = self.runner(self.model, prompts, params, group, engine_logprobs=True, rows=rows)
        behav = None if rollout.old_logp is None else rollout.old_logp.cpu()
        # on_device leaves old_logp as it is: the servers' scores go back as behav, not as the old policy's.
        rollout = replace(on_device(rollout, torch.device("cpu"), None), old_logp=None)
        return Finished(rollout.completion_ids, behav, self.engine.oldest, rollout=rollout)

    def close(self) -> None:
        """Cancel what has not started and end the thread once the batch it runs is done (its
        requests fail once the servers' connection is closed)."""
        jobs, self._jobs, self._thread = self._jobs, queue.Queue(), None
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        jobs.put(None)
