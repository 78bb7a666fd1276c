"""The rollout server's engine: one loop, on one thread, that owns the model and decodes the rows
of every request in flight as one batch (continuous admission: a request joins at the next decode
step, its KV cache merged into the batch's by serving/batch.py, and leaves when its rows are done).

Each request (serving/requests.py: its rows, generator and logits processors) is sampled as the
in-process engine (rollout/engines/hf.py's ``HFGenerate``) samples it alone: the same forwards
(its shared-prefix prefill), the same logits processors in transformers' order, its own
``torch.Generator`` (set to the trainer's ``rng_state``, or seeded), and its finished rows kept
drawing pad tokens until all its rows are done, as ``generate`` does, so that its random stream is
the one ``generate`` would have used. Each token records the weight
version that sampled it.

A weight update (:meth:`DecodeLoop.update`) waits for a step boundary: requests that are not
``partial`` finish with the old weights (nothing is admitted meanwhile), ``partial`` ones are paused,
the new weights are loaded, and the paused ones go on from a cache rebuilt with them.
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.hf_compat import cache_kwarg, output_cache, supports_shared_prefix
from forge_lightning.rollout.engines.hf import HFGenerate, eos_token_ids
from forge_lightning.rollout.engines.quantized import low_precision_copy
from forge_lightning.serving import batch
from forge_lightning.serving.requests import Job, answer, new_job
from forge_lightning.serving.wire import GenerateAnswer, GenerateCall


class UpdateUnderWay(RuntimeError):
    """A weight update was asked for while another is still waiting or loading."""


@dataclass
class Update:
    """A weight update waiting for the loop: ``load(model)`` copies the new weights in."""

    version: int
    load: Callable[[PreTrainedModel], Any]
    future: Future[int]


class DecodeLoop:
    """The engine loop: :meth:`submit` and :meth:`update` from any thread; :meth:`step` (one
    decode step) from the loop's own thread (:meth:`run`), or from a test directly.

    ``record``: ``(step, event, request_id)`` for each ``admit``, ``finish``, ``cancel`` (its
    caller went away: its future was cancelled), ``pause``, ``resume``,
    and ``(step, "update", str(version))``: what the loop did, in order, for tests to read.

    ``precision`` (``bf16``, ``int8``: the run's rollout precision): the loop samples with a
    low-precision copy of ``model`` (rollout/engines/quantized.py), made again after every update
    of ``model``'s weights; its log-probs are the copy's, the sampler's for the loss's correction.
    """

    name = "hf"  # the engine /info names

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        version: int = 0,
        precision: str | None = None,
    ) -> None:
        self.weights = model.eval()  # what updates load into
        self.precision = precision
        self.model = self._sampling_copy()
        self.engine = HFGenerate(tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer)
        self.version = version
        self.jobs: list[Job] = []  # in the batch, in row order
        self.cache: Any = None  # the batch's DynamicCache
        self.paused: list[Job] = []
        self.waiting: deque[Job] = deque()
        self.pending: Update | None = None
        self.steps = 0
        self.record: list[tuple[int, str, str]] = []
        self.lock = threading.Condition()
        forward = inspect.signature(type(model).forward).parameters
        self._keep_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    # --- from other threads ---------------------------------------------------------------------

    def submit(self, call: GenerateCall) -> Future[GenerateAnswer]:
        """Queue ``call``; its future holds the answer. ValueError for a request the loop cannot
        sample as the in-process engine would."""
        job = new_job(call, self.model, self.engine)
        with self.lock:
            self.waiting.append(job)
            self.lock.notify_all()
        return job.future

    def update(self, version: int, load: Callable[[PreTrainedModel], Any]) -> Future[int]:
        """Load new weights with ``load(model)`` at the next step boundary, then hold ``version``."""
        with self.lock:
            if self.pending is not None:
                raise UpdateUnderWay(
                    f"a weight update to version {self.pending.version} is under way: wait for it"
                )
            self.pending = Update(version, load, Future())
            self.lock.notify_all()
            return self.pending.future

    def health(self) -> dict[str, int]:
        with self.lock:
            return {
                "version": self.version,
                "active": len(self.jobs) + len(self.paused),
                "queued": len(self.waiting),
            }

    def run(self, stop: threading.Event) -> None:
        """Step while there is work, until ``stop`` is set; a step that fails fails its requests."""
        while not stop.is_set():
            with self.lock:
                if not self._has_work():
                    self.lock.wait(timeout=0.1)
                    continue
            try:
                self.step()
            except Exception as err:  # the model failed: answer the requests, keep serving
                self._fail_batch(err)

    # --- the loop ---------------------------------------------------------------------------------

    def step(self) -> None:
        """Admit, sample, retire, update, forward: one decode step of every request in flight."""
        with torch.no_grad():
            for job in self._admissible():
                self._admit(job)
            for job in self.jobs:
                self._sample(job)
            self._retire([j for j in self.jobs if j.future.cancelled()], "cancel")
            self._retire([j for j in self.jobs if self._done(j)], "finish")
            if self.pending is not None:
                self._retire([j for j in self.jobs if j.call.partial], "pause")
                if not self.jobs:
                    self._apply_update()
            if self.jobs:
                self._decode()
        self.steps += 1

    def _has_work(self) -> bool:
        return bool(
            self.jobs or self.pending or any(j.call.min_version <= self.version for j in self.waiting)
        )

    def _admissible(self) -> list[Job]:
        """The waiting jobs that may join now: none while an update waits; else those whose
        ``min_version`` the weights have reached."""
        with self.lock:
            if self.pending is not None:
                return []
            for job in [j for j in self.waiting if j.future.cancelled()]:
                self.waiting.remove(job)
            ready = [j for j in self.waiting if j.call.min_version <= self.version]
            for job in ready:
                self.waiting.remove(job)
            return ready

    def _admit(self, job: Job) -> None:
        """Run ``job``'s sequences through the model and merge its cache into the batch's."""
        self.record.append((self.steps, "admit" if job.fresh else "resume", job.call.request_id))
        cache = self._prefill(job)
        job.fresh = False
        self.cache = batch.merge(self.cache, cache)
        self.jobs.append(job)

    def _prefill(self, job: Job) -> Any:
        """``job.logits`` from all of ``job``'s columns; the cache of those columns.

        A fresh request with groups takes hf.py's shared-prefix path (its prompts' heads once, the
        cache repeated, then the last prompt column), so that its first token's logits are those
        the in-process engine samples from."""
        g, model = job.call.group_size, self.model
        if job.fresh and g > 1 and job.width >= 2 and supports_shared_prefix(model):
            head_mask = job.mask[::g, :-1]
            out = model(
                input_ids=job.ids[::g, :-1],
                attention_mask=head_mask,
                position_ids=(head_mask.cumsum(dim=-1) - 1).clamp(min=0),
                use_cache=True,
                **self._keep_logits,
            )
            cache = output_cache(out)
            cache.batch_repeat_interleave(g)
            job.logits, cache = self._forward(job.ids[:, -1:], job.mask, _last_positions([job]), cache)
            return cache
        positions = (job.mask.cumsum(dim=-1) - 1).masked_fill(job.mask == 0, 0)
        job.logits, cache = self._forward(job.ids, job.mask, positions, None)
        return cache

    def _forward(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> tuple[Tensor, Any]:
        """(B, V) float32 logits of the next token after ``ids``, and the grown cache. A mask of
        ones is dropped, as ``generate`` drops it."""
        out = self.model(
            input_ids=ids,
            attention_mask=None if bool((mask == 1).all()) else mask,
            position_ids=positions,
            use_cache=True,
            return_dict=True,
            **{cache_kwarg(self.model): cache},
            **self._keep_logits,
        )
        return out.logits[:, -1].to(copy=True, dtype=torch.float32), output_cache(out)

    def _decode(self) -> None:
        """One forward of every row's newest token; each job's logits for its next."""
        ids = torch.cat([j.ids[:, -1:] for j in self.jobs])  # (B, 1)
        mask = batch.left_pad_mask([j.mask for j in self.jobs], batch.cache_length(self.cache) + 1)
        logits, self.cache = self._forward(ids, mask, _last_positions(self.jobs), self.cache)
        for job, part in zip(self.jobs, logits.split([j.rows for j in self.jobs]), strict=True):
            job.logits = part

    def _sample(self, job: Job) -> None:
        """One token per row of ``job`` from its logits, as ``generate``'s sampling step draws it."""
        scores = job.processors(job.ids, job.logits)  # (N, V)
        if job.sample:
            probs = torch.softmax(scores, dim=-1)
            drawn = torch.multinomial(probs.to(job.generator.device), 1, generator=job.generator)
            tokens = drawn.squeeze(1).to(scores.device)
        else:
            tokens = scores.argmax(dim=-1)
        pad = self.engine.pad_token_id
        tokens = tokens * job.unfinished + pad * (1 - job.unfinished)  # finished rows draw, then pad
        job.ids = torch.cat([job.ids, tokens[:, None]], dim=-1)
        job.mask = torch.cat([job.mask, job.mask.new_ones(job.rows, 1)], dim=-1)
        job.logits = None
        if job.call.logprobs:
            job.logp.append(scores.gather(1, tokens[:, None])[:, 0] - scores.logsumexp(dim=-1))
        job.versions.append(self.version)
        ended = torch.isin(tokens, torch.tensor(self.engine.eos_token_ids, device=tokens.device))
        if job.stop is not None:
            ended |= job.stop(job.ids, None)
        job.unfinished = job.unfinished & ~ended

    def _done(self, job: Job) -> bool:
        return not bool(job.unfinished.any()) or job.steps >= job.call.params.max_new_tokens

    def _retire(self, leaving: list[Job], event: str) -> None:
        """Take ``leaving`` out of the batch: finished ones are answered, paused ones wait,
        cancelled ones (their caller is gone) are dropped."""
        if not leaving:
            return
        rows, start, staying = [], 0, []
        for job in self.jobs:
            if job not in leaving:
                rows.extend(range(start, start + job.rows))
                staying.append(job)
            start += job.rows
        width = max((j.ids.shape[1] - 1 for j in staying), default=0)
        self.cache = batch.keep(self.cache, torch.tensor(rows, dtype=torch.long), width)
        self.jobs = staying
        for job in leaving:
            self.record.append((self.steps, event, job.call.request_id))
            if event == "finish" and not job.future.cancelled():
                job.future.set_result(answer(job, self.engine.eos_token_ids))
            elif event == "pause":
                self.paused.append(job)

    def _apply_update(self) -> None:
        """Load the waiting update's weights (every request that is not partial is done), then
        queue the paused requests first, to go on with the new weights."""
        update = self.pending
        assert update is not None
        failure: Exception | None = None
        try:
            update.load(self.weights)
            self.model = self._sampling_copy()
        except Exception as err:
            failure = RuntimeError(
                f"loading weight version {update.version} failed ({type(err).__name__}: {err}); the "
                f"server keeps version {self.version} but its weights may be partly new: push them again"
            )
        else:
            self.version = update.version
            self.record.append((self.steps, "update", str(update.version)))
        # Cleared before the answer goes out: the trainer may post its next update right away.
        with self.lock:
            self.pending = None
            self.waiting.extendleft(reversed(self.paused))
            self.paused = []
        if failure is None:
            update.future.set_result(update.version)
        else:
            update.future.set_exception(failure)

    def _sampling_copy(self) -> PreTrainedModel:
        """What samples: the weights, or their low-precision copy (the old copy freed first)."""
        if self.precision is None:
            return self.weights
        self.model = None  # the old copy's memory is free before the new one is made
        return low_precision_copy(self.weights, self.precision)

    def _fail_batch(self, err: Exception) -> None:
        for job in self.jobs:
            if not job.future.done():
                job.future.set_exception(err)
        self.jobs, self.cache = [], None


def _last_positions(jobs: list[Job]) -> Tensor:
    """(B, 1): each row's position of its newest column (left padding not counted)."""
    return torch.cat([j.mask.sum(dim=-1, keepdim=True) - 1 for j in jobs])
