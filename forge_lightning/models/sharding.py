"""FSDP2 sharding of the policy, for Lightning's ``ModelParallelStrategy``.

That strategy hands the module a device mesh and leaves the parallelisation to ``configure_model``:
each transformer block (the classes a HF model lists in ``_no_split_modules``) becomes one
``fully_shard`` unit, and the whole model the root unit that holds the rest (embeddings, final
norm, head). Every rank then holds 1/N of the weights, gradients and optimizer state, and a unit
gathers its full weights for its own forward and frees them after.

Why FSDP2 and not Lightning's ``FSDPStrategy`` (FSDP1): FSDP1 wraps the LightningModule rather than
the HF model, so ``generate`` would bypass the root unit's gathering, and its precision plugin
refuses the norm-based gradient clipping of the manual optimizer step.

What sharding changes elsewhere:

- Generation: every decoding step's forward gathers weights from all ranks, so a rank whose
  completions all ended early would stop calling that collective and hang the others;
  ``HFGenerate`` passes ``synced_gpus=True`` for a sharded policy, and a finished rank keeps
  stepping (producing padding) until every rank is done.
- The reference (``ReferenceModel``) is sharded over the same mesh; rank 0 gathers the policy once
  (or reads ``reference/`` on resume) and each rank keeps its shard.
- ``HFCheckpoint`` gathers the whole policy onto rank 0 (in CPU memory) for each folder: every rank
  takes part in that collective. Lightning checkpoints are whole files
  (``save_distributed_checkpoint: false`` in ``configs/overlays/fsdp.yaml``).
- Precision: under ``bf16-mixed`` / ``16-mixed`` each unit gets FSDP2's ``MixedPrecisionPolicy``:
  the shards (the master weights AdamW updates) stay float32, a unit's gathered weights are cast
  to half precision for its forward and backward, and gradients are reduced in float32.
- Refused: tensor parallelism, LoRA (an adapter is small enough for DDP) and vLLM (the engine
  would need the gathered weights after every step).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import PreTrainedModel


def mixed_precision_policy(precision: str | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for a Lightning ``precision``: half-precision compute on float32 shards, with
    float32 gradient reduction, under ``bf16-mixed`` / ``16-mixed``; None for any other."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    return None if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_policy(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Apply ``fully_shard`` over ``mesh`` to each transformer block of ``model``, then to ``model``,
    each with ``mp_policy`` when one is given."""
    from torch.distributed.fsdp import fully_shard  # public from torch 2.6

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    # Private but the one list of a model's transformer-block classes (accelerate's device maps read
    # it too). Checked on transformers 4.56.0 and 5.24.0; tests/test_private_api.py fails if it moves.
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block classes (_no_split_modules); "
            "it cannot be sharded block by block"
        )
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def shard_for_training(
    model: nn.Module, mesh: DeviceMesh, *, generation_backend: str, lora: bool, precision: str | None = None
) -> None:
    """FSDP2 over the data-parallel dimension of the mesh ModelParallelStrategy hands over (with
    the mixed-precision policy of ``precision``), after refusing what a sharded policy cannot do."""
    if mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not supported: set tensor_parallel_size=1")
    if generation_backend != "hf":
        raise ValueError("a sharded policy samples with generation_backend='hf' only")
    if lora:
        raise ValueError(
            "LoRA is not supported with a sharded policy; train the adapter with DDP (its "
            "gradients are small) or drop model.peft"
        )
    shard_policy(model, mesh["data_parallel"], mixed_precision_policy(precision))


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 unit (its forward gathers weights from every rank)."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no public FSDP2, so nothing here was sharded with it
        return False
    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state of a sharded ``model``, gathered on CPU on global rank 0 (``{}`` elsewhere).

    Collective: every rank must call it, in the same order.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sharded_copy(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A new model of ``model``'s class, sharded over the same mesh, holding ``state_dict``.

    ``state_dict`` is the full state on global rank 0 (what :func:`full_state_dict` returns there)
    and ignored elsewhere: rank 0 sends each tensor and every rank keeps only its shard, so no rank
    ever holds two whole models. Collective.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    param = next(model.parameters())
    copy = _empty_like(model, param.dtype)
    shard_policy(copy, param.device_mesh)
    copy.to_empty(device=param.device)
    # Not strict: a folder written by save_pretrained leaves out weights tied to others (lm_head).
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(copy, state_dict if torch.distributed.get_rank() == 0 else {}, options=options)
    # Non-persistent buffers (rotary frequencies) are in no state dict; to_empty left them unset.
    own = dict(model.named_buffers())
    for name, buffer in copy.named_buffers():
        buffer.copy_(own[name])
    return copy


def save_sharded_pretrained(
    model: PreTrainedModel, folder: Path, state_dict: dict[str, torch.Tensor]
) -> None:
    """``save_pretrained`` of a sharded ``model`` from its gathered ``state_dict`` (global rank 0).

    The tensors go through a plain, weightless model of the same class, so the folder's config
    names the HF architecture, not FSDP's wrapper class.
    """
    plain = _empty_like(model, next(iter(state_dict.values())).dtype)
    plain.load_state_dict(state_dict, strict=False, assign=True)
    plain.tie_weights()  # assign=True broke the sharing of tied weights (embeddings and head)
    plain.save_pretrained(folder)


def _empty_like(model: nn.Module, dtype: torch.dtype) -> PreTrainedModel:
    """A weightless (meta) model of the HF class under FSDP2's wrapper, with parameters of ``dtype``."""
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(model):
        raise ValueError(f"{type(model).__name__} is not sharded")
    # fully_shard swaps in a class deriving from both FSDPModule and the model's own class.
    cls = next(c for c in type(model).__mro__[1:] if not issubclass(c, FSDPModule))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return cls(model.config)
    finally:
        torch.set_default_dtype(previous)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF model folder (``model.safetensors`` or its shards), on CPU."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights
