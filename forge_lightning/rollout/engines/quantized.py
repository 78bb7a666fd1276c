"""The low-precision sampler: HF ``generate`` on a copy of the policy in
int8 or bfloat16, remade from the policy after every optimizer step.

The copy's log-probs differ from the policy's, so a run needs the loss's rollout correction
(settings/checks.py): the engine reports the copy's scores as the sampler's log-probs
(``behav_logp``), the trainer scores the completions with the policy, and the correction weighs
each token by the gap (``train/sampler_kl``). Validation samples with the copy too. With
rollout servers each server makes the copy of each weight version it loads
(serving/decode.py).

``bf16``: the copy in bfloat16. ``int8``: that bfloat16 copy with every ``nn.Linear`` weight but
the LM head's in int8, one scale per output channel (:class:`Int8Linear`; the head and the
embedding stay bfloat16), the activations left in bfloat16: on a CPU torch's weight-only int8
kernel (``torch._weight_int8pack_mm``) multiplies them for a few rows a call (decoding), the
weight dequantized into a bfloat16 matmul for more (a prefill, a large batch). Not torch's
``quantize_dynamic``: it quantizes the activations too, and SmolLM2's outlier activations then
make a sampler_kl of about 3 against the policy's. Nor torchao's weight-only int8: on a CPU
without ``torch.compile`` it decodes slower than float32. On a CPU both copies attend with
eager attention (:func:`cpu_attention`). Both decode faster than float32 on a CPU with bfloat16
instructions (AVX512-BF16 or AMX; without them bfloat16's matmuls may be the slower);
notebooks/throughput.ipynb times each precision's step against float32's. Both live on the
policy's device. The refresh is timed within the optimizer phase (``perf/optimizer_s``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.sharding import is_sharded
from forge_lightning.rollout.engines.base import EngineOptions
from forge_lightning.rollout.engines.hf import HFGenerate

# torch's CPU weight-only int8 kernel reads the input features in blocks of this many; other
# widths (a tiny model's) can crash it, and take the dequantizing matmul instead.
INT8_KERNEL_BLOCK = 16
# The kernel's time grows with the rows as a matrix-vector product's does: past about 16 rows
# (a prompt's prefill, a decoding batch of 64) the weight dequantized into a bfloat16 matmul is
# the faster (SmolLM2-135M's shapes, one thread: at 64 rows 0.3-0.8 ms against 0.6-2.1 ms).
INT8_KERNEL_MAX_ROWS = 16


class Int8Linear(nn.Module):
    """An ``nn.Linear`` of the sampling copy with its weight in int8: symmetric, one scale per
    output channel (its largest weight over 127); the input, scales, bias and output in the
    copy's float ``dtype``. Made from ``linear``'s weights once, sharing no memory with them."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # (out,)
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # (N, in)
        kernel = self.in_features % INT8_KERNEL_BLOCK == 0 and flat.shape[0] <= INT8_KERNEL_MAX_ROWS
        if flat.device.type == "cpu" and kernel:
            out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scale)  # (N, out)
        else:  # the weight dequantized, as torchao does without a compiler
            out = F.linear(flat, self.weight_int8.to(flat.dtype)) * self.scale
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def int8_copy(model: nn.Module) -> nn.Module:
    """``model`` in bfloat16 with every ``nn.Linear`` but the LM head an :class:`Int8Linear`, in
    place: quantized from the float32 weights, then the rest cast (``to`` leaves the int8 buffers
    int8). The head stays bfloat16 (tied to the embedding where it was): its vocabulary-wide
    matmul is faster there than in the int8 kernel (4.7 ms against 6.0 ms for 8 rows, 2 threads)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [(parent, name) for parent in model.modules() for name, child in parent.named_children()]
    for parent, name in linears:
        child = getattr(parent, name)
        if isinstance(child, nn.Linear) and child is not head:
            setattr(parent, name, Int8Linear(child, torch.bfloat16))
    return bf16_copy(model)


def bf16_copy(model: nn.Module) -> nn.Module:
    """``model`` in bfloat16, in place, attending as fits its device (:func:`cpu_attention`)."""
    return cpu_attention(model.to(torch.bfloat16))


def cpu_attention(model: nn.Module) -> nn.Module:
    """``model`` with eager attention where it is on a CPU. Decoding asks attention for one query
    token a row, and there torch's SDPA CPU kernels in bfloat16 run several times slower than in
    float32, eating most of what the copy saves in its matmuls; eager attention's two small
    matmuls run at bfloat16's speed. Elsewhere (a GPU's flash kernels) the model's own is kept."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    return model


# rollout_precision -> what makes the sampling copy of a detached copy of the policy
CASTS: dict[str, Callable[[nn.Module], nn.Module]] = {"int8": int8_copy, "bf16": bf16_copy}


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
