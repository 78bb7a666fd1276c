"""forge_lightning: GRPO fine-tuning of HuggingFace causal LMs with PyTorch Lightning.

The names below are imported on first use, so that a process needing one submodule (a
rollout server) does not pay for importing all of them.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from forge_lightning import _moved

__version__ = "0.1.0"

_moved.install()  # the module paths of the flat layout still import (_moved.py)


class _Dropped(logging.Filter):
    """Drops a logger's records that start with one of ``starts``."""

    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


# With torchao installed (the package no longer needs it; an environment may hold it), transformers
# imports it with every model class, and on a CPU build of torch torchao logs that its CUDA kernels
# did not load, and torch that torchao registers enums it no longer needs to: noise at every
# command, nothing to act on.
logging.getLogger("torchao").addFilter(_Dropped("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(_Dropped("<enum "))

# public name -> the submodule that defines it
_EXPORTS = {
    "HFCheckpoint": "forge_lightning.callbacks",
    "ReferenceModel": "forge_lightning.callbacks",
    "RewardLogger": "forge_lightning.callbacks",
    "GRPOConfig": "forge_lightning.compat",
    "GRPOTrainer": "forge_lightning.compat",
    "GSM8KDataModule": "forge_lightning.data",
    "PromptDataModule": "forge_lightning.data",
    "collate_records": "forge_lightning.data",
    "load_gsm8k": "forge_lightning.data",
    "load_gsm8k_mock": "forge_lightning.data",
    "GRPOLightningModule": "forge_lightning.module",
    "PhaseProfiler": "forge_lightning.reporting.profiler",
    "BaseReward": "forge_lightning.rewards",
    "CompositeReward": "forge_lightning.rewards",
    "ExactMatchReward": "forge_lightning.rewards",
    "FormatReward": "forge_lightning.rewards",
    "GSM8KAnswerReward": "forge_lightning.rewards",
    "LengthPenaltyReward": "forge_lightning.rewards",
    "OverlongPenaltyReward": "forge_lightning.rewards",
    "RewardOutput": "forge_lightning.rewards",
    "EnvironmentReward": "forge_lightning.rewards.environment",
}

__all__ = [
    "BaseReward",
    "CompositeReward",
    "EnvironmentReward",
    "ExactMatchReward",
    "FormatReward",
    "GRPOConfig",
    "GRPOLightningModule",
    "GRPOTrainer",
    "GSM8KAnswerReward",
    "GSM8KDataModule",
    "HFCheckpoint",
    "LengthPenaltyReward",
    "OverlongPenaltyReward",
    "PhaseProfiler",
    "PromptDataModule",
    "ReferenceModel",
    "RewardLogger",
    "RewardOutput",
    "collate_records",
    "load_gsm8k",
    "load_gsm8k_mock",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'forge_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from forge_lightning.callbacks import HFCheckpoint, ReferenceModel, RewardLogger
    from forge_lightning.compat import GRPOConfig, GRPOTrainer
    from forge_lightning.data import (
        GSM8KDataModule,
        PromptDataModule,
        collate_records,
        load_gsm8k,
        load_gsm8k_mock,
    )
    from forge_lightning.module import GRPOLightningModule
    from forge_lightning.reporting.profiler import PhaseProfiler
    from forge_lightning.rewards.environment import EnvironmentReward
    from forge_lightning.rewards.library import (
        BaseReward,
        CompositeReward,
        ExactMatchReward,
        FormatReward,
        GSM8KAnswerReward,
        LengthPenaltyReward,
        OverlongPenaltyReward,
        RewardOutput,
    )
