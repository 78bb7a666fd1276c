"""The rollout sources of a run whose rollouts are sampled by rollout servers (serving/):
the synchronous and asynchronous sources of rollout/sources.py with a :class:`RemoteEngine` for
their engine. They connect it when the fit starts (the servers get the weights the fit starts
from, a resumed checkpoint's included), add each batch's ``server_failures`` to its metrics and
end what was started when the fit ends, however it ends. Async rollouts always run here: with no
servers listed, on one ``local:1`` server (settings/assembly.py), a child process beside the
trainer that takes half of its CPU threads, as the in-process rollout worker it replaced did."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_lightning.rollout.in_flight import split_threads
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.rollout.sources import (
    AsyncRollouts,
    EpisodeRunner,
    SyncRollouts,
    TrainingBatch,
    TrainingLoop,
)
from forge_lightning.run.fit import FitShape
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig
from forge_lightning.serving.remote_episodes import EpisodeEngine, RemoteEpisodes


def remote_engine(
    servers: list[str], serve: ServeConfig, spec: str | None, partial: bool, lag: int
) -> RemoteEngine:
    """The engine sampling on ``servers`` (placement.py's entries), which started servers run with
    ``serve``; ``spec``: the module's model spec (None for a model given as an object);
    ``partial``: partial rollouts; ``lag``: the versions a server may answer behind the newest
    (async)."""
    engine = RemoteEngine(Placement(servers, serve, spec), partial=partial)
    engine.lag = lag
    return engine


class RemoteSource:
    """What both remote sources add to theirs (a mixin before the rollout/sources.py class)."""

    remote: RemoteEngine

    def __init__(self, remote: RemoteEngine, *args: Any, **kwargs: Any) -> None:
        """``remote`` samples; the rest are the rollout/sources.py class's own arguments."""
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.engine = self.remote = remote

    def prepare(
        self,
        tokenizer: Any,
        model: PreTrainedModel,
        eos: list[int],
        prompts: PromptFormat,
        scoring_temperature: float,
        episodes: Callable[[RolloutSampler], EpisodeRunner],
        tools: Any = None,
    ) -> None:
        self.remote.bind(tokenizer)
        super().prepare(tokenizer, model, eos, prompts, scoring_temperature, episodes, tools)  # type: ignore[misc]

    def connect(self, fit: FitShape, model: PreTrainedModel, sharded: bool) -> None:
        if fit.root_dir is not None:
            self.remote.placement.folder = Path(fit.root_dir) / "servers"
        self.remote.connect(model)

    def counted(self, batches: Iterator[TrainingBatch]) -> Iterator[TrainingBatch]:
        """``batches``, each with the servers found dead since the previous one."""
        for batch in batches:
            batch.metrics["server_failures"] = float(self.remote.take_failures())
            yield batch

    @property
    def runs_a_worker(self) -> bool:
        return True  # servers run: a failed fit must end them, and none of the trainer's memory samples


class RemoteSyncRollouts(RemoteSource, SyncRollouts):
    """Each batch sampled by the servers when it trains."""

    def on_fit_start(self, fit: FitShape, model: PreTrainedModel, sharded: bool) -> None:
        self.connect(fit, model, sharded)

    def rollouts(
        self, batch: TrainingBatch, loop: TrainingLoop, model: PreTrainedModel
    ) -> Iterator[TrainingBatch]:
        return self.counted(super().rollouts(batch, loop, model))

    def close(self) -> None:
        self.remote.close()


class RemoteAsyncRollouts(RemoteSource, AsyncRollouts):
    """Each batch handed to the servers, sampled from weights at most ``lag`` versions old and
    trained that many optimizer steps later (rollout/sources.py's pipeline). Every trainer rank
    runs its own pipeline, so DDP works as with one rank. A run with tools runs each batch's tool
    loop here, in a thread, each round a request to the servers (remote_episodes.py). Servers
    it starts on this machine's CPU take their threads from the trainer's (:meth:`on_fit_start`)."""

    _threads_before: int | None = None

    def prepare(
        self,
        tokenizer: Any,
        model: PreTrainedModel,
        eos: list[int],
        prompts: PromptFormat,
        scoring_temperature: float,
        episodes: Callable[[RolloutSampler], EpisodeRunner],
        tools: Any = None,
    ) -> None:
        super().prepare(tokenizer, model, eos, prompts, scoring_temperature, episodes, tools)
        if tools is not None:  # the same tools as sync mode's, around an engine of their own
            engine = EpisodeEngine(self.remote)
            runner = episodes(RolloutSampler(tokenizer, engine, eos, prompts))
            self.remote.episodes = RemoteEpisodes(engine, runner, model)

    def on_fit_start(self, fit: FitShape, model: PreTrainedModel, sharded: bool) -> None:
        super().on_fit_start(fit, model, sharded)  # the pipeline's warning
        # The servers started on this machine's CPU sample while the trainer trains: the trainer
        # keeps the threads they do not take (at least one).
        beside = self.remote.placement.cpu_threads_here()
        if beside:
            total = torch.get_num_threads()
            self._threads_before = total
            torch.set_num_threads(split_threads(total, beside)[0])
        self.connect(fit, model, sharded)

    def rollouts(
        self, batch: TrainingBatch, loop: TrainingLoop, model: PreTrainedModel
    ) -> Iterator[TrainingBatch]:
        return self.counted(super().rollouts(batch, loop, model))

    def close(self) -> None:
        super().close()
        self.remote.close()
        if self._threads_before is not None:  # the trainer's threads back
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
