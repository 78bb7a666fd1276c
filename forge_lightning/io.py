"""Crash-safe file writing: everything lands in a temporary sibling first, then is renamed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_folder_atomically(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_folder)``, then move the folder to ``target`` in one rename.

    A crash at any moment leaves either the previous ``target`` or the new one, never a mix.
    An existing ``target`` is replaced.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            # Move the old folder aside first so the swap itself is a pair of renames.
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a single whole line (one write call, flushed and synced)."""
    line = json.dumps(record, sort_keys=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
