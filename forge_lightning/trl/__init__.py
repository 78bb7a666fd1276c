"""TRL's interface, by import: ``from forge_lightning.trl import GRPOConfig, GRPOTrainer`` runs a TRL
GRPO script on this package, with TRL's names and defaults (the guide's *Coming from TRL*)."""

from forge_lightning.trl.config import GRPOConfig
from forge_lightning.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
