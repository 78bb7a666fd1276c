"""SIGTERM (a scheduler's pre-emption): finish the optimizer step, save ``last.ckpt``, exit 143.

Lightning on its own stops after the batch the signal arrives in, which under gradient
accumulation is mid-step (the step's gradients so far are lost), saves nothing unless a
``ModelCheckpoint`` happens to be due, and exits 0, so a scheduler takes the run as finished.
Here the run goes on to the optimizer step, writes ``last.ckpt`` into every ``ModelCheckpoint``
folder, and exits with 143 (128 + SIGTERM), the status a requeue script looks for. (A SIGTERM
during a reward call stops the run at once: run/signals.py.)
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from forge_lightning.run.signals import EXIT_CODE


class Preemption:
    """The module's handling of a SIGTERM; :meth:`at_batch_end` runs after every training batch."""

    def __init__(self) -> None:
        self.pending = False

    def at_batch_end(self, trainer: pl.Trainer, stepped: bool) -> None:
        if not (self.pending or _received(trainer)):
            return
        if not stepped:
            # Hide the signal from Lightning's loops (which would stop after this batch) until the
            # step's last batch; the module remembers it.
            self.pending = True
            hide_sigterm(trainer)
            return
        saved = save_last(trainer)
        where = ", ".join(map(str, saved)) if saved else "nothing (the trainer has no ModelCheckpoint)"
        rank_zero_warn(
            f"SIGTERM: stopped after optimizer step {trainer.global_step}; saved {where}. Run the "
            f"same command with --ckpt_path last to continue (exit status {EXIT_CODE})"
        )
        raise SIGTERMException(EXIT_CODE)


def hide_sigterm(trainer: pl.Trainer) -> None:
    """Clear the trainer's record of a SIGTERM, so its loops run on to the step's last batch.

    Private: ``Trainer.received_sigterm`` is a read-only property over
    ``trainer._signal_connector.received_sigterm``, and Lightning has no public way to defer the
    stop. Checked on lightning 2.4.0 and 2.6.6; ``tests/test_private_api.py`` fails if it moves."""
    trainer._signal_connector.received_sigterm = False


def _received(trainer: pl.Trainer) -> bool:
    """Whether any rank has received SIGTERM (all ranks then stop at the same step)."""
    flag = bool(trainer.received_sigterm)
    if trainer.world_size > 1:
        count = trainer.strategy.reduce(
            torch.tensor(float(flag), device=trainer.strategy.root_device), reduce_op="sum"
        )
        flag = bool(count.item() > 0)
    return flag


def save_last(trainer: pl.Trainer) -> list[Path]:
    """Write ``last.ckpt`` into the folder of every ModelCheckpoint (all ranks take part)."""
    paths = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            trainer.save_checkpoint(path)
            paths.append(path)
    return paths
