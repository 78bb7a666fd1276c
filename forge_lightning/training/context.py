"""What one training batch needs of the loop it runs in: a few functions and numbers.

The step (training/step.py), the plan and the optimizer step read these instead of a Trainer, so
each runs, and is tested, without one. The module builds a context per batch from its Lightning
trainer (callbacks/trainer_view.py's ``step_context``); :meth:`StepContext.one_process` is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from forge_lightning.training.loop_hooks import LoopHooks, NoHooks

ReduceOp = Literal["sum", "max"]
Reduce = Callable[[Tensor, ReduceOp], Tensor]  # a tensor summed (or maxed) over the ranks


@dataclass(frozen=True)
class StepContext:
    """The loop around a training batch, as the step sees it."""

    backward: Callable[[Tensor], None]  # the module's manual_backward (precision, DDP's gradient sync)
    gather: Callable[[Tensor], Tensor]  # every rank's tensor stacked on a new first dim (all_gather)
    reduce: Reduce  # across ranks; the tensor itself on one
    global_step: Callable[[], int]  # optimizer steps taken so far: it moves within a batch
    profile: Callable[[str], AbstractContextManager[Any]] = lambda phase: nullcontext()  # a phase's timer
    phases: Callable[[], dict[str, float]] = dict  # the latest step's seconds per phase, if timed
    loss_scale: Callable[[], float] = lambda: 1.0  # what a GradScaler (16-mixed) left on the gradients
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_training_batches: int | float = float("inf")  # batches in an epoch; inf when unknown
    epoch: int = 0
    max_steps: int = -1
    max_epochs: int | None = None
    log_every_n_steps: int = 50
    hooks: LoopHooks = field(default_factory=NoHooks)  # the callbacks' loop hooks (none: NoHooks)

    @classmethod
    def one_process(cls, backward: Callable[[Tensor], None] = Tensor.backward, **given: Any) -> StepContext:
        """A context for one process and no Trainer (``global_step``: 0 unless given)."""
        defaults: dict[str, Any] = {
            "gather": lambda tensor: tensor.unsqueeze(0),
            "reduce": lambda tensor, op: tensor,
            "global_step": lambda: 0,
        }
        return cls(backward=backward, **{**defaults, **given})

    def epoch_at(self, batch_idx: int | None) -> float:
        """The epoch, with the share of it the batches before ``batch_idx`` make (TRL's float epoch)."""
        batches = self.num_training_batches
        if batch_idx is None or not isinstance(batches, int) or batches <= 0:
            return float(self.epoch)
        return self.epoch + batch_idx / batches
