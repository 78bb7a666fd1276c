"""Asynchronous rollouts: a worker process samples the next batches while the trainer trains.

AReaL's design on one machine. The worker holds its own copy of the policy and samples the
prompts the trainer hands it, in order; the trainer trains on the rollouts as they come back,
a given number of optimizer steps behind at most. After each optimizer step the trainer writes
the new weights into a ring of copies on the worker's device
(:class:`~forge_lightning.rollout.engines.weight_ring.WeightRing`), each tagged with its version,
the number of weight updates before it. A rollout is sampled from exactly the version the trainer asked for,
with a sampling seed the trainer chose, so timing never decides which weights sampled what: a
run is repeatable, and a rollout's log-probs are those of its version.

:class:`RolloutWorker` is a :class:`~forge_lightning.rollout.engines.base.GenerationBackend` (``generate``
and ``sync_weights``, what validation and the sync path use) with two calls more, ``submit`` and
``collect``, for the pipeline :class:`~forge_lightning.rollout.sources.AsyncRollouts` runs.
Inside the worker the sampling is :class:`~forge_lightning.rollout.engines.hf.HFGenerate`, the engine the
synchronous path uses (``WorkerSettings.precision``: on a low-precision copy of each version,
rollout/engines/quantized.py). The worker samples on the CPU by default, or on the CUDA GPU that
``WorkerSettings.device`` names (another one, or the trainer's own with a share of its memory);
its results come back to the trainer on the CPU.

A run with tools (the calculator, function tools) hands the worker each batch's prompts and fields
instead (:meth:`RolloutWorker.submit_episodes`): the worker runs the tool loop
(rollout/tool_sampler.py) with tools it built itself from their import paths
(``WorkerSettings.tools``, rollout/tools/recipe.py) and sends back the finished rollout, its calls
and transcripts; no tool's state crosses between the processes.

It sits beside the episode runners it runs and the scorer it scores with (rollout/logprobs.py),
above the engines (rollout/engines/), which import nothing of it; its old path,
``forge_lightning.rollout.engines.async_worker``, still imports (_moved.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import queue
import time
import traceback
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.engines.quantized import low_precision_copy
from forge_lightning.rollout.engines.weight_ring import (
    WeightRing,
    check_rollout_device,
    resolved_rollout_device,
)
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.types import Rollout, completion_mask

if TYPE_CHECKING:
    from forge_lightning.rollout.sampler import PromptFormat
    from forge_lightning.rollout.tools.recipe import ToolRecipe

# Seconds between checks that the other side is still alive while waiting on a queue.
POLL_S = 0.5


def rollout_seed(seed: int, index: int) -> int:
    """The sampling seed of the ``index``-th batch handed to the worker in a run seeded ``seed``."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class Job:
    """One batch for the worker: its prompts, how to sample them, from which version, with which
    seed. A batch of a run with tools comes as its ``prompts`` and ``rows`` (the batch's fields),
    which the worker's tools encode and read; any other as encoded ``prompt_ids``."""

    ticket: int
    prompt_ids: Tensor | None  # (P, Lp)
    prompt_mask: Tensor | None  # (P, Lp)
    group_size: int
    params: SamplingParams
    version: int
    seed: int
    logprobs: bool  # also return the sampling policy's log-probs (behaviour log-probs)
    prompts: list[Any] | None = None
    rows: dict[str, list[Any]] | None = None


@dataclass
class Finished:
    """A job's result: the completions, their log-probs under the version that sampled them, and
    the waits on either side."""

    completion_ids: Tensor  # (P*G, Lc)
    behav_logp: Tensor | None  # (P*G, Lc)
    version: int
    worker_wait_s: float = 0.0  # the worker idle before this job reached it
    trainer_wait_s: float = 0.0  # the trainer blocked in collect for it
    # A tool-using batch's whole rollout as the worker's tools made it (its prompts, model mask,
    # calls and transcripts), on the CPU, without log-probs or environments; None for the others.
    rollout: Rollout | None = None
    # (P*G,) each row's length as the engine reports it, where stop strings end rows (an engine
    # that applies them: the rollout servers); None: each row ends at its first EOS.
    ends: Tensor | None = None


