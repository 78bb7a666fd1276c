"""A TRL ``GRPOConfig`` as this package's settings: the ``GRPOLightningModule``'s and the
``PromptDataModule``'s. TRL's renamed fields go through the one table of TRL names
(settings/trl_names.py); the rest are ours by the same name, or converted here where TRL counts
otherwise (completions per device for prompts per step) or says "none" otherwise (None for 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from forge_lightning.run.fit import FitShape
from forge_lightning.settings.trl_names import TRL_NAMES
from forge_lightning.training.plan import StepPlan
from forge_lightning.trl.config import SCHEDULES, GRPOConfig

# TRL fields that are a module setting of another name, the value unchanged (TRL_NAMES says which).
RENAMED = ("num_generations", "max_completion_length", "beta", "epsilon", "epsilon_high", "delta")
RENAMED += ("scale_rewards",)
# TRL fields that are a module setting of the same name.
SHARED = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "chat_template_kwargs",
    "loss_type",
    "importance_sampling_level",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "entropy_coef",
    "mask_truncated_completions",
    "num_iterations",
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "gradient_checkpointing",
    "vllm_gpu_memory_utilization",
)


@dataclass(frozen=True)
class BatchShape:
    """TRL's batch (completions per device and micro-batch, micro-batches per step and per
    generation) in this package's terms: prompts per training batch, batches per optimizer step,
    optimizer steps per generation, and completions per forward/backward."""

    prompts_per_step: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    train_micro_batch_size: int


def batch_shape(c: GRPOConfig, world_size: int) -> BatchShape:
    """Each generation samples ``per_device_train_batch_size x steps_per_generation`` completions
    per device, whole groups of ``num_generations``; an optimizer step takes
    ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``."""
    micro, accumulation, group = (
        c.per_device_train_batch_size,
        c.gradient_accumulation_steps,
        c.num_generations,
    )
    per_generation = c.steps_per_generation or accumulation
    if c.generation_batch_size is not None:
        if c.generation_batch_size % (micro * world_size):
            raise ValueError(
                f"generation_batch_size ({c.generation_batch_size}) must be divisible by the global batch "
                f"size ({micro * world_size})."
            )
        per_generation = c.generation_batch_size // (micro * world_size)
    completions = micro * per_generation  # a device's, each generation
    if (completions * world_size) % group:
        raise ValueError(
            f"generation_batch_size ({completions * world_size}) must be divisible by num_generations "
            f"({group})."
        )
    if completions % group:
        raise ValueError(
            f"each device samples {completions} completions a generation, not whole groups of {group}: a "
            "prompt's group stays on one device here; make per_device_train_batch_size x "
            "steps_per_generation a multiple of num_generations"
        )
    if per_generation % accumulation == 0:
        return BatchShape(completions // group, 1, per_generation // accumulation, micro)
    if accumulation % per_generation == 0:
        return BatchShape(completions // group, accumulation // per_generation, 1, micro)
    raise ValueError(
        f"steps_per_generation ({per_generation}) and gradient_accumulation_steps ({accumulation}) must "
        "divide one another here: an optimizer step takes whole generations, or a generation whole steps"
    )


def optimizer_steps(c: GRPOConfig, shape: BatchShape, train_size: int, world_size: int) -> int:
    """The fit's optimizer steps, as the module's step plan counts them (for TRL's shares of them)."""
    plan = StepPlan(shape.gradient_accumulation_steps, c.num_iterations, shape.steps_per_generation)
    epochs = int(c.num_train_epochs)
    batches = math.ceil(train_size / (shape.prompts_per_step * world_size))
    fit = FitShape(max_steps=c.max_steps, max_epochs=epochs, stepping_batches=lambda: batches * epochs)
    return plan.total_steps(fit)


def steps(value: float, total: int) -> int:
    """TRL's step count: itself, or below 1 a share of all ``total`` optimizer steps (rounded up)."""
    return int(value) if value >= 1 or value == 0 else max(1, math.ceil(value * total))


def module_settings(c: GRPOConfig, shape: BatchShape, total_steps: int, evaluates: bool) -> dict[str, Any]:
    """The ``GRPOLightningModule`` arguments (settings alone: the model, reward and tools are the
    trainer's) that make the run TRL's config describes."""
    settings = {_ours(name): getattr(c, name) for name in RENAMED}
    settings |= {name: getattr(c, name) for name in SHARED}
    settings |= {
        "min_p": c.min_p or 0.0,
        "generation_kwargs": _generation_kwargs(c),
        "generation_backend": "vllm" if c.use_vllm else "hf",
        "max_tool_calls": c.max_completion_length
        if c.max_tool_calling_iterations is None  # no limit: a call takes a token at least
        else c.max_tool_calling_iterations,
        "gradient_accumulation_steps": shape.gradient_accumulation_steps,
        "steps_per_generation": shape.steps_per_generation,
        "train_micro_batch_size": shape.train_micro_batch_size,
        "prefix_sharing": not c.gradient_checkpointing,  # it needs the KV cache checkpointing turns off
        "lr_schedule": SCHEDULES[c.lr_scheduler_type],
        "warmup_steps": _warmup(c, total_steps),
        **_correction(c),
        **_model_init(c.model_init_kwargs or {}),
    }
    if evaluates:
        settings |= {
            "val_num_generations": c.num_generations_eval or c.num_generations,
            "val_temperature": c.temperature,
            "val_top_p": c.top_p,
        }
    return settings


def data_settings(c: GRPOConfig, shape: BatchShape) -> dict[str, Any]:
    """The ``PromptDataModule`` arguments (all but the dataset) for TRL's batches and shuffle."""
    group = c.num_generations_eval or c.num_generations
    return {
        "prompt_field": "prompt",
        "max_samples": None,
        "val_max_samples": None,
        "prompts_per_step": shape.prompts_per_step,
        "val_batch_size": max(1, c.per_device_eval_batch_size // group),
        "shuffle": c.shuffle_dataset,
        "seed": c.seed if c.data_seed is None else c.data_seed,
        "num_workers": c.dataloader_num_workers,
    }


def _ours(trl_name: str) -> str:
    target = TRL_NAMES[trl_name]
    if target is None or not target.startswith("model."):
        raise AssertionError(f"{trl_name} is no module setting in settings/trl_names.py: {target}")
    return target.removeprefix("model.")


def _generation_kwargs(c: GRPOConfig) -> dict[str, Any] | None:
    extra = {} if c.cache_implementation is None else {"cache_implementation": c.cache_implementation}
    return {**(c.generation_kwargs or {}), **extra} or None


def _warmup(c: GRPOConfig, total_steps: int) -> int:
    if c.lr_scheduler_type == "constant":
        return 0  # transformers' "constant" has no warmup
    if c.warmup_ratio is not None:
        return math.ceil(c.warmup_ratio * total_steps)
    return steps(c.warmup_steps, total_steps)


def _correction(c: GRPOConfig) -> dict[str, Any]:
    """TRL corrects vLLM's sampling mismatch by default; HF generation needs no correction."""
    if not (c.use_vllm and c.vllm_importance_sampling_correction):
        return {}
    level, _, kind = c.vllm_importance_sampling_mode.partition("_")
    cap = c.vllm_importance_sampling_cap or c.vllm_importance_sampling_clip_max
    return {"rollout_correction": kind, "rollout_correction_level": level, "rollout_correction_cap": cap}


def _model_init(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``model_init_kwargs``' dtype (TRL's default float32, ours too) and attention."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "float32"))
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    settings: dict[str, Any] = {"model_dtype": name}
    if kwargs.get("attn_implementation") is not None:
        settings["attn_implementation"] = kwargs["attn_implementation"]
    return settings
