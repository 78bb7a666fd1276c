"""Signals during user code. A SIGTERM during a reward call (which may block for long) stops the
run at once, without saving: the step in progress is redone on resume from the last checkpoint
(:func:`sigterm_interrupts`). An exception a SIGINT or SIGTERM handler raised is told from the
same exception raised by the code itself (:func:`signals_marked`). What a SIGTERM does anywhere
else (finish the optimizer step, save ``last.ckpt``, exit 143) is callbacks/preemption.py's.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_CODE = 128 + signal.SIGTERM  # 143

# Set on an exception a SIGINT or SIGTERM handler raised within :func:`signals_marked`.
_FROM_SIGNAL = "_forge_from_signal"


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
