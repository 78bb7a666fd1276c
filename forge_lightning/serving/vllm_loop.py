"""The rollout server's sampler when vLLM runs it (``forge-lightning serve --engine vllm``): the
project's vLLM engine (rollout/engines/vllm.py's ``VLLMGenerate``) behind the same loop interface
as the decode loop (serving/decode.py), so that the server's HTTP side, its door and its weight
push are the same whichever engine samples.

Each ``/generate`` request goes into vLLM as one call (its prompts, ``n = group_size`` each), one
request at a time on the loop's thread: vLLM batches a request's sequences continuously itself,
but the requests of several trainer ranks are not merged into one vLLM batch (that would need
vLLM's asynchronous engine). The log-probs are vLLM's (``processed_logprobs``); every token of a
request carries the version the server held when the request started. A weight update waits for
the request in flight to finish, ``partial`` ones included (vLLM cannot pause one here): their
tokens all carry the old version, which is what sampled them.

Seeds: vLLM seeds a request from torch's generator (``vllm_sampling_params``); the loop draws that
seed from the request's ``rng_state`` (then answers the state after, as the in-process vLLM engine
would leave it), else from its ``seed``, else from a fresh one.

Pushed weights land in the HF model the server loaded (kept on the CPU: the receiving end of
serving/weights.py, and the source of the fingerprint and parameter list), then go into vLLM
through the engine's own ``sync_weights``; so the server holds one CPU copy of the weights beside
vLLM's. vLLM is imported only when the engine is built, on its first request.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.engines.base import Completions, GenerationRequest
from forge_lightning.rollout.engines.vllm import EngineFactory, VLLMGenerate
from forge_lightning.serving.decode import DecodeLoop
from forge_lightning.serving.wire import GenerateAnswer, GenerateCall, decode_rng_state, encode_rng_state


@dataclass(eq=False)
class VLLMJob:
    """A request waiting for vLLM, or in it."""

    call: GenerateCall
    future: Future[GenerateAnswer]


class VLLMLoop(DecodeLoop):
    """The decode loop's queue, weight updates and health, with vLLM sampling each request.

    Args:
        model: the served model (its architecture for vLLM, and where pushed weights land first).
        tokenizer: its tokenizer.
        version: the weight version it holds.
        gpu_memory_utilization: share of the GPU's memory vLLM may take.
        engine_factory: builds the engine (``VLLMGenerate``'s default unless given; tests pass a fake).
    """

    name = "vllm"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        version: int = 0,
        gpu_memory_utilization: float = 0.3,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        super().__init__(model, tokenizer, version)
        eos = self.engine.eos_token_ids
        self.sampler = VLLMGenerate(tokenizer, eos, gpu_memory_utilization, engine_factory)

    def submit(self, call: GenerateCall) -> Future[GenerateAnswer]:
        """Queue ``call``; its future holds the answer. ValueError for a token outside the vocabulary."""
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(not 0 <= t < vocab for p in call.prompts for t in p):
            raise ValueError(
                f"request {call.request_id}: a prompt token id is outside the vocabulary (0..{vocab - 1})"
            )
        job = VLLMJob(call, Future())
        with self.lock:
            self.waiting.append(job)
            self.lock.notify_all()
        return job.future

    def update(self, version: int, load: Callable[[PreTrainedModel], Any]) -> Future[int]:
        """As the decode loop's, then the loaded weights go into vLLM (a no-op before it is built:
        it is built from the model's weights)."""

        def load_into_engine(model: PreTrainedModel) -> None:
            load(model)
            self.sampler.sync_weights(model)

        return super().update(version, load_into_engine)

    def step(self) -> None:
        """Sample the next request whose version has come (none while an update waits), then
        apply a waiting update."""
        job = self._next()
        if job is not None:
            self._run(job)
        if self.pending is not None:
            self._apply_update()
        self.steps += 1

    def _next(self) -> VLLMJob | None:
        with self.lock:
            if self.pending is not None:
                return None
            for job in list(self.waiting):
                if job.future.cancelled():
                    self.waiting.remove(job)
                elif job.call.min_version <= self.version:
                    self.waiting.remove(job)
                    return job
        return None

    def _run(self, job: VLLMJob) -> None:
        """Answer ``job`` (or fail it: a request vLLM refuses fails alone, the loop goes on)."""
        self.record.append((self.steps, "admit", job.call.request_id))
        self.jobs = [job]  # type: ignore[list-item]  # counted as active by health()
        try:
            answer = self._sample(job.call)
        except Exception as err:
            if not job.future.cancelled():
                job.future.set_exception(err)
            return
        finally:
            self.jobs = []
        self.record.append((self.steps, "finish", job.call.request_id))
        if not job.future.cancelled():
            job.future.set_result(answer)

    def _sample(self, call: GenerateCall) -> GenerateAnswer:
        """``call``'s completions from vLLM, its seed drawn from the request's own torch state."""
        width, pad = max(len(p) for p in call.prompts), self.sampler.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in call.prompts])  # (P, W) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in call.prompts])
        request = GenerationRequest(ids, mask, call.group_size, call.params, logprobs=call.logprobs)
        with torch.random.fork_rng(devices=[]):  # the server's own generator is left as it was
            if call.rng_state is not None:
                torch.set_rng_state(decode_rng_state(call.rng_state))
            elif call.seed is not None:
                torch.manual_seed(call.seed)
            else:
                torch.seed()
            out = self.sampler.generate(self.model, request)
            state = torch.get_rng_state()
        return self._answer(call, out, None if call.rng_state is None else encode_rng_state(state))

    def _answer(self, call: GenerateCall, out: Completions, rng_state: str | None) -> GenerateAnswer:
        """The wire's answer from vLLM's completions: each row cut at its length."""
        assert out.ends is not None  # VLLMGenerate always reports them
        ends = out.ends.tolist()
        rows = [row[:end] for row, end in zip(out.ids.tolist(), ends, strict=True)]
        logp = None if out.logp is None else out.logp.tolist()
        return GenerateAnswer(
            request_id=call.request_id,
            completions=rows,
            logp=None if logp is None else [row[:end] for row, end in zip(logp, ends, strict=True)],
            versions=[[self.version] * end for end in ends],
            truncated=[self._truncated(row, call) for row in rows],
            rng_state=rng_state,
        )

    def _truncated(self, row: list[int], call: GenerateCall) -> bool:
        """Whether ``row`` ran out of ``max_new_tokens`` rather than ending at an EOS or a stop
        string (vLLM stops at a stop string's first occurrence, so one in the text ended it)."""
        if len(row) < call.params.max_new_tokens or (row and row[-1] in self.sampler.eos_token_ids):
            return False
        stops = call.params.stop
        return not (stops and any(s in self.sampler.tokenizer.decode(row) for s in stops))
