"""Small shims over transformers API renames (4.x -> 5.x), in one place."""

from __future__ import annotations

import inspect
from typing import Any

from transformers import PreTrainedModel


def is_checkpointing(model: PreTrainedModel) -> bool:
    """Whether activation (gradient) checkpointing is on."""
    model = _unwrapped(model)
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def set_checkpointing(model: PreTrainedModel, enabled: bool) -> None:
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if not enabled:
        getattr(model, f"{prefix}_checkpointing_disable")()
        return
    # Non-reentrant, as 5.x defaults to: 4.x's reentrant default gives a LoRA adapter under a
    # frozen base no gradient (the checkpointed blocks' inputs do not require one).
    kwargs = {f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}
    getattr(model, f"{prefix}_checkpointing_enable")(**kwargs)


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the forward argument that takes a KV cache (``cache`` in 5.x)."""
    params = inspect.signature(type(_unwrapped(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a forward returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def supports_shared_prefix(model: PreTrainedModel) -> bool:
    """Prefix sharing needs a KV cache: off under gradient checkpointing or without cache support."""
    if is_checkpointing(model):
        return False
    return (
        bool(getattr(model, "_supports_cache_class", True))
        and getattr(model.config, "use_cache", True) is not False
    )


def _unwrapped(model: PreTrainedModel) -> PreTrainedModel:
    """The HF model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