@dataclass
class InFlight:
    """A training batch handed to the worker: the batch as Lightning gave it (every key travels
    with its rollout), its index in the run, its ticket, its encoded prompts and, when back, the
    worker's result (sources.AsyncRollouts builds the rollout from it)."""

    prompts: list[Any]
    batch_kwargs: dict[str, list[Any]]
    batch_idx: int
    index: int = -1
    ticket: int | None = None
    prompt_ids: Tensor | None = None
    prompt_mask: Tensor | None = None
    finished: Finished | None = None


def saved_in_flight(items: Any) -> list[dict[str, Any]]:
    """Finished in-flight batches as plain data, for a checkpoint (``weights_only`` loads it)."""
    saved = []
    for item in items:
        assert item.finished is not None, "collect every in-flight rollout before saving"
        saved.append(
            {
                "prompts": item.prompts,
                "batch_kwargs": item.batch_kwargs,
                "batch_idx": item.batch_idx,
                "index": item.index,
                "prompt_ids": None if item.prompt_ids is None else item.prompt_ids.cpu(),
                "prompt_mask": None if item.prompt_mask is None else item.prompt_mask.cpu(),
                "completion_ids": item.finished.completion_ids,
                "behav_logp": item.finished.behav_logp,
                "version": item.finished.version,
                "rollout": _fields(item.finished.rollout),
                "ends": item.finished.ends,
            }
        )
    return saved


def restored_in_flight(saved: list[dict[str, Any]]) -> list[InFlight]:
    """The in-flight batches :func:`saved_in_flight` kept, finished."""
    return [
        InFlight(
            prompts=d["prompts"],
            batch_kwargs=d["batch_kwargs"],
            batch_idx=d["batch_idx"],
            index=d["index"],
            prompt_ids=d["prompt_ids"],
            prompt_mask=d["prompt_mask"],
            finished=Finished(
                d["completion_ids"],
                d["behav_logp"],
                d["version"],
                rollout=None if d.get("rollout") is None else Rollout(**d["rollout"]),
                ends=d.get("ends"),
            ),
        )
        for d in saved
    ]


def _fields(rollout: Rollout | None) -> dict[str, Any] | None:
    """A rollout as plain data (a checkpoint's ``weights_only`` load takes no dataclass)."""
    return None if rollout is None else {f.name: getattr(rollout, f.name) for f in fields(rollout)}


