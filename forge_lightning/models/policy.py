"""The trainable policy: a loaded model made ready for training_step, once per fit."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.hf_compat import is_checkpointing, set_checkpointing, supports_shared_prefix
from forge_lightning.models.loading import load_model, warn_when_half_precision
from forge_lightning.models.lora import apply_lora, lora_settings
from forge_lightning.models.sharding import is_sharded, shard_for_training

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def prepare_policy(
    model: PreTrainedModel,
    *,
    peft: dict[str, Any] | None = None,
    gradient_checkpointing: bool = False,
    prefix_sharing: bool = True,
    mesh: DeviceMesh | None = None,
    generation_backend: str = "hf",
    precision: str | None = None,
) -> PreTrainedModel:
    """The policy to train: LoRA adapters added (``peft``), train mode, activation checkpointing,
    and FSDP2 sharding over ``mesh`` when ModelParallelStrategy gave one (mixed precision per
    the trainer's ``precision``, see models/sharding.py). Each step is skipped
    when already done, so calling this again (a second fit) changes nothing."""
    if peft is not None:
        model = apply_lora(model, lora_settings(peft))  # no-op once wrapped
    # from_pretrained leaves models in eval mode; dropout and friends must be live for training
    # (generation switches to eval and back by itself).
    model.train()
    if gradient_checkpointing and not is_checkpointing(model):
        set_checkpointing(model, True)
    if prefix_sharing and not supports_shared_prefix(model):
        warnings.warn(
            "prefix sharing is off for this model (no KV cache in training); using the full forward"
        )
    if mesh is not None and not is_sharded(model):
        shard_for_training(
            model, mesh, generation_backend=generation_backend, lora=peft is not None, precision=precision
        )
    return model


def training_policy(
    model: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase | None,
    spec: str | None,
    mesh: DeviceMesh | None,
    precision: str | None,
    *,
    dtype: str,
    attention: str | None,
    peft: dict[str, Any] | None,
    gradient_checkpointing: bool,
    prefix_sharing: bool,
    generation_backend: str,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """The module's ``configure_model``: the model ``spec`` names loaded (in ``dtype``, with the
    ``attention`` implementation and the spec's tokenizer unless one was given) where none is built
    yet, then made the policy to train (prepare_policy)."""
    if model is None:
        warn_when_half_precision(dtype)
        model, loaded = load_model(spec, dtype, attention)
        tokenizer = tokenizer or loaded
    policy = prepare_policy(
        model,
        peft=peft,
        gradient_checkpointing=gradient_checkpointing,
        prefix_sharing=prefix_sharing,
        mesh=mesh,
        generation_backend=generation_backend,
        precision=precision,
    )
    return policy, tokenizer
