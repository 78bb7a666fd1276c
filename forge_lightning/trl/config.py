"""TRL's ``GRPOConfig``, field for field with TRL's defaults (trl 1.16 on transformers 5), for the
TRL route: ``from forge_lightning.trl import GRPOConfig, GRPOTrainer``.

Each field here has a meaning on this route (trl/settings.py and trl/lightning.py say where it lands: a
``GRPOLightningModule`` setting, the datamodule, the Lightning ``Trainer`` or a callback). TRL's
fields without one are taken at TRL's default and refused by name, with the reason, at any other
value (trl/unsupported.py); so is a value a field cannot take here (``loss_type="bnpo"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forge_lightning.trl.unsupported import foreign_keywords

# TRL's losses and the reason for each one not implemented here.
LOSSES = ("grpo", "dapo", "dr_grpo", "cispo", "sapo")
OTHER_LOSSES = {
    "bnpo": "bnpo (normalised over the local batch's tokens) is not implemented: dapo normalises over the "
    "accumulated batch's, which bnpo equals with one device and per_device_train_batch_size completions",
    "luspo": "luspo is not implemented here",
    "vespo": "vespo is not implemented here",
}
# transformers' schedule names -> ours (HF's "constant" has no warmup: warmup_steps is then 0).
SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
SCALES = ("group", "batch", "none")
STRATEGIES = ("no", "steps", "epoch")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")  # the one AdamW here, fused where it can be
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOGGERS = ("tensorboard", "wandb", "mlflow")  # report_to's services here (Lightning's loggers)
MODEL_INIT_KEYS = ("dtype", "torch_dtype", "attn_implementation", "device_map")


@dataclass
class GRPOConfig:
    """TRL's GRPO configuration with TRL's defaults; see TRL's documentation for each field, and
    the guide's *Coming from TRL* for where they differ from this package's own defaults."""

    output_dir: str | None = None
    """the run's folder (``trainer.default_root_dir``); None: ``trainer_output``."""
    # -- the batch (TRL counts completions, this package prompts: trl/settings.py converts)
    per_device_train_batch_size: int = 8
    """completions per device per forward/backward (a micro-batch: ``train_micro_batch_size``)."""
    per_device_eval_batch_size: int = 8
    """completions per device per evaluation batch."""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step."""
    generation_batch_size: int | None = None
    """completions per generation, all devices; None: one optimizer step's."""
    steps_per_generation: int | None = None
    """micro-batches each generation feeds; None: ``gradient_accumulation_steps``."""
    num_generations: int = 8
    """completions per prompt (``group_size``)."""
    num_generations_eval: int | None = None
    """completions per prompt in evaluation; None: ``num_generations``."""
    shuffle_dataset: bool = True
    """reshuffle the training prompts every epoch."""
    # -- sampling
    max_completion_length: int = 512
    """the longest completion, in tokens (``max_new_tokens``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    """more settings for the engine by its own names (refused by name where the module sets one)."""
    chat_template_kwargs: dict[str, Any] | None = None
    cache_implementation: str | None = None
    """a ``generation_kwargs`` key here."""
    use_vllm: bool = False
    """sample with vLLM in the trainer's process (``generation_backend: vllm``)."""
    vllm_gpu_memory_utilization: float = 0.3
    vllm_importance_sampling_correction: bool = True
    """with vLLM, correct for the sampler's mismatch (``rollout_correction``)."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """``token_`` or ``sequence_`` + ``mask`` or ``truncate``."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_cap: float | None = None
    """the cap of the correction's weight; None: ``vllm_importance_sampling_clip_max``."""
    max_tool_calling_iterations: int | None = None
    """tool calls per completion; None: as many as its tokens allow."""
    # -- the loss
    beta: float = 0.0
    """the KL weight (``kl_beta``); 0 loads no reference."""
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    """the cap of a negative advantage's ratio (``clip_ratio_c``, dual clip); None: none."""
    num_iterations: int = 1
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    entropy_coef: float = 0.0
    scale_rewards: str | bool = "group"
    """``group``/True, ``batch``, or ``none``/False (``advantage_scale``)."""
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None
    """a weight per reward function; None: 1 each."""
    # -- the model
    model_init_kwargs: dict[str, Any] | None = None
    """``dtype`` (``model_dtype``; TRL's default float32), ``attn_implementation``."""
    gradient_checkpointing: bool = True
    # -- the optimizer
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    """optimizer steps of warmup; below 1, a share of all of them."""
    warmup_ratio: float | None = None
    """the share of the optimizer steps that warm up (transformers 4's name)."""
    # -- the run
    num_train_epochs: float = 3.0
    max_steps: int = -1
    """optimizer steps; -1: ``num_train_epochs`` decide."""
    seed: int = 42
    data_seed: int | None = None
    """the shuffle's seed; None: ``seed``."""
    bf16: bool | None = None
    """bf16 mixed precision; None: where the accelerator has bf16, or with ``use_cpu``."""
    fp16: bool = False
    use_cpu: bool = False
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    """None only: the module checkpoints with transformers' defaults."""
    dataloader_num_workers: int = 0
    disable_tqdm: bool | None = None
    """no progress bar."""
    resume_from_checkpoint: str | None = None
    """kept for the script to pass to ``train()``, as in transformers."""
    # -- logging, saving, evaluation
    logging_strategy: str = "steps"
    logging_steps: float = 10
    """optimizer steps between log lines; below 1, a share of all of them."""
    log_completions: bool = False
    """sample completions in TensorBoard's text tab (``reward_logger.num_text_samples``)."""
    num_completions_to_print: int | None = None
    report_to: str | list[str] = "none"
    """``none``, ``all``, or any of tensorboard, wandb, mlflow (Lightning's loggers)."""
    run_name: str | None = None
    save_strategy: str = "steps"
    save_steps: float = 500
    """optimizer steps between checkpoints; below 1, a share of all of them."""
    save_total_limit: int | None = None
    """the HF step folders kept (the newest); the Lightning ``last.ckpt`` is one file."""
    save_only_model: bool = False
    """True: HF step folders alone, no resumable ``last.ckpt``."""
    eval_strategy: str = "no"
    eval_steps: float | None = None
    """optimizer steps between evaluations; None: ``logging_steps``."""

    def __post_init__(self) -> None:
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        self.report_to = _services(self.report_to)
        _check_choices(self)
        _check_numbers(self)


