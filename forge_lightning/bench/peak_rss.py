"""Peak resident memory for the throughput bench: the process's high-water mark between two points
(:class:`PeakRss`), each phase's peak (:class:`PeakPhaseProfiler`), the current RSS."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import sys
from pathlib import Path

from typing_extensions import override

from forge_lightning.reporting.profiler import PhaseProfiler


def current_rss_mb() -> float:
    try:
        import psutil
    except ImportError:  # Linux without psutil: the kernel's resident page count
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    return psutil.Process().memory_info().rss / 2**20


class PeakPhaseProfiler(PhaseProfiler):
    """A :class:`PhaseProfiler` that also takes each phase's peak resident memory (MiB): the kernel's
    high-water mark (``PeakRss``), reset as a phase starts and read as it stops, the largest of
    the phase's runs since ``peaks`` was emptied (the step timer empties it after each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.peaks: dict[str, float] = {}
        self._rss = PeakRss()

    @override
    def start(self, action_name: str) -> None:
        super().start(action_name)
        if action_name in self.phases:
            self._rss.reset()

    @override
    def stop(self, action_name: str) -> None:
        super().stop(action_name)
        if action_name in self.phases:
            self.peaks[action_name] = max(self.peaks.get(action_name, 0.0), self._rss.peak())


class PeakRss:
    """Peak resident memory between ``reset()`` and ``peak()``, in MiB.

    Linux keeps a high-water mark that writing 5 to ``/proc/self/clear_refs`` resets: it costs
    nothing while the step runs (a thread polling the RSS every 5 ms slowed generation by 10-20%
    on 2 cores). Where it cannot be reset, the mark covers the whole process so far, references
    included.
    """

    def reset(self) -> None:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")

    def peak(self) -> float:
        with contextlib.suppress(OSError, AttributeError):
            status = Path("/proc/self/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**10
        # ru_maxrss is in KiB on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