def split_threads(total: int, worker: int | None) -> tuple[int, int]:
    """(trainer, worker) CPU threads out of ``total``: the worker's ``worker`` (None: half), the
    trainer the rest, each at least 1."""
    worker = max(1, total // 2) if worker is None else worker
    return max(1, total - worker), worker


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker process needs besides the weights: the tokenizer's pad and end tokens, the
    temperature the loss scores at, how it scores (each prompt's forward shared by its group, the
    vocabulary in chunks of ``logprob_chunk_size`` rows), its CPU threads. ``device``: where it
    samples (None: the CPU; ``"cuda"``: the trainer's GPU; ``"cuda:1"``: that one);
    ``memory_fraction``: the share of a CUDA device's memory the worker's allocator may take, for
    sharing the trainer's GPU."""

    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    scoring_temperature: float = 1.0
    prefix_sharing: bool = True
    logprob_chunk_size: int | None = None
    threads: int = 1
    device: str | None = None
    memory_fraction: float | None = None
    # A run with tools: the worker runs their loop, built back from ``tools`` (import paths, no
    # state) around the tokenizer and prompt format (rollout/tools/recipe.py).
    tools: ToolRecipe | None = None
    tokenizer: Any = None
    prompts: PromptFormat | None = None
    precision: str | None = None  # sample with a copy of the weights in it (quantized.py)

    def __post_init__(self) -> None:
        check_rollout_device(self.device, self.memory_fraction)


class RolloutWorker:
    """The trainer's side of the rollout worker process (a GenerationBackend).

    ``start(model, version)`` spawns the process on its device and writes the weights;
    ``sync_weights(model)`` (after every optimizer step) writes the next version; ``submit``
    hands over a batch sampled from the newest version written (or an older one), ``collect``
    waits for its result. A worker that dies or fails is an error naming it; ``close`` stops it,
    and a worker whose trainer has gone (killed) stops by itself within a second.
    """

    def __init__(self, settings: WorkerSettings, staleness: int) -> None:
        self.settings = settings
        self.staleness = staleness  # the most versions a rollout may lag: the ring holds one more
        self.version = 0  # the newest version written
        self.device: torch.device | None = None  # where the worker samples, once started
        self.process: Any = None
        self._ring: WeightRing | None = None
        self._requests: Any = None
        self._results: Any = None
        self._tickets = 0
        self._done: dict[int, Finished] = {}

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, model: PreTrainedModel, version: int = 0) -> None:
        """Spawn the worker with ``model``'s architecture and write its weights as ``version``;
        a device setting this machine lacks is refused here, before anything is spawned."""
        if self.running:
            self.close()
        self.device = resolved_rollout_device(self.settings.device, _device(model))
        context = mp.get_context("spawn")
        # On a GPU the ring's CUDA tensors reach the worker by IPC handle, through the Process args.
        self._ring = WeightRing(model, slots=max(2, self.staleness + 1), device=self.device)
        self.version = version
        self._ring.write(model, version)
        self._requests, self._results = context.Queue(), context.Queue()
        self._done = {}
        spec = (type(model), model.config, getattr(model, "generation_config", None), _dtype(model))
        self.process = context.Process(
            target=_worker_main,
            args=(self._requests, self._results, self._ring, spec, self.settings, os.getpid()),
            name="forge-rollout-worker",
            daemon=True,
        )
        self.process.start()

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Write ``model``'s weights as the next version (called after every optimizer step)."""
        if self._ring is None:
            return
        self.version += 1
        self._ring.write(model, self.version)

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
        """Hand a batch to the worker; its ticket for :meth:`collect`. ``version`` (default: the
        newest) must be one the ring still holds."""
        return self._put(prompt_ids.cpu(), prompt_mask.cpu(), group_size, params, seed, version, logprobs)

    def submit_episodes(
        self,
        prompts: list[Any],
        rows: dict[str, list[Any]],
        group_size: int,
        params: SamplingParams,
        *,
        seed: int,
        version: int | None = None,
        logprobs: bool = True,
    ) -> int:
        """:meth:`submit` for a worker with tools (``WorkerSettings.tools``): the batch's
        ``prompts`` and ``rows``, which its tools encode and read; the result holds the rollout."""
        if self.settings.tools is None:
            raise RuntimeError("submit_episodes needs a worker with tools (WorkerSettings.tools)")
        return self._put(None, None, group_size, params, seed, version, logprobs, prompts, rows)

    def _put(
        self,
        prompt_ids: Tensor | None,
        prompt_mask: Tensor | None,
        group_size: int,
        params: SamplingParams,
        seed: int,
        version: int | None,
        logprobs: bool,
        prompts: list[Any] | None = None,
        rows: dict[str, list[Any]] | None = None,
    ) -> int:
        if not self.running:
            raise RuntimeError("the rollout worker is not running: start() it first")
        version = self.version if version is None else version
        if not self.version - self.staleness <= version <= self.version:
            raise ValueError(
                f"weights version {version} is outside the ring (newest {self.version}, "
                f"lagging at most {self.staleness})"
            )
        self._tickets += 1
        job = Job(
            self._tickets, prompt_ids, prompt_mask, group_size, params, version, seed, logprobs, prompts, rows
        )
        self._requests.put(("job", job))
        return job.ticket

    def collect(self, ticket: int) -> Finished:
        """Wait for ``ticket``'s result (results come back in submission order)."""
        started = time.perf_counter()
        while ticket not in self._done:
            try:
                message = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    code = self.process.exitcode
                    self.close()
                    raise RuntimeError(
                        f"the rollout worker process (forge-rollout-worker) died with exit code {code} "
                        f"while the trainer waited for batch {ticket}; its output above may say why "
                        "(out of memory: a killed process exits with -9)"
                    ) from None
                continue
            if message[0] == "error":
                self.close()
                raise RuntimeError(f"the rollout worker failed on batch {message[1]}:\n{message[2]}")
            _, done_ticket, finished = message
            self._done[done_ticket] = finished
        finished = self._done.pop(ticket)
        finished.trainer_wait_s = time.perf_counter() - started
        return finished

    # The worker hands back ids only (its log-probs are the pipeline's: submit); tool rounds in this
    # process read each row whole again, cut at its call.
    capabilities = EngineCapabilities()

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        """Sample with the newest weights and wait (validation; the GenerationBackend call). The
        worker starts here, from ``model``, when nothing started it before."""
        self.capabilities.check(request, type(self).__name__)
        if not self.running:
            self.start(model, self.version)
        r = request
        # A sampled draw takes its seed from the caller's RNG: sampled evaluation forks and seeds
        # that per batch, so the worker's samples follow (seed, step, batch) as in-process ones do.
        seed = 0 if r.params.greedy else int(torch.randint(2**31 - 1, ()).item())
        ticket = self.submit(r.prompt_ids, r.prompt_mask, r.group_size, r.params, seed=seed, logprobs=False)
        return Completions(self.collect(ticket).completion_ids.to(r.prompt_ids.device))

    def close(self) -> None:
        """Stop the worker (waits a few seconds, then kills it)."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.is_alive():
            try:
                self._requests.put(("stop", None))
            except (OSError, ValueError):
                pass
            process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        for q in (self._requests, self._results):
            q.close()
            q.cancel_join_thread()
        self._ring = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _dtype(model: PreTrainedModel) -> torch.dtype:
    return next(model.parameters()).dtype


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _skipped_init() -> Any:
    """transformers' context that skips weight initialisation, where this version has one."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return getattr(importlib.import_module(where), "no_init_weights")()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _worker_main(
    requests: Any, results: Any, ring: WeightRing, spec: tuple, settings: WorkerSettings, parent: int
) -> None:
    """The worker process: build the model on the ring's device, then sample each job from its
    version, in order; results go back on the CPU."""
    torch.set_num_threads(settings.threads)
    device = ring.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if settings.memory_fraction is not None:  # before the first allocation
            torch.cuda.set_per_process_memory_fraction(settings.memory_fraction, device)
    model_cls, config, generation_config, dtype = spec
    with _skipped_init():  # the weights come from the ring: a random init would be wasted seconds
        model = model_cls(config).to(device=device, dtype=dtype)
    model.tie_weights()  # tied as in the trainer's model, whose ring holds the tied tensor once
    if generation_config is not None:
        model.generation_config = generation_config
    model.eval()
    engine = HFGenerate(settings.pad_token_id, settings.eos_token_ids)
    scorer = LogProbScorer(
        temperature=settings.scoring_temperature,
        shared_prefix=settings.prefix_sharing,
        chunk_size=settings.logprob_chunk_size,
    )
    runner = None
    if settings.tools is not None:  # the tools built here, from their import paths
        from forge_lightning.rollout.sampler import RolloutSampler  # noqa: PLC0415

        sampler = RolloutSampler(settings.tokenizer, engine, settings.eos_token_ids, settings.prompts)
        runner = settings.tools.runner(sampler)
    # The model that samples: the weights as loaded, or their low-precision copy (``precision``).
    loaded, policy = None, model
    idle_since = time.perf_counter()
    while True:
        try:
            kind, job = requests.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the trainer is gone (killed): no orphan
                return
            continue
        if kind == "stop":
            return
        waited = time.perf_counter() - idle_since
        try:
            if loaded != job.version:
                ring.read_into(model, job.version)
                loaded = job.version
                if settings.precision is not None:
                    policy = None  # the old copy's memory is free before the new one is made
                    policy = low_precision_copy(model, settings.precision)
            torch.manual_seed(job.seed)  # every device's generator
            if job.prompts is not None:
                finished = _episodes(runner, scorer, model, job, settings, waited)
            else:
                finished = _sampled(engine, scorer, policy, job, settings, waited)
            results.put(("done", job.ticket, finished))
        except BaseException:
            results.put(("error", job.ticket, traceback.format_exc()))
            return
        idle_since = time.perf_counter()


