"""LoRA adapters through PEFT: the settings, wrapping the policy, and folding adapters into weights.

With an adapter the base weights stay frozen, so the policy with its adapter switched off is the
policy as it was before training: that is the KL reference, and no second copy of the weights is
needed. ``peft`` is imported only when an adapter is built or loaded (``pip install
"forge-lightning[peft]"``).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

_INSTALL_HINT = 'LoRA needs the peft package: pip install "forge-lightning[peft]"'
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class LoraSettings:
    """A LoRA adapter on the policy (the ``model.peft`` section of a config).

    Args:
        r: rank of each adapter's low-rank update.
        alpha: scaling numerator; the update is multiplied by ``alpha / r``.
        dropout: dropout on the adapter's input during training.
        target_modules: module names (or a regex) that get an adapter; ``all-linear`` takes every
            linear layer except the output head; None: PEFT's default for the architecture (as
            ``LoraConfig`` without ``target_modules``; ``q_proj`` and ``v_proj`` for Llama).
        merge_on_save: besides the adapter, ``HFCheckpoint`` writes the merged full model to
            ``<checkpoint>/merged/``, loadable without peft.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str | None = "all-linear"
    merge_on_save: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"peft.r must be an integer >= 1, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"peft.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"peft.dropout must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("peft.target_modules must name at least one module (or 'all-linear')")


# PEFT's LoraConfig fields -> ours. Its other fields are taken at PEFT's defaults only (the adapter
# apply_lora builds), task_type as CAUSAL_LM (or unset), and PEFT's bookkeeping (what
# get_peft_model or from_pretrained write into a config) as whatever it holds.
PEFT_NAMES = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
_PEFT_IGNORED = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path")
_PEFT_IGNORED += ("revision", "inference_mode")


def lora_settings(value: LoraSettings | dict[str, Any] | Any | None) -> LoraSettings | None:
    """``value`` as LoraSettings: a dict of its fields (as a checkpoint keeps them), or PEFT's
    ``LoraConfig`` (TRL's ``peft_config``) as an object or a dict of its fields (``lora_alpha``,
    ``lora_dropout``, ``task_type``...; ``merge_on_save`` may join them), its names made ours."""
    if value is None or isinstance(value, LoraSettings):
        return value
    ours = {field.name for field in dataclasses.fields(LoraSettings)}
    if isinstance(value, dict) and set(value) <= ours:
        return LoraSettings(**value)
    if isinstance(value, dict):
        given = {name: setting for name, setting in value.items() if name != "merge_on_save"}
        try:
            config = import_peft().LoraConfig(**given)
        except TypeError as err:
            raise ValueError(
                f"peft: {err}; a dict takes LoraSettings' fields ({', '.join(sorted(ours))}) or "
                "PEFT LoraConfig's (lora_alpha, lora_dropout, ...), not both"
            ) from None
        return _from_peft(config, merge_on_save=bool(value.get("merge_on_save", False)))
    if type(value).__module__.startswith("peft.") and hasattr(value, "peft_type"):
        return _from_peft(value)
    kind = type(value).__name__
    raise TypeError(f"peft must be LoraSettings, PEFT's LoraConfig or a dict of either's fields, got {kind}")


def _from_peft(config: Any, merge_on_save: bool = False) -> LoraSettings:
    """PEFT's ``LoraConfig`` as LoraSettings; a field set to what this adapter cannot be is refused
    by name (another task than a causal LM's, another PEFT method, DoRA, biases, ...)."""
    kind = getattr(config.peft_type, "value", config.peft_type)
    if kind != "LORA":
        raise ValueError(
            f"peft: PEFT's {type(config).__name__} ({kind}) is not taken here: LoRA only (LoraConfig)"
        )
    task = getattr(config.task_type, "value", config.task_type)
    if task not in (None, "CAUSAL_LM"):
        raise ValueError(
            f"peft: task_type {task!r} is not taken here: the policy is a causal LM that GRPO samples "
            "from, so its adapter's task_type is CAUSAL_LM"
        )
    default, taken = type(config)(), (*PEFT_NAMES, *_PEFT_IGNORED)
    changed = [
        f"{field.name}={getattr(config, field.name)!r}"
        for field in dataclasses.fields(config)
        if field.name not in taken and getattr(config, field.name) != getattr(default, field.name)
    ]
    if changed:
        raise ValueError(
            f"peft: LoraConfig's {', '.join(changed)} not taken here: the adapter is LoRA's r, lora_alpha, "
            "lora_dropout and target_modules, its other fields at PEFT's defaults"
        )
    modules = config.target_modules
    settings = {ours: getattr(config, name) for name, ours in PEFT_NAMES.items()}
    settings["target_modules"] = sorted(modules) if isinstance(modules, (set, frozenset)) else modules
    return LoraSettings(**settings, merge_on_save=merge_on_save)


