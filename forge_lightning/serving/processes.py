"""The ``forge-lightning serve`` processes the trainer starts itself (``local:N``, and each Ray
actor's): the config they read, the command line, starting one on a free port with the door's
secret in its environment, waiting for it to answer, and stopping it."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_lightning.serving.wire import SECRET_ENV, auth_header

# Seconds a started server may take to answer /health (it loads torch, transformers and the model).
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServeConfig:
    """What ``forge-lightning serve`` is run with: the model section of a config (the model spec and
    the module settings that decide how it loads), written where the servers can read it."""

    model: dict[str, Any]
    threads: int = 1  # each started server's torch threads (OMP_NUM_THREADS)
    # The devices the servers started here run on (serve --device), dealt round-robin: the i-th
    # takes devices[i % len(devices)]; none: each picks its own (cuda where there is one, else cpu).
    devices: tuple[str, ...] = ()

    def device(self, index: int) -> str | None:
        """The device of the ``index``-th server started here (from 0); None: its own choice."""
        return self.devices[index % len(self.devices)] if self.devices else None

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "serve.yaml"
        path.write_text(
            json.dumps({"model": self.model}, indent=2)
        )  # JSON is YAML: any config reader takes it
        return path


def free_port() -> int:
    """A TCP port of this machine no one listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(config: Path, port: int, host: str = "127.0.0.1", device: str | None = None) -> list[str]:
    """The command line of one server (the package's own entry point, in this interpreter), on
    ``device`` where one is given."""
    where = [] if device is None else ["--device", device]
    return [
        sys.executable,
        "-m",
        "forge_lightning",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--host",
        host,
        *where,
    ]


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the trainer dies (Linux's PR_SET_PDEATHSIG), so a
    killed trainer leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:  # not Linux: the placement's close() still ends it
        pass


def spawn_server(
    config: Path,
    port: int,
    secret: str,
    threads: int,
    log: Any,
    host: str = "127.0.0.1",
    device: str | None = None,
) -> subprocess.Popen:
    """``forge-lightning serve`` on ``port`` (and ``device``) as a child process, its output into ``log``."""
    env = {**os.environ, SECRET_ENV: secret, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(
        serve_command(config, port, host, device),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
    )


def wait_until_healthy(
    address: str, secret: str, process: Any, name: str, log: Path, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Wait for ``/health`` to answer; a child that exits first, or never answers, is an error
    pointing at its ``log``."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"http://{address}/health", headers=auth_header(secret))
    while time.monotonic() < deadline:
        if isinstance(process, subprocess.Popen) and process.poll() is not None:
            raise RuntimeError(
                f"rollout server {name} exited with code {process.returncode} before it answered: "
                f"its output is in {log}"
            )
        try:
            with urllib.request.urlopen(request, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.5)
    raise RuntimeError(
        f"rollout server {name} did not answer /health within {timeout_s:.0f} s: its output is in {log}"
    )


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; a process already gone is left alone."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
