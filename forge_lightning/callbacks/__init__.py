"""Lightning callbacks: the frozen reference, HF-format checkpoints, reward logging, the signal guard,
and the kill point that ``check-resume`` arms.

Each one works alone in a user's own ``Trainer``.
"""

from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.callbacks.kill_point import KillPoint
from forge_lightning.callbacks.reference import ReferenceModel
from forge_lightning.callbacks.reward_logger import RewardLogger
from forge_lightning.callbacks.signal_guard import SignalGuard, SignalGuardError
from forge_lightning.callbacks.step_boundary import SaveAtStepBoundaries

__all__ = [
    "HFCheckpoint",
    "KillPoint",
    "ReferenceModel",
    "RewardLogger",
    "SaveAtStepBoundaries",
    "SignalGuard",
    "SignalGuardError",
]