def import_peft() -> ModuleType:
    """The ``peft`` module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("peft")
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err


def has_adapter(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (its base weights wrapped with adapters)."""
    return hasattr(model, "get_base_model") and hasattr(model, "disable_adapter")


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> PreTrainedModel:
    """``model`` wrapped with a fresh, trainable LoRA adapter; a PEFT model is returned as it is.

    Only the adapter's parameters require gradients afterwards; the base weights are frozen.
    """
    if has_adapter(model):
        return model
    peft = import_peft()
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
    )
    return peft.get_peft_model(model, config)


def adapter_disabled(model: Any) -> AbstractContextManager[Any]:
    """A context in which ``model`` runs on its base weights alone (nothing to do without adapters)."""
    return model.disable_adapter() if has_adapter(model) else nullcontext()


def load_adapter_folder(folder: Path, base: PreTrainedModel) -> PreTrainedModel:
    """The adapter saved in ``folder`` folded into ``base``: a plain HF model, no peft wrapper left."""
    peft = import_peft()
    return peft.PeftModel.from_pretrained(base, folder).merge_and_unload()


def adapter_base(folder: Path) -> str:
    """The base model an adapter folder was trained on (``base_model_name_or_path``)."""
    peft = import_peft()
    base = peft.PeftConfig.from_pretrained(folder).base_model_name_or_path
    if not base:
        raise ValueError(
            f"the adapter in {folder} does not name its base model (base_model_name_or_path is empty in "
            f"{ADAPTER_CONFIG}); set it to the base model's folder or hub id"
        )
    return base


_ADAPTER_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")


def _checkpoint_name(name: str) -> str | None:
    """A wrapped base model's parameter name as the plain model names it; None for adapter tensors."""
    if ".lora_" in name or ".original_module." in name:
        return None
    return _ADAPTER_COPY.sub(".", name.replace(".base_layer.", "."))


@torch.no_grad()
def merged_weights(model: PreTrainedModel) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs of the policy under the base model's checkpoint names.

    A PEFT model's LoRA adapters are folded into their base weights (``W + scale * B @ A``, what
    ``merge_and_unload`` computes) one layer at a time, without touching the model; the adapter
    matrices themselves are not part of the result. A plain model's parameters come as they are.
    """
    if not has_adapter(model):
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    base = model.get_base_model()
    lora_layers = {
        name: module
        for name, module in base.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    for name, param in base.named_parameters():
        name = _checkpoint_name(name)
        if name is None:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = lora_layers.get(owner)
        if layer is None or leaf != "weight":
            yield name, param.detach()
            continue
        merged = param.detach().clone()
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            if getattr(layer, "use_dora", {}).get(adapter, False):
                raise NotImplementedError(f"{owner}: DoRA adapters cannot be folded into plain weights")
            merged += layer.get_delta_weight(adapter).to(merged.dtype)
        yield name, merged


def save_merged(model: PreTrainedModel, folder: Path) -> None:
    """Write a PEFT policy with its adapters folded in as a plain ``save_pretrained`` folder.

    The merged tensors are built one layer at a time beside the model, which is never modified.
    """
    base = model.get_base_model()
    state = {}
    for name, tensor in base.state_dict().items():  # parameters and persistent buffers
        plain = _checkpoint_name(name)
        if plain is not None:
            state[plain] = tensor
    state.update(merged_weights(model))
    base.save_pretrained(folder, state_dict=state)
