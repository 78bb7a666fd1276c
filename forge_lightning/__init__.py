"""forge_lightning: GRPO fine-tuning of HuggingFace causal LMs with PyTorch Lightning."""

from forge_lightning.callbacks import HFCheckpoint, ReferenceModel, RewardLogger
from forge_lightning.compat import GRPOConfig, GRPOTrainer
from forge_lightning.data import GSM8KDataModule, load_gsm8k, load_gsm8k_mock
from forge_lightning.module import GRPOLightningModule
from forge_lightning.profiler import PhaseProfiler
from forge_lightning.rewards import (
    BaseReward,
    CompositeReward,
    ExactMatchReward,
    FormatReward,
    GSM8KAnswerReward,
    LengthPenaltyReward,
    OverlongPenaltyReward,
    RewardOutput,
)

__version__ = "0.1.0"

__all__ = [
    "BaseReward",
    "CompositeReward",
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
    "ReferenceModel",
    "RewardLogger",
    "RewardOutput",
    "load_gsm8k",
    "load_gsm8k_mock",
]
