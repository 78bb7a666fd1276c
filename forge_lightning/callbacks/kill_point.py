"""A fit that SIGKILLs itself at a hard moment, to check that a resume continues exactly
(``forge-lightning check-resume``, cli/check_resume.py).

The moment is named by ``$FORGE_KILL_POINT``, so one command line serves the run that is killed
and the runs that resume it (which leave it unset)::

    backward@2/2         after the first backward of the 2nd batch of optimizer step 2 (inside
                         an accumulated step: the 1st batch's gradient is held, no step taken)
    batch_end@2          as the batch that ends step 2 ends, before that step's checkpoint (an
                         async run: the batches handed to the rollout servers are in flight)
    write@2/last.ckpt    while step 2's ``last.ckpt`` is written: after its temporary sibling is
                         whole, before the rename (any file or folder name a run writes atomically)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

import forge_lightning.run.checkpoint_io as checkpoint_io
import forge_lightning.run.fileio as fileio

KILL_POINT_ENV = "FORGE_KILL_POINT"
Moment = Literal["backward", "batch_end", "write"]
MOMENTS: tuple[Moment, ...] = ("backward", "batch_end", "write")


@dataclass(frozen=True)
class KillPointSpec:
    """Where to die: ``moment`` in optimizer step ``step`` (1-based); ``detail``: the batch of the
    step for ``backward`` (1-based), the file or folder name for ``write``."""

    moment: Moment
    step: int
    detail: str = ""

    @classmethod
    def parse(cls, text: str) -> KillPointSpec:
        """``moment@step[/detail]`` (the module docstring's forms); ValueError names what is wrong."""
        moment, _, rest = text.partition("@")
        step, _, detail = rest.partition("/")
        if moment not in MOMENTS or not step.isdigit() or int(step) < 1:
            raise ValueError(
                f"{KILL_POINT_ENV}={text!r}: expected <moment>@<step>[/<detail>] with a moment of "
                f"{', '.join(MOMENTS)} and a step >= 1 (e.g. backward@2/2, write@2/last.ckpt)"
            )
        if moment == "backward" and not (detail or "1").isdigit():
            raise ValueError(f"{KILL_POINT_ENV}={text!r}: the detail of backward is a batch number")
        if moment == "write" and not detail:
            raise ValueError(f"{KILL_POINT_ENV}={text!r}: write needs the name written (write@2/last.ckpt)")
        return cls(moment, int(step), detail)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.moment}@{self.step}" + (f"/{self.detail}" if self.detail else "")


class KillPoint(Callback):
    """SIGKILLs its own process at the moment ``$FORGE_KILL_POINT`` names (read when the callback
    is made); without it the callback does nothing. Add it with
    ``--trainer.callbacks+ forge_lightning.callbacks.KillPoint``."""

    def __init__(self) -> None:
        text = os.environ.get(KILL_POINT_ENV)
        self.spec = KillPointSpec.parse(text) if text else None
        self._step_seen = -1  # the global step the current batches started at
        self._batches = 0  # batches started at it (the batch of the step, 1-based)
        self._original: Any = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.spec is None or self.spec.moment != "write" or self._original is not None:
            return
        spec, original = self.spec, fileio.write_atomically
        self._original = original

        def write_atomically(target: str | Path, write: Any, **kwargs: Any) -> Path:
            def write_then_die(staging: Path) -> None:
                write(staging)
                if Path(target).name == spec.detail and trainer.global_step == spec.step:
                    _die()

            return original(target, write_then_die, **kwargs)

        # Patched where it is looked up: HF folders (write_folder_atomically) and Lightning's
        # checkpoints (AtomicCheckpointIO); the crash-safety under test is in the original.
        fileio.write_atomically = write_atomically
        checkpoint_io.write_atomically = write_atomically

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._original is not None:
            fileio.write_atomically = checkpoint_io.write_atomically = self._original
            self._original = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._step_seen:
            self._step_seen, self._batches = trainer.global_step, 0
        self._batches += 1

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        spec = self.spec
        if spec is not None and spec.moment == "backward" and trainer.global_step == spec.step - 1:
            if self._batches == int(spec.detail or 1):
                _die()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        spec = self.spec
        if spec is not None and spec.moment == "batch_end" and trainer.global_step >= spec.step:
            _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
