"""Lightning callbacks: the frozen reference, HF-format checkpoints, reward logging, the guards
(signal, collapse), the end of a fit at a goal (StopAtGoal) and the kill point that
``check-resume`` arms; :class:`RLLoopCallback`, the base of a callback that hooks into the RL loop
(rl_loop.py), and one such, :class:`SettledPromptFilter` (settled_prompt_filter.py).

Each one works alone in a user's own ``Trainer``.
"""

from forge_lightning._moved import renamed
from forge_lightning.callbacks.collapse_guard import CollapseGuard
from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.callbacks.kill_point import KillPoint
from forge_lightning.callbacks.reference import ReferenceModel
from forge_lightning.callbacks.reward_logger import RewardLogger
from forge_lightning.callbacks.rl_loop import RLLoopCallback
from forge_lightning.callbacks.settled_prompt_filter import SettledPromptFilter
from forge_lightning.callbacks.signal_guard import SignalGuard, SignalGuardError
from forge_lightning.callbacks.step_boundary import SaveAtStepBoundaries
from forge_lightning.callbacks.stop_at_goal import StopAtGoal

__all__ = [
    "CollapseGuard",
    "HFCheckpoint",
    "KillPoint",
    "ReferenceModel",
    "RLLoopCallback",
    "RewardLogger",
    "SaveAtStepBoundaries",
    "SettledPromptFilter",
    "SignalGuard",
    "SignalGuardError",
    "StopAtGoal",
]

__getattr__ = renamed(__name__, {"DifficultyCurriculum": "SettledPromptFilter"})
