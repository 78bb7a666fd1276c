"""Seconds per phase of the latest training step, through Lightning's profiler interface."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from lightning.pytorch.profilers import Profiler
from typing_extensions import override

# The phases GRPOLightningModule.training_step profiles: sampling, scoring, every forward
# (reference, old policy, policy and the loss), every backward, and the optimizer step.
PHASES = ("generate", "reward", "logprob", "backward", "optimizer")


class PhaseProfiler(Profiler):
    """Keeps the seconds the latest training step spent in each phase; prints nothing.

    The module wraps each phase in ``self.trainer.profiler.profile(name)``. This profiler adds up
    the time of every action named in ``phases`` (a phase may run several times in a step, e.g.
    once per micro-batch) and starts a fresh table whenever Lightning starts a ``training_step``
    hook, so :meth:`last_step` always describes one whole step. On a GPU it waits for the queued
    kernels at both edges of a phase, so their time lands in the phase that launched them rather
    than in whichever one happens to synchronise next (Lightning's SimpleProfiler does not).

    Args:
        phases: the action names to time; every other action Lightning profiles is ignored.
    """

    def __init__(self, phases: Iterable[str] = PHASES) -> None:
        super().__init__()
        self.phases = tuple(phases)
        self._started: dict[str, float] = {}
        self._seconds: dict[str, float] = {}

    @override
    def start(self, action_name: str) -> None:
        if action_name.endswith(".training_step"):
            self._seconds = {}
        elif action_name in self.phases:
            synchronize()
            self._started[action_name] = time.perf_counter()

    @override
    def stop(self, action_name: str) -> None:
        started = self._started.pop(action_name, None)
        if started is not None:
            synchronize()
            self._seconds[action_name] = self._seconds.get(action_name, 0.0) + time.perf_counter() - started

    def last_step(self) -> dict[str, float]:
        """Seconds per phase of the latest (or current) training step; phases not run are absent."""
        return dict(self._seconds)


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
