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


# -- attacks on the trainer through what crosses back, and on the machine through the sandbox ----


class Bomb:
    """A value whose unpickling runs ``touch <marker>``: where it is unpickled, code runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class BombError(Exception):
    """An exception whose unpickling runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def returns_a_bomb(prompts: list[str], responses: list[str], marker: list[str]) -> list:
    return [Bomb(m) for m in marker]


def raises_a_bomb(prompts: list[str], responses: list[str], marker: list[str]) -> list[float]:
    raise BombError(marker[0])


def forges_answers(value: int) -> int:
    """Writes a forged answer, as a pickle and as JSON, on every descriptor it holds but the
    standard ones, then answers ``value``."""
    import json
    import pickle
    import struct

    forged = [
        pickle.dumps(("ok", 99)),
        json.dumps(["0" * 32, "ok", 99]).encode(),
        json.dumps(["ok", 99]).encode(),
    ]
    for fd in range(3, 1024):
        for frame in forged:
            try:
                os.write(fd, struct.pack("!i", len(frame)) + frame)
            except OSError:
                pass
    return value


def connects_unix(prompts: list[str], responses: list[str], path: list[str]) -> list[float]:
    """1.0 where it reached the Unix socket at ``path``."""
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path[0])
            sock.sendall(b"hello from the sandbox")
        return [1.0] * len(responses)
    except PermissionError:
        return [0.0] * len(responses)


def reads_file(prompts: list[str], responses: list[str], path: list[str]) -> list[float]:
    """1.0 where it read the file at ``path``."""
    try:
        with open(path[0]) as f:
            f.read()
        return [1.0] * len(responses)
    except PermissionError:
        return [0.0] * len(responses)


def reads_secret_file(prompts: list[str], responses: list[str], secret_path: list[str]) -> list[float]:
    """1.0 where it read the file at ``secret_path``."""
    return reads_file(prompts, responses, secret_path)


SECRET_NAME = "FORGE_RED_TEAM_SECRET"


def reads_secret(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the trainer's secret variable is in its environment."""
    return [float(SECRET_NAME in os.environ)] * len(responses)


def who() -> dict:
    """The ids a call runs as, and what its own environment holds of the secret."""
    return {"uid": os.getuid(), "gid": os.getgid(), "secret": os.environ.get(SECRET_NAME)}


def tries(what: str) -> str:
    """What a socket call gives: ``made`` or the error's type; ``socketpair`` still works."""
    import asyncio
    import socket

    calls = {
        "socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
        "unix": lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM),
        "socketpair": socket.socketpair,
        "asyncio": lambda: asyncio.run(asyncio.sleep(0)),
        "bind": lambda: pair[0].bind("\0forge-sandbox-test"),
        "sendmsg": lambda: pair[0].sendmsg([b"x"]),
        "send": lambda: pair[0].send(b"x"),
    }
    pair = socket.socketpair()
    try:
        calls[what]()
        return "made"
    except Exception as err:
        return type(err).__name__


def gives_a_bomb(marker: str) -> Bomb:
    """A tool whose value would run ``touch marker`` where it is unpickled.

    Args:
        marker: the file.
    """
    return Bomb(marker)


def gives_a_lot(n: int) -> str:
    """A tool whose text is ``n`` characters long.

    Args:
        n: how many.
    """
    return "x" * n