def _sampled(
    engine: HFGenerate,
    scorer: LogProbScorer,
    model: PreTrainedModel,
    job: Job,
    settings: WorkerSettings,
    waited: float,
) -> Finished:
    """A job of encoded prompts: one ``generate``, and with ``job.logprobs`` the sampling
    policy's log-probs (the engine's where its temperature is the loss's; else scored again)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = job.prompt_ids.to(device), job.prompt_mask.to(device)
    # The sampling scores are the loss's distribution when both take one temperature.
    from_scores = job.logprobs and job.params.temperature == settings.scoring_temperature
    request = GenerationRequest(prompt_ids, prompt_mask, job.group_size, job.params, logprobs=from_scores)
    out = engine.generate(model, request)
    completion_ids, behav = out.ids, out.logp
    if job.logprobs and not from_scores:
        rollout = Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask(completion_ids, settings.eos_token_ids),
            group_size=job.group_size,
            completions=[],
        )
        behav = scorer.log_probs_no_grad(model, rollout)
    behav = None if behav is None else behav.cpu()
    return Finished(completion_ids.cpu(), behav, job.version, worker_wait_s=waited)


def _episodes(
    runner: Any,
    scorer: LogProbScorer,
    model: PreTrainedModel,
    job: Job,
    settings: WorkerSettings,
    waited: float,
) -> Finished:
    """A tool-using job: the tool loop of its prompts (the calls answered here), and with
    ``job.logprobs`` the sampling policy's log-probs of each token (the engine's, 0 on a tool's
    token, where its temperature is the loss's; else scored again)."""
    from_scores = job.logprobs and job.params.temperature == settings.scoring_temperature
    rollout = runner(
        model, job.prompts, job.params, job.group_size, engine_logprobs=from_scores, rows=job.rows
    )
    behav = rollout.old_logp if from_scores else None
    if job.logprobs and not from_scores:
        behav = scorer.log_probs_no_grad(model, rollout)
    # A tool's or environment's state stays in this process: only the tokens and the log go back.
    rollout = replace(
        rollout,
        prompt_ids=rollout.prompt_ids.cpu(),
        prompt_mask=rollout.prompt_mask.cpu(),
        completion_ids=rollout.completion_ids.cpu(),
        completion_mask=rollout.completion_mask.cpu(),
        truncated=None if rollout.truncated is None else rollout.truncated.cpu(),
        model_mask=None if rollout.model_mask is None else rollout.model_mask.cpu(),
        tool_stats=None
        if rollout.tool_stats is None
        else {k: v.cpu() for k, v in rollout.tool_stats.items()},
        old_logp=None,
        environments=None,
    )
    behav = None if behav is None else behav.cpu()
    return Finished(rollout.completion_ids, behav, job.version, worker_wait_s=waited, rollout=rollout)
