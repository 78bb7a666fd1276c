"""The Forge entry point, kept for its users: ``GRPOConfig`` and ``GRPOTrainer(...).train(dataset)``.

Nothing here trains by itself: the config is mapped onto the module, a dataloader, the callbacks
and a Lightning ``Trainer``, which do the work exactly as they do from the CLI.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from torch.utils.data import DataLoader
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.callbacks import HFCheckpoint, RewardLogger, SignalGuard
from forge_lightning.data.datamodule import EpochShuffleSampler, collate_records
from forge_lightning.grpo import LossType
from forge_lightning.module import GRPOLightningModule
from forge_lightning.reporting.profiler import PhaseProfiler
from forge_lightning.settings.checks import validate_hparams
from forge_lightning.settings.trl_names import pointing_at_settings

# GRPOConfig fields that are GRPOLightningModule arguments of the same name.
MODULE_FIELDS = (
    "group_size",
    "clip_epsilon",
    "kl_beta",
    "temperature",
    "max_new_tokens",
    "learning_rate",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "warmup_steps",
    "loss_type",
)


@dataclass
class GRPOConfig:
    """Forge's configuration, field for field with its defaults (see README for where each lives).

    ``loss_type`` defaults to ``"forge"`` here so a Forge script gets Forge's numbers; the CLI and
    the module default to ``"grpo"``.
    """

    group_size: int = 8
    clip_epsilon: float = 0.2
    kl_beta: float = 0.01
    temperature: float = 0.9
    max_new_tokens: int = 512
    learning_rate: float = 5e-6
    gradient_accumulation_steps: int = 4
    max_grad_norm: float = 1.0
    num_train_epochs: int = 3
    save_steps: int = 100
    logging_steps: int = 10
    output_dir: str = "forge_output"
    use_wandb: bool = False
    wandb_project: str = "forge"
    wandb_run_name: str = "grpo_run"
    seed: int = 42
    warmup_steps: int = 0
    loss_type: LossType = "forge"

    def __post_init__(self) -> None:
        validate_hparams(dataclasses.asdict(self))


# TRL's GRPOConfig names (num_generations, beta, ...) point at this config's field or the module's
# setting; a close misspelling of a field gets "did you mean" (settings/trl_names.py).
GRPOConfig.__init__ = pointing_at_settings(GRPOConfig.__init__, config=True)  # type: ignore[method-assign]


class GRPOTrainer:
    """Forge's trainer interface on top of Lightning.

    Args:
        model: a HuggingFace causal LM (trained in place).
        tokenizer: its tokenizer.
        reward_fn: a reward object or any ``(prompts, responses, **kwargs) -> list[float]``.
        config: the algorithm and run settings.
        trainer_kwargs: extra ``lightning.Trainer`` arguments (e.g. ``accelerator``, ``precision``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        reward_fn: Callable[..., Any],
        config: GRPOConfig | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        self.config = config or GRPOConfig()
        self.module = GRPOLightningModule(
            model=model,
            tokenizer=tokenizer,
            reward=reward_fn,
            **{name: getattr(self.config, name) for name in MODULE_FIELDS},
        )
        self.trainer_kwargs = trainer_kwargs
        self.trainer: pl.Trainer | None = None

    def train(self, dataset: Sequence[dict[str, Any]]) -> None:
        """Train on ``[{"prompt": ..., "reference": ...}, ...]`` for ``num_train_epochs`` epochs."""
        if not dataset:
            raise ValueError("dataset is empty: pass a list of {'prompt': ..., 'reference': ...} dicts")
        missing = [i for i, row in enumerate(dataset) if "prompt" not in row]
        if missing:
            raise ValueError(f"dataset row {missing[0]} has no 'prompt' key")
        cfg = self.config
        pl.seed_everything(cfg.seed, verbose=False)
        loader = DataLoader(
            list(dataset),
            batch_size=1,  # Forge's step is one prompt's group
            sampler=EpochShuffleSampler(len(dataset), seed=cfg.seed, shuffle=True),
            collate_fn=collate_records,
        )
        kwargs: dict[str, Any] = {
            "max_epochs": cfg.num_train_epochs,
            "default_root_dir": cfg.output_dir,
            "logger": self._loggers(),
            "callbacks": [
                HFCheckpoint(save_steps=cfg.save_steps),
                RewardLogger(logging_steps=cfg.logging_steps),
                SignalGuard(),
            ],
            "enable_checkpointing": False,
            "profiler": PhaseProfiler(),
            "num_sanity_val_steps": 0,
            "devices": 1,
        }
        kwargs.update(self.trainer_kwargs)
        self.trainer = pl.Trainer(**kwargs)
        self.trainer.fit(self.module, train_dataloaders=loader)

    def _loggers(self) -> list[Logger]:
        cfg = self.config
        loggers: list[Logger] = [TensorBoardLogger(save_dir=cfg.output_dir, name="tensorboard")]
        if cfg.use_wandb:
            if importlib.util.find_spec("wandb") is None:
                warnings.warn(
                    "use_wandb=True but wandb is not installed; logging to TensorBoard and JSONL only"
                )
            else:
                from lightning.pytorch.loggers import WandbLogger

                loggers.append(WandbLogger(project=cfg.wandb_project, name=cfg.wandb_run_name))
        return loggers
