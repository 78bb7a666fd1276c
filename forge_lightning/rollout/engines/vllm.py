"""Generation with vLLM, colocated with training on the same GPU (the ``vllm`` engine).

The engine is built on the first rollout from the policy itself: its config and tokenizer go to a
temporary folder, vLLM starts there with placeholder weights (``load_format="dummy"``) and takes
``gpu_memory_utilization`` of the GPU for its weights and KV cache, and the policy's weights are
then loaded into it. After every optimizer step :meth:`VLLMGenerate.sync_weights` loads them again
(and drops vLLM's prefix cache, computed with the old weights), so the engine always samples from
the current policy. A LoRA policy's adapters are folded into the weights it receives.

Prompts go in as token ids; the G completions of a prompt come back from one request with ``n=G``.
The sampling settings map over (``top_k`` 0 is vLLM's -1; each call draws its seed from torch's
generator, so ``seed_everything`` repeats a run). Asked for the engine's log-probs, the loss takes the
old-policy log-probs from vLLM (its temperature-scaled ``processed_logprobs``; ``top_p`` 1 and
``top_k`` 0, so that both sides score the same distribution); with the rollout correction the same
log-probs are the sampler's, weighed against the trainer's recomputation (grpo.grpo_loss), at any
top_p/top_k. The engine runs in the training
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, weights loaded through ``LLM.apply_model``).
Tool-using rollouts (rollout/tool_sampler.py) sample with it too: it does not stop a row at a call,
so each round's rows are cut at their first calculator call there (a function-calling turn ends at
its EOS anyway) and read whole again in the next round.

Tested on CPU against a fake engine with ``vllm.LLM``'s interface only; the real engine, and several
training processes with one engine each (``distributed_executor_backend="external_launcher"``),
have not been run.

vLLM is imported only here and only when an engine is built: the rest of the package, and every
test, runs without it. GPU only: ``pip install "forge-lightning[vllm]"``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.lora import merged_weights as policy_weights
from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    EngineOptions,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.engines.generation_settings import check_generation_kwargs, vllm_fields

# (policy, tokenizer, gpu_memory_utilization) -> an object shaped like ``vllm.LLM``: ``generate``,
# ``apply_model`` and ``reset_prefix_cache``.
EngineFactory = Callable[[PreTrainedModel, PreTrainedTokenizerBase, float], Any]

_INSTALL_HINT = 'generation_backend="vllm" needs vLLM and a GPU: pip install "forge-lightning[vllm]"'


def import_vllm() -> ModuleType:
    """The ``vllm`` module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err


