"""Crash-safe file writing: everything lands in a temporary sibling first, then is renamed."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The names of what a write leaves beside its target while it runs (run_folder.py cleans up after a
# kill by them): the temporary sibling it writes, and the old folder a swap moves aside.
TEMPORARY_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-\d+-[0-9a-f]{8}$")
MOVED_ASIDE_NAME = re.compile(r"^\.(?P<name>.+)\.old-\d+$")


def temporary_sibling(target: Path) -> Path:
    """A hidden, unique sibling of ``target`` (matching :data:`TEMPORARY_NAME`)."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_atomically(
    target: str | Path, write: Callable[[Path], None], *, folder: bool = False, replace: bool = True
) -> Path:
    """Call ``write(staging)``, then move ``staging`` to ``target`` by renaming it.

    ``staging`` is a sibling of ``target`` (so the rename never crosses file systems): a path for
    ``write`` to create a file at, or with ``folder=True`` an empty folder to fill. A file is
    synced to disk before the rename. A crash at any moment leaves either the previous ``target``
    or the new one, never a mix; at worst a hidden ``.<name>.tmp-*`` sibling is left behind.

    With ``replace=False`` an existing ``target`` wins: another process that finished first
    keeps its result, and this one's is discarded.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_sibling(target)
    if folder:
        staging.mkdir()
    try:
        try:
            write(staging)
        except OSError as err:  # e.g. a full disk: say which file could not be written
            raise OSError(
                err.errno, f"could not write {target} (via {staging.name}): {err.strerror or err}"
            ) from err
        if not folder:
            with open(staging, "rb") as f:
                os.fsync(f.fileno())
        if target.exists() and not replace:
            return target
        if folder and target.exists():
            # Move the old folder aside first so the swap itself is a pair of renames.
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(staging, target)
            except OSError:
                if replace or not target.exists():
                    raise  # a folder another process renamed into place first is not an error
    finally:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        elif staging.exists():
            staging.unlink()
    return target


def write_folder_atomically(target: str | Path, write: Callable[[Path], None]) -> Path:
    """:func:`write_atomically` for a folder, replacing an existing one."""
    return write_atomically(target, write, folder=True)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a single whole line (one write call, flushed and synced)."""
    line = json.dumps(record, sort_keys=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """The ``(line, record)`` pairs of a file :func:`append_jsonl` wrote, each line with its
    newline; a line cut by a crash mid-write carries no record and is left out."""
    pairs = []
    for line in Path(path).read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            pairs.append((line, json.loads(line)))
        except json.JSONDecodeError:
            continue
    return pairs
