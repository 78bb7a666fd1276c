"""Hostile user code for the sandbox's tests (test_sandbox.py, test_sandbox_red_team.py): rewards
and tools that hang, crash, exit, fork, allocate and reach out. A module of its own with light
imports, so that a sandbox worker imports it in a moment."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import time

# Set by a test in the trainer's process: a worker, a fresh interpreter, never sees it.
MARK = "as imported"


def mark() -> str:
    return MARK


def where() -> dict:
    """What a call sees of its process: its pid (in its own pid namespace), folder and files."""
    return {"pid": os.getpid(), "cwd": os.getcwd(), "files": sorted(os.listdir("."))}


def leave_a_file() -> str:
    with open("left.txt", "w") as f:
        f.write("from an earlier call")
    return os.getcwd()


def hangs_with_children(token: str) -> None:
    """Starts a child and a grandchild of its own session (each naming ``token``), then spins."""
    command = [sys.executable, "-c", f"import time; time.sleep(600)  # {token}"]
    subprocess.Popen(command)
    subprocess.Popen(command, start_new_session=True)
    while True:
        pass


def quits() -> None:
    raise SystemExit(3)


def interrupts() -> None:
    raise KeyboardInterrupt


def dies_hard() -> None:
    os._exit(7)


def segfaults() -> None:
    ctypes.string_at(0)


def raises(x: int) -> None:
    raise ValueError(f"no good: {x}")


def sleeps(prompts: list[str], responses: list[str]) -> list[float]:
    time.sleep(0.6)
    return [1.0] * len(responses)


async def awaits(prompts: list[str], responses: list[str]) -> list[float]:
    await asyncio.sleep(0.6)
    return [2.0] * len(responses)


def spins(prompts: list[str], responses: list[str]) -> list[float]:
    while True:
        pass


def counts(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]


def stalls(x: int) -> int:
    """A tool that never answers.

    Args:
        x: anything.
    """
    while True:
        pass


def exits(x: int) -> int:
    """A tool that ends its own process.

    Args:
        x: anything.
    """
    os._exit(1)


def doubles(x: int) -> int:
    """Twice x.

    Args:
        x: the number.
    """
    return 2 * x


class Counter:
    """An environment: its state lives across an episode's calls."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, x: int) -> int:
        """Adds x to the total.

        Args:
            x: the number.
        """
        self.total += x
        return self.total


def reads_state(prompts: list[str], responses: list[str], **kwargs) -> list[float]:
    return [float(kwargs["trainer_state"].global_step)] * len(responses)