class VLLMGenerate:
    """A :class:`~forge_lightning.rollout.engines.base.GenerationBackend` backed by a colocated ``vllm.LLM``.

    Args:
        tokenizer: the policy's tokenizer (saved beside the config for the engine).
        eos_token_ids: every token that ends a completion; vLLM stops at each of them.
        gpu_memory_utilization: share of the GPU's memory vLLM may take; training keeps the rest.
        engine_factory: builds the engine; :func:`colocated_llm` unless given (tests pass a fake).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Sequence[int],
        gpu_memory_utilization: float = 0.3,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.eos_token_ids = list(eos_token_ids)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.engine_factory = engine_factory or colocated_llm
        self.engine: Any = None

    # vLLM cannot take an HF stopping criterion (a tool call: the tool sampler cuts its rows) nor
    # hand back a cache.
    capabilities = EngineCapabilities(logprobs=True, stop_strings=True)

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        """Completion ids ``(P*G, Lc)``, groups contiguous, right-padded with the pad token; each
        one's length (the tokens vLLM returned for it: through its EOS or the token that completed
        its stop string), and with ``request.logprobs`` the engine's log-prob of each sampled token
        ``(P*G, Lc)``: of the temperature-scaled distribution (vLLM's ``processed_logprobs``), the
        quantity the loss computes; padding positions hold 0."""
        self.capabilities.check(request, type(self).__name__)
        r = request
        return self._sample(model, r.prompt_ids, r.prompt_mask, r.group_size, r.params, r.logprobs)

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Load the policy's current weights into the engine (a no-op before it exists)."""
        if self.engine is None:
            return
        weights = policy_weights(model)
        self.engine.apply_model(lambda engine_model: engine_model.load_weights(weights))
        # Cached prompt keys/values were computed with the old weights.
        self.engine.reset_prefix_cache()

    def _sample(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        logprobs: bool,
    ) -> Completions:
        if self.engine is None:
            self.engine = self.engine_factory(model, self.tokenizer, self.gpu_memory_utilization)
            self.sync_weights(model)
        # vLLM takes unpadded token lists; the left padding of the batch is not part of a prompt.
        prompts = [
            {"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids, prompt_mask)
        ]
        requests = vllm_sampling_params(
            import_vllm(), params, len(prompts), group_size, self.eos_token_ids, logprobs
        )
        outputs = self.engine.generate(prompts, requests, use_tqdm=False)
        # One request per prompt, n=G completions each: flattening keeps each group contiguous.
        samples = [sample for output in outputs for sample in output.outputs]
        ids = pad_sequence(
            [torch.tensor(s.token_ids, dtype=torch.long) for s in samples],
            batch_first=True,
            padding_value=self.pad_token_id,
        ).to(prompt_ids.device)  # (P*G, Lc)
        # The lengths, not the pad token: after a stop string the padding may be the EOS.
        ends = torch.tensor([len(s.token_ids) for s in samples], device=prompt_ids.device)  # (P*G,)
        if not logprobs:
            return Completions(ids, ends)
        logp = pad_sequence(
            [torch.tensor(sampled_logprobs(s), dtype=torch.float32) for s in samples], batch_first=True
        ).to(prompt_ids.device)  # (P*G, Lc)
        return Completions(ids, ends, logp)


def vllm_sampling_params(
    vllm: ModuleType,
    params: SamplingParams,
    num_prompts: int,
    group_size: int,
    eos_token_ids: Sequence[int],
    logprobs: bool,
) -> list[Any]:
    """One ``vllm.SamplingParams`` per prompt for G completions each, drawn as ``HFGenerate`` draws.

    vLLM seeds the G completions of a request ``seed, seed+1, ...``; the prompts' seeds are G
    apart so that no two completions of a rollout share a random stream. The base seed comes from
    torch's generator, which ``seed_everything`` seeds: runs repeat, and every call differs.
    Settings left at their defaults (min_p 0, repetition_penalty 1, no stop strings) are not
    passed; ``params.extra`` is checked against the fields of the installed vLLM.
    """
    greedy = params.greedy
    shared: dict[str, Any] = {}
    if not greedy and params.extra:
        shared.update(check_generation_kwargs(params.extra, "vllm", vllm_fields(vllm)))
    shared.update(
        n=group_size,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if greedy else params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=-1 if greedy or params.top_k == 0 else params.top_k,  # vLLM's "no top-k" is -1
        stop_token_ids=list(eos_token_ids),
        logprobs=0 if logprobs else None,  # 0: only the sampled token's log-prob
        # Completions are decoded from the ids, by the module; but vLLM matches stop strings on
        # its own text.
        detokenize=bool(params.stop),
    )
    if not greedy and params.min_p:
        shared["min_p"] = params.min_p
    if not greedy and params.repetition_penalty != 1.0:
        shared["repetition_penalty"] = params.repetition_penalty
    if params.stop:
        # The stop string stays in the completion, as in HFGenerate: the reward reads it.
        shared.update(stop=list(params.stop), include_stop_str_in_output=True)
    base = int(torch.randint(2**30, ()).item())
    return [vllm.SamplingParams(**shared, seed=base + i * group_size) for i in range(num_prompts)]


def sampled_logprobs(sample: Any) -> list[float]:
    """The log-prob of each token a vLLM ``CompletionOutput`` sampled."""
    if sample.logprobs is None:
        raise RuntimeError("the vLLM engine returned no log-probs; it was not asked for them")
    return [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]


def colocated_llm(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, gpu_memory_utilization: float
) -> Any:
    """A ``vllm.LLM`` on this process's GPU, with the policy's architecture and placeholder weights."""
    vllm = import_vllm()
    # An in-process engine: apply_model then reaches the engine's model directly, so loading
    # weights hands over tensors instead of pickling them to a worker process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    folder = tempfile.mkdtemp(prefix="forge-vllm-")
    base.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    extra: dict[str, Any] = {}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # One engine per training process (tensor_parallel_size 1), in that process, the way
        # torchrun-style launchers run vLLM; it reads its rank from the environment.
        os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
        extra["distributed_executor_backend"] = "external_launcher"
    rank = int(os.environ.get("RANK", "0"))
    return vllm.LLM(
        model=folder,
        tokenizer=folder,
        load_format="dummy",  # the real weights arrive through sync_weights right after
        dtype=str(next(base.parameters()).dtype).removeprefix("torch."),
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=True,  # the G completions of a prompt share its prefill
        logprobs_mode="processed_logprobs",  # log-probs after temperature, as the loss has them
        seed=rank,
        **extra,
    )


def build(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], options: EngineOptions) -> VLLMGenerate:
    """vLLM colocated with training (the ``vllm`` engine)."""
    return VLLMGenerate(tokenizer, eos_ids, gpu_memory_utilization=options.gpu_memory_utilization)
