"""The engines that sample rollouts, by the name the module's settings give. An engine is a file
beside this one with a ``build(tokenizer, eos_token_ids, options)`` function that returns a
:class:`~forge_lightning.rollout.engines.base.GenerationBackend`; adding one is that file and one
line in ``ENGINES``. Each is imported only when a run names it (vLLM is a GPU-only install). A
low precision samples with HF ``generate`` on a low-precision copy of the policy (quantized.py)."""

from __future__ import annotations

import importlib

from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.engines.base import EngineOptions, GenerationBackend
from forge_lightning.rollout.engines.hf import eos_token_ids

# name -> the module that builds it
ENGINES = {
    "hf": "forge_lightning.rollout.engines.hf",
    "vllm": "forge_lightning.rollout.engines.vllm",
}
LOW_PRECISION = "forge_lightning.rollout.engines.quantized"  # the engine of a low precision


def generation_backend(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    vllm_gpu_memory_utilization: float = 0.3,
    rollout_precision: str | None = None,
) -> GenerationBackend:
    """The sampling engine ``name`` (a key of ``ENGINES``) names, for ``model``'s completions;
    with a ``rollout_precision`` (``hf`` only), HF ``generate`` on a copy in that precision."""
    if name not in ENGINES:
        raise ValueError(f"generation_backend must be one of {sorted(ENGINES)}, got {name!r}")
    if rollout_precision is not None and name != "hf":
        raise ValueError(
            f"rollout_precision={rollout_precision!r} samples with HF generate on a copy of the policy; "
            f"generation_backend={name!r} has its own weights: set generation_backend='hf'"
        )
    options = EngineOptions(gpu_memory_utilization=vllm_gpu_memory_utilization, precision=rollout_precision)
    module = ENGINES[name] if rollout_precision is None else LOW_PRECISION
    return importlib.import_module(module).build(tokenizer, eos_token_ids(tokenizer, model), options)
