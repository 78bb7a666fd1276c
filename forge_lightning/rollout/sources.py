"""Rollout sources: when and where a training batch's prompts are sampled.

The module holds one source, chosen once from its settings, and asks it for the rollouts each
training batch trains on. :class:`SyncRollouts` samples the batch now, in this process.
:class:`AsyncRollouts` hands the batch to the rollout servers (serving/: a ``local:1`` server, a
child process, where none are listed; serving/remote_sources.py gives it their engine) and gives
back the rollouts due, at most ``staleness`` optimizer steps later; it keeps the batches in flight
(rollout/in_flight.py), their seeds, and their checkpoint state.

How one batch of prompts becomes a :class:`~forge_lightning.rollout.types.Rollout` is the *episode
runner*'s (:class:`EpisodeRunner`; today a :class:`~forge_lightning.rollout.sampler.RolloutSampler`, one
``generate`` call): the sources call it, and so do validation and prediction.
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import GenerationBackend, SamplingParams
from forge_lightning.rollout.in_flight import (
    Finished,
    InFlight,
    restored_in_flight,
    rollout_seed,
    saved_in_flight,
)
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.rollout.types import Rollout
from forge_lightning.run.fit import FitShape

if TYPE_CHECKING:
    from forge_lightning.rollout.tools.recipe import ToolRecipe


class EpisodeRunner(Protocol):
    """Prompts in, a :class:`Rollout` of ``group_size`` completions each out (RolloutSampler)."""

    def __call__(
        self,
        model: PreTrainedModel,
        prompts: list[Any],
        params: SamplingParams,
        group_size: int,
        engine_logprobs: bool = False,
        rows: dict[str, list[Any]] | None = None,
    ) -> Rollout: ...


class TrainingLoop(Protocol):
    """What a source reads of the loop around a training batch (training/context.py's StepContext)."""

    global_step: Callable[[], int]  # optimizer steps taken so far
    profile: Callable[[str], AbstractContextManager[Any]]  # a phase's timer
    max_steps: int  # -1: no limit
    max_epochs: int | None
    epoch: int
    num_training_batches: int | float


@dataclass
class TrainingBatch:
    """A batch as Lightning gave it (every key travels with its rollout), once sampled its rollout,
    and what the module logs of how it was sampled."""

    prompts: list[Any]
    batch_kwargs: dict[str, list[Any]]
    batch_idx: int
    rollout: Rollout | None = None
    metrics: dict[str, float] = field(default_factory=dict)


# Builds the engine a source samples with for (tokenizer, model): the registry's, as the module's
# settings name it (settings/assembly.py).
EngineFactory = Callable[[Any, PreTrainedModel], GenerationBackend]


class RolloutSource:
    """Where and when a training batch's rollouts are sampled: the engine and episode runner it
    samples with, the rollouts each batch trains on (:meth:`rollouts`), and its part of the fit
    (its state in checkpoints, its callbacks, its end). :class:`SyncRollouts` and
    :class:`AsyncRollouts` are the two.

    Args:
        sampling: how training's completions are sampled.
        group_size: completions per prompt.
        engine: builds the engine for a module that was given none (None: the source is given
            its engine: the servers', serving/remote_sources.py).
        engine_logprobs: whether the engine's scores are kept as the old policy's log-probs.
        correction: whether the engine's scores are kept as the sampling policy's, for the
            loss's correction of the gap between the engine and the trainer.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        group_size: int,
        engine: EngineFactory | None = None,
        *,
        engine_logprobs: bool = False,
        correction: bool = False,
    ) -> None:
        self.sampling, self.group_size, self.engine_factory = sampling, group_size, engine
        self.engine_logprobs, self.correction = engine_logprobs, correction
        self.runner: EpisodeRunner | None = None
        self.engine: GenerationBackend | None = None
        self.tools: ToolRecipe | None = None  # the run's tools, for an engine that runs their loop
        self.prompt_format: PromptFormat | None = None

    def build_engine(
        self, tokenizer: Any, model: PreTrainedModel, eos: list[int], scoring_temperature: float
    ) -> GenerationBackend:
        """The generation engine for a module that was given none."""
        if self.engine_factory is None:
            raise RuntimeError("this rollout source has no engine: set its engine, or give it a factory")
        return self.engine_factory(tokenizer, model)

    def prepare(
        self,
        tokenizer: Any,
        model: PreTrainedModel,
        eos: list[int],
        prompts: PromptFormat,
        scoring_temperature: float,
        episodes: Callable[[RolloutSampler], EpisodeRunner],
        tools: ToolRecipe | None = None,
    ) -> None:
        """Build the engine (unless one was set before: ``engine``) and the episode runner that
        samples with it, training's, validation's and prediction's: a :class:`RolloutSampler`,
        made what ``episodes`` makes of it (a tool-using runner when the run has tools, which
        ``tools`` names). The engine gets the weights after each optimizer step."""
        self.tools, self.prompt_format = tools, prompts
        if self.engine is None:
            self.engine = self.build_engine(tokenizer, model, eos, scoring_temperature)
        self.runner = episodes(RolloutSampler(tokenizer, self.engine, eos, prompts))

    def rollouts(
        self, batch: TrainingBatch, loop: TrainingLoop, model: PreTrainedModel
    ) -> Iterator[TrainingBatch]:
        """The rollouts ``batch`` trains on (none, one, or several), each with its rollout set."""
        raise NotImplementedError

    def on_fit_start(self, fit: FitShape, model: PreTrainedModel, sharded: bool) -> None:
        pass

    def weights_updated(self, model: PreTrainedModel) -> None:
        self.engine.sync_weights(model)

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def calls_tools(self) -> bool:
        """Whether the episodes call tools (the rewards then get tool_calls, completions, environments)."""
        from forge_lightning.rollout.agents.runner import AgentRunner  # noqa: PLC0415 (sampling alone needs neither)
        from forge_lightning.rollout.tool_sampler import ToolRolloutSampler  # noqa: PLC0415

        return isinstance(self.runner, ToolRolloutSampler | AgentRunner)

    @property
    def runs_a_worker(self) -> bool:
        """Whether processes of their own sample (the rollout servers: a failed fit must stop
        those it started, callbacks/defaults.py; and none of the trainer's memory samples)."""
        return False


class SyncRollouts(RolloutSource):
    """Each batch sampled when it trains, in this process, by the engine the module holds."""

    def rollouts(
        self, batch: TrainingBatch, loop: TrainingLoop, model: PreTrainedModel
    ) -> Iterator[TrainingBatch]:
        """The batch's own rollout, sampled now. With rollout correction, the engine's scores come
        with it as the sampler's log-probs (``behav_logp``), the old policy's left to the trainer."""
        with loop.profile("generate"):
            rollout = self.runner(
                model,
                batch.prompts,
                self.sampling,
                self.group_size,
                engine_logprobs=self.engine_logprobs or self.correction,
                rows=batch.batch_kwargs,
            )
        if self.correction:
            rollout.behav_logp, rollout.old_logp = rollout.old_logp, None
        batch.rollout = rollout
        yield batch


class AsyncEngine(Protocol):
    """What :class:`AsyncRollouts` asks of its engine (serving/client.py's RemoteEngine): batches
    handed over with a ticket and collected by it, sampled from weights at most the pipeline's
    staleness behind ``version``, the newest version pushed."""

    version: int

    def submit(
        self, prompt_ids: Any, prompt_mask: Any, group_size: int, params: SamplingParams, *, seed: int
    ) -> int: ...

    def submit_episodes(
        self, prompts: list[Any], rows: dict[str, Any], group_size: int, params: SamplingParams, *, seed: int
    ) -> int: ...

    def collect(self, ticket: int) -> Finished: ...


class AsyncRollouts(RolloutSource):
    """Each batch handed to the engine (the rollout servers: serving/remote_sources.py's
    RemoteAsyncRollouts gives it), trained ``staleness`` optimizer steps later; the batches in
    flight are kept in checkpoints. With tools the engine runs their loop (on this side, each round
    a request to the servers) and gives the rollout back whole.

    Args (besides the source's):
        accumulation: batches per optimizer step.
        staleness: the most optimizer steps a rollout may lag the weights it trains.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        group_size: int,
        *,
        accumulation: int,
        staleness: int,
        engine_logprobs: bool = False,
        correction: bool = False,
    ) -> None:
        super().__init__(sampling, group_size, engine_logprobs=engine_logprobs, correction=correction)
        self.accumulation, self.staleness = accumulation, staleness
        # The batches handed to the engine and not trained yet, oldest first; how many were
        # handed in the run (the index that seeds each one's sampling); the run's seed.
        self.in_flight: deque[InFlight] = deque()
        self.batches_handed = 0
        self.seed: int | None = None

    def rollouts(
        self, batch: TrainingBatch, loop: TrainingLoop, model: PreTrainedModel
    ) -> Iterator[TrainingBatch]:
        """Hand ``batch`` to the engine, sampled from the newest weights with the seed of its
        index in the run; then yield the rollouts due, oldest first. A rollout trains once the
        ``staleness x accumulation`` batches after it are handed, so it is at most ``staleness``
        optimizer steps old. One older than that (this cadence makes none;
        versions written from elsewhere could) is never trained on: it is sampled again from the
        newest weights, and counted. A batch that would train after ``max_steps`` is not handed."""
        engine: AsyncEngine = self.engine  # type: ignore[assignment]
        device = next(model.parameters()).device
        last = fit_ends_with(loop, batch.batch_idx)  # an epoch's end carries them over
        accumulation = self.accumulation
        ahead = sum(
            accumulation_boundary(e.batch_idx, accumulation, loop.num_training_batches)
            for e in self.in_flight
        )
        handed = loop.max_steps < 0 or loop.global_step() + ahead < loop.max_steps
        with loop.profile("generate"):
            if handed:
                item = InFlight(batch.prompts, batch.batch_kwargs, batch.batch_idx, index=self.batches_handed)
                if self.tools is None:  # with tools their loop encodes the prompts (their schemas)
                    item.prompt_ids, item.prompt_mask = self.runner.encode(item.prompts, device)
                item.ticket = self._hand_over(item)
                self.in_flight.append(item)
                self.batches_handed += 1
        depth = self.staleness * accumulation
        due = len(self.in_flight) if last else max(len(self.in_flight) - depth, 0 if handed else 1)
        for _ in range(min(due, len(self.in_flight))):
            item = self.in_flight.popleft()
            with loop.profile("generate"):
                finished = item.finished or engine.collect(item.ticket)
                regenerated = 0
                if engine.version - finished.version > self.staleness:  # never trained on
                    finished, regenerated = engine.collect(self._hand_over(item)), 1
            lag = engine.version - finished.version
            # At lag 0 the sampling weights are the trained ones: the loss is the synchronous
            # one, unless rollout correction weighs the servers' scores against the trainer's;
            # and with engine_logprobs the scores are the old policy's there, as a sync batch's.
            behav_logp = finished.behav_logp.to(device) if lag or self.correction else None
            if finished.rollout is not None:  # a tool-using batch: its tool loop made it
                rollout = on_device(finished.rollout, device, behav_logp)
            else:
                trusted = self.engine_logprobs and not lag and finished.behav_logp is not None
                ends = finished.ends if self.sampling.stop else None  # stop strings: the engine's ends
                rollout = self.runner.assemble(
                    item.prompt_ids.to(device),
                    item.prompt_mask.to(device),
                    finished.completion_ids.to(device),
                    self.group_size,
                    self.sampling,
                    old_logp=finished.behav_logp.to(device) if trusted else None,
                    behav_logp=behav_logp,
                    ends=None if ends is None else ends.to(device),
                )
            metrics = {
                "staleness": float(lag),
                "staleness_max": float(lag),
                "regenerated": float(regenerated),
                "rollout_wait_s": finished.trainer_wait_s,
            }
            yield TrainingBatch(item.prompts, item.batch_kwargs, item.batch_idx, rollout, metrics)

    def _hand_over(self, item: InFlight) -> int:
        """Submit ``item``'s prompts, sampled from the newest weights with the seed of its index
        in the run (the run's seed: Lightning's ``seed_everything``); the engine's ticket."""
        if self.seed is None:
            self.seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        seed = rollout_seed(self.seed, item.index)
        group, sampling = self.group_size, self.sampling
        if self.tools is not None:
            return self.engine.submit_episodes(item.prompts, item.batch_kwargs, group, sampling, seed=seed)
        return self.engine.submit(item.prompt_ids, item.prompt_mask, group, sampling, seed=seed)

    def on_fit_start(self, fit: FitShape, model: PreTrainedModel, sharded: bool) -> None:
        warn_when_the_end_drains_at_once(fit, self.staleness)

    def state_dict(self) -> dict[str, Any]:
        """The batches in flight, finished and kept: regenerating them after a resume would need
        the older weights that sampled them. The data position is Lightning's, the batch after the
        last one handed."""
        for item in self.in_flight:
            item.finished = item.finished or self.engine.collect(item.ticket)
        return {
            "version": self.engine.version,
            "batches_handed": self.batches_handed,
            "seed": self.seed,
            "in_flight": saved_in_flight(self.in_flight),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.engine is None:
            return
        self.engine.version = state["version"]
        self.batches_handed = state["batches_handed"]
        self.seed = state["seed"]
        self.in_flight = deque(restored_in_flight(state["in_flight"]))

    def close(self) -> None:
        """Forget the batches in flight: what was in flight when a fit ended early (max_time, an
        error) is not trained, the checkpoint it resumes from holds its own."""
        self.in_flight.clear()

    @property
    def runs_a_worker(self) -> bool:
        return True


def on_device(rollout: Rollout, device: torch.device, behav_logp: torch.Tensor | None) -> Rollout:
    """A tool-using ``rollout`` as the engine gives it back (on the CPU), on ``device``, with
    ``behav_logp``."""
    tensors = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "model_mask")
    moved = {
        name: None if getattr(rollout, name) is None else getattr(rollout, name).to(device)
        for name in tensors
    }
    stats = None if rollout.tool_stats is None else {k: v.to(device) for k, v in rollout.tool_stats.items()}
    return replace(rollout, **moved, tool_stats=stats, behav_logp=behav_logp)


def fit_ends_with(loop: TrainingLoop, batch_idx: int) -> bool:
    """Whether training batch ``batch_idx`` is the fit's last by its epoch limit. Only there are the
    rollouts still in flight all trained at once (a step each, in one batch); at any other epoch's
    end they carry over into the next, one optimizer step per batch, so that every step-cadence
    callback sees every step. (A fit ending on ``max_steps`` hands nothing it cannot train.)"""
    last_epoch = 0 < (loop.max_epochs or 0) <= loop.epoch + 1
    return last_epoch and batch_idx + 1 == loop.num_training_batches


def warn_when_the_end_drains_at_once(fit: FitShape, staleness: int) -> None:
    """A fit that ends on its epoch limit trains its last ``staleness`` steps in its last batch
    (the pipeline's first batches trained nothing), and a step-cadence callback sees only the last
    of them; ``max_steps`` hands no batch it cannot train one step a batch."""
    if staleness > 0 and fit.step_limit is None:
        warnings.warn(
            f"rollout_mode='async' with no trainer.max_steps: the fit's last {staleness + 1} "
            "optimizer steps are taken in its last batch, so HFCheckpoint folders and "
            "ModelCheckpoint(every_n_train_steps) files of all but the last are not written; set "
            "trainer.max_steps (e.g. to the epochs' optimizer steps) to have every step seen",
            stacklevel=2,
        )


def accumulation_boundary(batch_idx: int, accumulation: int, num_training_batches: int | float) -> bool:
    """Whether batch ``batch_idx`` ends an accumulation: each ``accumulation``-th, and the epoch's last."""
    last = batch_idx + 1 == num_training_batches
    return (batch_idx + 1) % accumulation == 0 or last
