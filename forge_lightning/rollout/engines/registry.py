"""The engines that sample rollouts, by the name ``generation_backend`` gives. An engine is a file
beside this one with a ``build(tokenizer, eos_token_ids, options)`` function that returns a
:class:`~forge_lightning.rollout.engines.base.GenerationBackend`; adding one is that file and one
line in ``ENGINES``. Each is imported only when a run names it (vLLM is a GPU-only install)."""

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


def generation_backend(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    vllm_gpu_memory_utilization: float = 0.3,
) -> GenerationBackend:
    """The sampling engine ``name`` (a key of ``ENGINES``) names, for ``model``'s completions."""
    if name not in ENGINES:
        raise ValueError(f"generation_backend must be one of {sorted(ENGINES)}, got {name!r}")
    options = EngineOptions(gpu_memory_utilization=vllm_gpu_memory_utilization)
    return importlib.import_module(ENGINES[name]).build(tokenizer, eos_token_ids(tokenizer, model), options)
