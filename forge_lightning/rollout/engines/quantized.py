"""The low-precision sampler: HF ``generate`` on a copy of the policy in
int8 or bfloat16, remade from the policy after every optimizer step.

The copy's log-probs differ from the policy's, so a run needs the loss's rollout correction
(settings/checks.py): the engine reports the copy's scores as the sampler's log-probs
(``behav_logp``), the trainer scores the completions with the policy, and the correction weighs
each token by the gap (``train/sampler_kl``). Validation samples with the copy too. With
asynchronous rollouts the worker makes the copy of each weight version it loads
(rollout/async_worker.py).

``int8``: every ``nn.Linear`` weight in int8, one scale per output channel, the activations
left in float (torchao's weight-only int8; the LM head included, a tied head untied in the
copy, the embedding staying float32). Not torch's ``quantize_dynamic``: it quantizes the
activations too, and SmolLM2's outlier activations then make a sampler_kl of about 3 against the
policy's (torchao's: about 0.002). On a CPU torchao's int8 decodes no faster than float32 (its
gain is a GPU's, untested here); ``bf16``, the copy in bfloat16, decodes faster on a CPU with
bfloat16 instructions (AVX512-BF16 or AMX). Both copies live on the policy's device. The
refresh is timed within the optimizer phase (``perf/optimizer_s``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.engines.base import EngineOptions
from forge_lightning.rollout.engines.hf import HFGenerate


def int8_copy(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.Linear`` weight in int8 (torchao's weight-only int8), in place."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        raise ImportError(
            "rollout_precision='int8' quantizes with torchao: pip install 'forge-lightning[quantize]'"
        ) from err
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))  # no global compiler settings
    return model


# rollout_precision -> what makes the sampling copy of a detached copy of the policy
CASTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "int8": int8_copy,
    "bf16": lambda model: model.to(torch.bfloat16),
}


def low_precision_copy(model: PreTrainedModel, precision: str) -> PreTrainedModel:
    """A copy of ``model`` in ``precision`` (a key of ``CASTS``) that samples, without gradients;
    a LoRA model's adapters merged into its copy."""
    if is_sharded(model):
        raise ValueError(
            "rollout_precision copies the whole policy into this process; the policy is sharded "
            "(FSDP): set rollout_precision to null"
        )
    sampler = copy.deepcopy(model)
    if hasattr(sampler, "merge_and_unload"):  # peft: one plain model to quantize
        sampler = sampler.merge_and_unload()
    for param in sampler.parameters():
        param.grad = None
        param.requires_grad_(False)
    sampler.eval()
    return CASTS[precision](sampler)


class QuantizedGenerate(HFGenerate):
    """:class:`HFGenerate` on a low-precision copy of the policy, remade by :meth:`sync_weights`
    (after every optimizer step) and on first use: every ``generate`` goes through
    :meth:`_generate`, which samples with the copy; the ``model`` its methods are given is the
    policy, read only to make the first copy. The log-probs it reports are the copy's."""

    def __init__(
        self,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        tokenizer: PreTrainedTokenizerBase,
        precision: str,
    ) -> None:
        if precision not in CASTS:
            raise ValueError(f"rollout_precision must be one of {sorted(CASTS)} or None, got {precision!r}")
        super().__init__(pad_token_id, eos_token_ids, tokenizer)
        self.precision = precision
        self.sampling_copy: PreTrainedModel | None = None

    def _generate(self, model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        if self.sampling_copy is None:
            self.sync_weights(model)
        return super()._generate(self.sampling_copy, *args, **kwargs)

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Remake the copy from the policy's new weights."""
        self.sampling_copy = None  # the old copy's memory is free before the new one is made
        self.sampling_copy = low_precision_copy(model, self.precision)


def build(
    tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], options: EngineOptions
) -> QuantizedGenerate:
    """HF ``generate`` on a copy of the policy in ``options.precision`` (``rollout_precision``)."""
    if options.precision is None:
        raise ValueError("the quantized engine samples in a rollout_precision: set it to 'int8' or 'bf16'")
    return QuantizedGenerate(tokenizer.pad_token_id, eos_ids, tokenizer, options.precision)
