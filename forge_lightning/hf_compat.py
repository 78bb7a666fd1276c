"""Small shims over transformers API renames (4.x -> 5.x), in one place."""

from __future__ import annotations

import inspect
from typing import Any

from transformers import PreTrainedModel


def is_checkpointing(model: PreTrainedModel) -> bool:
    """Whether activation (gradient) checkpointing is on."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def set_checkpointing(model: PreTrainedModel, enabled: bool) -> None:
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{prefix}_checkpointing_{'enable' if enabled else 'disable'}")()


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the forward argument that takes a KV cache (``cache`` in 5.x)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a forward returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
