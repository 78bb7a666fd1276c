"""SIGTERM (a scheduler's pre-emption): finish the optimizer step, save ``last.ckpt``, exit 143.

Lightning on its own stops after the batch the signal arrives in, which under gradient
accumulation is mid-step (the step's gradients so far are lost), saves nothing unless a
``ModelCheckpoint`` happens to be due, and exits 0, so a scheduler takes the run as finished.
Here the run goes on to the optimizer step, writes ``last.ckpt`` into every ``ModelCheckpoint``
folder, and exits with 143 (128 + SIGTERM), the status a requeue script looks for. A SIGTERM during
a reward call (which may block for long) stops the run at once, without saving: the step in
progress is redone on resume from the last checkpoint.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

EXIT_CODE = 128 + signal.SIGTERM  # 143

# Set on an exception a SIGINT or SIGTERM handler raised within :func:`signals_marked`.
_FROM_SIGNAL = "_forge_from_signal"


class Preemption:
    """The module's handling of a SIGTERM; :meth:`at_batch_end` runs after every training batch."""

    def __init__(self) -> None:
        self.pending = False

    def at_batch_end(self, trainer: Any, stepped: bool) -> None:
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


def hide_sigterm(trainer: Any) -> None:
    """Clear the trainer's record of a SIGTERM, so its loops run on to the step's last batch.

    Private: ``Trainer.received_sigterm`` is a read-only property over
    ``trainer._signal_connector.received_sigterm``, and Lightning has no public way to defer the
    stop. Checked on lightning 2.4.0 and 2.6.6; ``tests/test_private_api.py`` fails if it moves."""
    trainer._signal_connector.received_sigterm = False


def _received(trainer: Any) -> bool:
    """Whether any rank has received SIGTERM (all ranks then stop at the same step)."""
    flag = bool(trainer.received_sigterm)
    if trainer.world_size > 1:
        count = trainer.strategy.reduce(
            torch.tensor(float(flag), device=trainer.strategy.root_device), reduce_op="sum"
        )
        flag = bool(count.item() > 0)
    return flag


def save_last(trainer: Any) -> list[Path]:
    """Write ``last.ckpt`` into the folder of every ModelCheckpoint (all ranks take part)."""
    paths = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            trainer.save_checkpoint(path)
            paths.append(path)
    return paths


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block a SIGTERM raises at once (after the handler already installed, e.g.
    Lightning's, has run) instead of waiting for the block to end. Main thread only (signals are
    delivered there); elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: set outside Python

    def handler(signum: int, frame: Any) -> None:
        if previous is signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
        print(
            "SIGTERM during a reward call: stopping now; the step in progress is not saved, a resume "
            "(--ckpt_path last) redoes it from the last checkpoint",
            file=sys.stderr,
        )
        raise SIGTERMException(EXIT_CODE)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_marked() -> Iterator[None]:
    """Within the block an exception raised by a SIGINT or SIGTERM handler (Python's
    KeyboardInterrupt on Ctrl-C, the stop of :func:`sigterm_interrupts`) is marked, so that
    :func:`raised_by_signal` tells it from the same exception raised by the code the block runs
    (a reward's). The handlers are otherwise unchanged; a signal with no Python handler is left
    alone. Main thread only (signals are delivered there); elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    handlers = {signum: handler for signum, handler in handlers.items() if callable(handler)}
    for signum, handler in handlers.items():
        signal.signal(signum, _marking(handler))
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def raised_by_signal(err: BaseException) -> bool:
    """Whether a signal handler raised ``err`` within :func:`signals_marked`."""
    return getattr(err, _FROM_SIGNAL, False)


def _marking(handler: Any) -> Any:
    def marked(signum: int, frame: Any) -> None:
        try:
            handler(signum, frame)
        except BaseException as err:
            setattr(err, _FROM_SIGNAL, True)
            raise

    return marked
