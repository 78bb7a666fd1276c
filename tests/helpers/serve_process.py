"""A ``forge-lightning serve`` child process in a test: started on a free port, its URL read from
the one line it prints, stopped with SIGTERM."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

from forge_lightning.serving.wire import SECRET_ENV


def start_serve(
    config: Path, secret: str, log: Path, *extra: str, timeout_s: float = 120
) -> tuple[subprocess.Popen, str]:
    """``python -m forge_lightning serve --config config --port 0 *extra`` behind ``secret``, its
    stderr into ``log`` (a pipe nobody reads could fill and stall it); the process and its URL.
    AssertionError with its log when it ends or says nothing in time."""
    command = [sys.executable, "-m", "forge_lightning", "serve", "--config", str(config), "--port", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", SECRET_ENV: secret}
    with open(log, "w", encoding="utf-8") as stderr:  # the child holds its own copy
        process = subprocess.Popen(
            [*command, *extra], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    line = _first_line(process, log, timeout_s)
    return process, line.split("listening on ")[-1].strip()


def stop_serve(process: subprocess.Popen) -> int:
    """SIGTERM, then its exit code (0: it stopped cleanly)."""
    process.terminate()
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=30)


def _first_line(process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline() if selector.select(timeout=0.5) else None
        if line:
            return line
        if line == "" or process.poll() is not None:  # its output closed: it has ended
            process.wait(timeout=30)
            raise AssertionError(f"the server exited {process.returncode}: {log.read_text()[-3000:]}")
    process.kill()
    raise AssertionError(f"the server printed nothing in {timeout_s} s")
