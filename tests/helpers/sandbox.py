"""What the sandbox's tests ask of the machine: a skip where it cannot isolate workers, and the
processes left behind."""

from __future__ import annotations

import os

import pytest


def skip_unless_sandbox_isolates() -> None:
    """Skip the test, with the probe's reason, where the machine cannot isolate sandboxed workers
    (sandbox/isolation.py's probe: unshare, Landlock, a pids bound), as the GPU tests are without a GPU."""
    from forge_lightning.sandbox import isolation
    from forge_lightning.sandbox.pool import SandboxUnavailable

    try:
        isolation.probe()
    except SandboxUnavailable as err:
        pytest.skip(f"this machine cannot isolate sandboxed workers: {err}")


def processes_naming(token: str) -> list[int]:
    """The pids of this machine's processes whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
    return found
