"""A TRL ``GRPOConfig`` as a Lightning ``Trainer``: steps, epochs, precision, devices, loggers
(``report_to``) and the run's callbacks (logging, HF step folders, the resumable ``last.ckpt``,
evaluation), with TRL's cadences in optimizer steps.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from forge_lightning.callbacks import HFCheckpoint, RewardLogger, SignalGuard
from forge_lightning.reporting.profiler import PhaseProfiler
from forge_lightning.trl.config import LOGGERS, GRPOConfig
from forge_lightning.trl.settings import BatchShape, steps

DEFAULT_OUTPUT_DIR = "trainer_output"  # transformers' folder when output_dir is None
CHECKPOINTS = "checkpoints"  # under the run folder: last.ckpt, for resume_from_checkpoint
# A launcher (torchrun, accelerate launch) sets these; Lightning then takes its devices from them.
LAUNCHED = ("LOCAL_WORLD_SIZE", "WORLD_SIZE")


def run_folder(c: GRPOConfig) -> Path:
    return Path(c.output_dir or DEFAULT_OUTPUT_DIR)


def world_size() -> int:
    """The processes a launcher started (1 without one): TRL's ``num_processes``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def precision(c: GRPOConfig) -> str:
    """TRL's ``bf16`` (on unless ``fp16``) as Lightning's precision. Left unset, bf16 where the
    accelerator has it or with ``use_cpu``, as TRL; elsewhere (a CPU run without ``use_cpu``, which
    transformers refuses) full precision."""
    if c.fp16:
        return "16-mixed"
    bf16 = c.bf16
    if bf16 is None:
        bf16 = c.use_cpu or (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return "bf16-mixed" if bf16 else "32-true"


def trainer_settings(c: GRPOConfig, shape: BatchShape, total_steps: int, evaluates: bool) -> dict[str, Any]:
    """The ``lightning.Trainer`` arguments, callbacks and loggers included."""
    launched = any(name in os.environ for name in LAUNCHED)
    epochs = int(c.num_train_epochs)
    settings: dict[str, Any] = {
        "default_root_dir": str(run_folder(c)),
        "max_steps": c.max_steps,
        "max_epochs": -1 if c.max_steps > 0 else epochs,  # TRL: max_steps overrides the epochs
        "accelerator": "cpu" if c.use_cpu else "auto",
        "devices": "auto" if launched else 1,
        "precision": precision(c),
        "logger": loggers(c) or False,
        "callbacks": run_callbacks(c, total_steps),
        "enable_checkpointing": checkpointing(c),
        "enable_progress_bar": not c.disable_tqdm,
        "log_every_n_steps": max(1, steps(c.logging_steps, total_steps)),
        "num_sanity_val_steps": 0,
        "profiler": PhaseProfiler(),
    }
    return settings | evaluation(c, shape, total_steps, evaluates)


def checkpointing(c: GRPOConfig) -> bool:
    """Whether the run keeps a resumable Lightning checkpoint (TRL's ``checkpoint-N`` folders)."""
    return c.save_strategy != "no" and not c.save_only_model


def run_callbacks(c: GRPOConfig, total_steps: int) -> list[Callback]:
    """The JSONL/console log every ``logging_steps``, the HF step folders every ``save_steps``
    (and ``final/``), ``last.ckpt`` as often, and the guard that warns of steps training nothing."""
    per_epoch = math.ceil(total_steps / max(int(c.num_train_epochs), 1)) if c.max_steps <= 0 else total_steps
    callbacks: list[Callback] = [SignalGuard()]
    if c.logging_strategy != "no":
        every = per_epoch if c.logging_strategy == "epoch" else steps(c.logging_steps, total_steps)
        shown = (c.num_completions_to_print or 8) if c.log_completions else 0
        callbacks.append(RewardLogger(logging_steps=max(every, 1), num_text_samples=shown))
    save = None
    if c.save_strategy != "no":
        save = per_epoch if c.save_strategy == "epoch" else steps(c.save_steps, total_steps)
    callbacks.append(HFCheckpoint(save_steps=save, save_total_limit=c.save_total_limit))
    if checkpointing(c):
        folder = str(run_folder(c) / CHECKPOINTS)
        callbacks.append(ModelCheckpoint(folder, every_n_train_steps=save, save_last=True, save_top_k=0))
    return callbacks


def evaluation(c: GRPOConfig, shape: BatchShape, total_steps: int, evaluates: bool) -> dict[str, Any]:
    """When the eval dataset is validated: every ``eval_steps`` optimizer steps (``logging_steps``
    when unset; Lightning counts training batches), every epoch, or never."""
    if not evaluates:
        return {"limit_val_batches": 0}
    if c.eval_strategy == "epoch":
        return {"check_val_every_n_epoch": 1}
    every = steps(c.logging_steps if c.eval_steps is None else c.eval_steps, total_steps)
    per_batch = shape.steps_per_generation * c.num_iterations
    if per_batch > 1 and every % per_batch:
        raise ValueError(
            f"eval_steps ({every}) must be a multiple of the optimizer steps a generation takes here "
            f"({per_batch}: steps_per_generation / gradient_accumulation_steps x num_iterations)"
        )
    batches = every // per_batch if per_batch > 1 else every * shape.gradient_accumulation_steps
    return {"val_check_interval": batches, "check_val_every_n_epoch": None}


def loggers(c: GRPOConfig) -> list[Logger]:
    """``report_to``'s services as Lightning's loggers (``all``: those installed)."""
    wanted = c.report_to
    if wanted == ["all"]:
        installed = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
        wanted = [name for name in LOGGERS if importlib.util.find_spec(installed[name]) is not None]
    root = str(run_folder(c))
    made: list[Logger] = []
    for name in wanted:
        if name == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            made.append(TensorBoardLogger(save_dir=root, name="tensorboard", default_hp_metric=False))
        elif name == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            project = os.environ.get("WANDB_PROJECT", "huggingface")  # transformers' WandbCallback's
            made.append(WandbLogger(project=project, name=c.run_name, save_dir=root))
        elif name == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default")
            made.append(MLFlowLogger(experiment_name=experiment, run_name=c.run_name))
    return made
