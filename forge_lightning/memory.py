"""Giving freed CPU memory back to the operating system between the phases of a step.

On CPU, PyTorch takes tensor memory from the C allocator. glibc keeps what is freed for reuse,
and serves most tensors under 32 MB from its heap rather than from their own mappings, so the
memory of a rollout (the KV cache of every row, grown token by token) stays resident after it is
freed, in holes that the training phase's differently sized tensors do not always fit.
``malloc_trim(0)`` returns every free page of the heap to the OS; calling it once per rollout
costs a few milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc); whether anything could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
