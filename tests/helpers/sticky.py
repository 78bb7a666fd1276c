"""Stateful environments for the sticky-episode tests (test_sandboxed_environments.py): a module
of its own with light imports, so that a sandbox worker imports it in a moment."""

from __future__ import annotations

import os
import time


def pid_namespace() -> str:
    """The pid namespace of the calling process (the trainer's differs from a worker's)."""
    return os.readlink("/proc/self/ns/pid")


class Tally:
    """An environment that counts the calls of its episode; its target comes from the row."""

    def __init__(self) -> None:
        self.calls, self.target = 0, None

    def reset(self, reference: str) -> str:
        self.target = int(reference)
        return f"Tally up to {reference}."

    def tally(self) -> dict:
        """Count this call."""
        self.calls += 1
        return {"calls": self.calls, "pid": os.getpid(), "namespace": pid_namespace()}

    def count(self) -> int:
        """Count this call; the count so far (one character, as a scripted model's test needs)."""
        self.calls += 1
        return self.calls

    def stall(self) -> str:
        """Never answer, where the target is 0."""
        if self.target == 0:
            time.sleep(600)
        return "fine"

    def get_reward(self) -> float:
        return float(self.calls) + (10.0 if self.calls == self.target else 0.0)
