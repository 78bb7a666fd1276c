"""Lightning callbacks: the frozen reference, HF-format checkpoints and reward logging.

Each one works alone in a user's own ``Trainer``.
"""

from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.callbacks.reference import ReferenceModel
from forge_lightning.callbacks.reward_logger import RewardLogger
from forge_lightning.callbacks.step_boundary import SaveAtStepBoundaries

__all__ = ["HFCheckpoint", "ReferenceModel", "RewardLogger", "SaveAtStepBoundaries"]