def _check_choices(c: GRPOConfig) -> None:
    if c.loss_type in OTHER_LOSSES:
        raise ValueError(f"GRPOConfig(loss_type={c.loss_type!r}) is refused: {OTHER_LOSSES[c.loss_type]}")
    choices = {
        "loss_type": (c.loss_type, LOSSES),
        "scale_rewards": (c.scale_rewards, SCALES),
        "lr_scheduler_type": (c.lr_scheduler_type, tuple(SCHEDULES)),
        "logging_strategy": (c.logging_strategy, STRATEGIES),
        "save_strategy": (c.save_strategy, STRATEGIES),
        "eval_strategy": (c.eval_strategy, STRATEGIES),
        "optim": (c.optim, OPTIMIZERS),
        "importance_sampling_level": (c.importance_sampling_level, ("token", "sequence")),
        "vllm_importance_sampling_mode": (c.vllm_importance_sampling_mode, IMPORTANCE_SAMPLING_MODES),
    }
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"GRPOConfig({name}={value!r}) is refused: this route takes one of {allowed}")
    unknown = sorted(set(c.model_init_kwargs or {}) - set(MODEL_INIT_KEYS))
    if unknown:
        raise ValueError(
            f"GRPOConfig(model_init_kwargs=...) is refused for {unknown}: the model is loaded here with a "
            "dtype and an attn_implementation only (quantized loading is not supported)"
        )
    if c.gradient_checkpointing_kwargs:
        raise ValueError(
            "GRPOConfig(gradient_checkpointing_kwargs=...) is refused: checkpointing takes transformers' "
            "defaults here"
        )


def _check_numbers(c: GRPOConfig) -> None:
    if c.generation_batch_size is not None and c.steps_per_generation is not None:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"
        )
    if c.num_generations < 2:
        raise ValueError(f"GRPO needs 2 or more completions per prompt: num_generations={c.num_generations}")
    if c.fp16 and c.bf16:
        raise ValueError("At most one of fp16 and bf16 can be True, but not both")
    if c.max_steps <= 0 and c.num_train_epochs != math.floor(c.num_train_epochs):
        raise ValueError(
            f"GRPOConfig(num_train_epochs={c.num_train_epochs}) is refused: Lightning trains whole epochs; "
            "set max_steps for a part of one"
        )
    if c.warmup_ratio is not None and c.warmup_steps:
        raise ValueError("set warmup_steps or warmup_ratio, not both")


def _services(report_to: str | list[str] | None) -> list[str]:
    """``report_to`` as the list of its services (transformers' ``"none"`` is none)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names in (["none"], ["all"]):
        return [] if names == ["none"] else ["all"]
    refused = [n for n in names if n not in LOGGERS]
    if refused:
        raise ValueError(
            f"GRPOConfig(report_to={report_to!r}) is refused for {refused}: this route reports to {LOGGERS}"
        )
    return names


def _taking_trl_names(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` taking TRL's fields without a meaning here at their defaults (trl/unsupported.py)."""
    accepted = [f.name for f in dataclasses.fields(GRPOConfig)]

    @functools.wraps(init)
    def checked(self: GRPOConfig, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **foreign_keywords(kwargs, accepted))

    return checked


GRPOConfig.__init__ = _taking_trl_names(GRPOConfig.__init__)  # type: ignore[method-assign]
