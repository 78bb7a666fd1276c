"""Fault injection for the resume tests, imported by the CLI in a subprocess."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


def kill_on_call(prompts: list[str], responses: list[str]) -> list[float]:
    """Distinct characters per response; SIGKILLs its own process on call ``$FORGE_KILL_AT``.

    The call count lives in ``$FORGE_CALLS`` (a file), so it survives across calls in one process.
    """
    counter = Path(os.environ["FORGE_CALLS"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == int(os.environ.get("FORGE_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [len(set(r)) / 8 for r in responses]


def solved_below_13(prompts: list[str], responses: list[str], references: list[str]) -> list[float]:
    """:func:`kill_on_call`'s scores (and its call count and SIGKILL), but 1 for every completion
    of a problem whose answer is below 13: prompts the policy always solves, for a curriculum."""
    scores = kill_on_call(prompts, responses)
    return [1.0 if float(reference) < 13 else s for s, reference in zip(scores, references)]


def flat_on_odd_calls(prompts: list[str], responses: list[str]) -> list[float]:
    """Equal scores on odd calls (every group uninformative), 0/1 alternating on even ones;
    SIGKILLs its own process on call ``$FORGE_KILL_AT``. With dynamic sampling and one group per
    prompt to gather, every optimizer step then takes two sampling rounds."""
    counter = Path(os.environ["FORGE_CALLS"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == int(os.environ.get("FORGE_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.5] * len(responses) if calls % 2 else [float(i % 2) for i in range(len(responses))]


def term_on_call(prompts: list[str], responses: list[str]) -> list[float]:
    """Like :func:`kill_on_call`, but on call ``$FORGE_TERM_AT`` it sends its own process SIGTERM
    and then sleeps ``$FORGE_SLEEP`` seconds (a reward that blocks)."""
    counter = Path(os.environ["FORGE_CALLS"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == int(os.environ.get("FORGE_TERM_AT", "0")):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(float(os.environ.get("FORGE_SLEEP", "0")))
    return [len(set(r)) / 8 for r in responses]


class TermAtBatch(Callback):
    """Sends its own process SIGTERM as training batch ``batch`` (0-based, counted over the fit) starts."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.seen = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1


def distinct_characters(prompts: list[str], responses: list[str]) -> list[float]:
    """Distinct characters per response, over 8: a reward that varies among a tiny model's samples."""
    return [len(set(r)) / 8 for r in responses]


class SkipRngRestore(Callback):
    """A broken resume: once made, the module's resume leaves the RNG states as the new process
    has them instead of restoring the checkpoint's (training/run_state.py's ``set_rng_states``)."""

    def __init__(self) -> None:
        import forge_lightning.training.run_state as run_state

        run_state.set_rng_states = lambda states: None
