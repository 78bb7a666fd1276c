"""The process's peak memory over a block of work, and the memory a run may take: what the
preflight (training/preflight.py) measures its worst case with.

On a CPU the peak is the resident set's high-water mark, ``VmHWM`` of /proc/self/status, reset to
the resident set now by writing ``5`` to /proc/self/clear_refs (Linux); where that cannot be
written, the peak since the process started (``VmHWM`` unreset, or ``resource.getrusage``'s
``ru_maxrss`` without /proc), which may over-report a phase but never under-reports it. On a GPU it is
``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

GB = 1024**3
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


@dataclass(frozen=True)
class Phase:
    """One phase's memory: where it started and its peak, in bytes."""

    start: int
    peak: int


def memory_limit(limit_gb: float | None, device: torch.device) -> int:
    """The limit in bytes: ``limit_gb``, else the GPU's memory, or the machine's (its cgroup's
    limit where lower)."""
    if limit_gb is not None:
        return int(limit_gb * GB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = _CGROUP_LIMIT.read_text().strip() if _CGROUP_LIMIT.is_file() else ""
    return min(total, int(cgroup)) if cgroup.isdigit() else total


class PeakMemory:
    """The process's memory now and its peak since the last :meth:`reset`: the resident set on a
    CPU, the allocator's bytes on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.name = "GPU allocated" if device.type == "cuda" else "CPU RSS"

    def reset(self) -> int:
        """Start a new peak; returns the memory now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        try:
            _CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
        except OSError:
            pass  # the peak is then the process's since it started: it over-reports, never under
        return _status_bytes("VmRSS") or _max_rss()

    def peak(self) -> int:
        """The peak since :meth:`reset`, in bytes."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _status_bytes("VmHWM") or _max_rss()

    @contextmanager
    def phase(self) -> Iterator[list[Phase]]:
        """Measure the block: the list it yields holds its :class:`Phase` afterwards."""
        measured: list[Phase] = []
        start = self.reset()
        yield measured
        measured.append(Phase(start, max(self.peak(), start)))


def _max_rss() -> int:
    """The process's peak resident set since it started (kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes; 0 where it cannot be read."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def size_text(value: float) -> str:
    """Bytes in GiB, or MiB under a tenth of one."""
    return f"{value / GB:.2f} GiB" if value >= GB / 10 else f"{value / 2**20:.1f} MiB"
