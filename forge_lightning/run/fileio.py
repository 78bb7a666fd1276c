"""Crash-safe file writing: everything lands in a temporary sibling first, then is renamed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The names of what a write leaves beside its target while it runs (run/folder.py cleans up after a
# kill by them): the temporary sibling it writes, and the old folder a swap moves aside.
TEMPORARY_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-\d+-[0-9a-f]{8}$")
MOVED_ASIDE_NAME = re.compile(r"^\.(?P<name>.+)\.old-\d+$")

# torch's stream errors on a full disk ("basic_ios::clear: iostream error", "unexpected pos")
# carry no errno: with less free space than this (or than the file being replaced) left after
# one, the disk is taken to be full.
SPACE_MARGIN = 1 << 20


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
            if not folder:
                with open(staging, "rb") as f:
                    os.fsync(f.fileno())
        except Exception as err:  # e.g. a full disk: say which file could not be written, and why
            named = _write_error(target, staging, err)
            if named is None:
                raise
            raise named from err
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


def _write_error(target: Path, staging: Path, err: Exception) -> Exception | None:
    """The error to raise for ``err``, naming ``target`` and, where it is the cause, the lack of
    space (measured before the staging copy is removed): an OSError, or a RuntimeError for torch's
    other stream errors; None for any other error, raised as it is (a pickling error, say)."""
    if not isinstance(err, (OSError, RuntimeError)):
        return None
    free = free_bytes(target.parent)
    if isinstance(err, OSError):
        named = f"could not write {target} (via {staging.name}): {err.strerror or err}"
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            return OSError(err.errno, named)
    elif free < max(SPACE_MARGIN, size_on_disk(target)):
        named = f"could not write {target}: No space left on device (the writer said: {err})"
    else:
        return RuntimeError(f"could not write {target}: {err}")
    return OSError(
        getattr(err, "errno", None) or errno.ENOSPC,
        f"{named}; {mib(free)} free in {target.parent}. Nothing saved before was changed: free some "
        "space, keep fewer checkpoints, or save elsewhere",
    )


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (of its nearest existing folder)."""
    existing = next(p for p in (path, *path.parents) if p.exists())  # "/" or "." at the latest
    return shutil.disk_usage(existing).free


def size_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file under a folder; 0 when there is none."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.is_file() else 0


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


class SpaceCheck:
    """Warns once, before a save, when the free space left where it goes is below what the
    previous save of its kind took (this process's previous save, else the file it replaces).

    Args:
        kind: what is saved, for the warning ("Lightning checkpoint").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.previous = 0
        self.warned = False

    def before(self, target: Path) -> None:
        previous = self.previous or size_on_disk(target)
        if self.warned or not previous:
            return
        free = free_bytes(target.parent)
        if free < previous:
            self.warned = True
            warnings.warn(
                f"only {mib(free)} free in {target.parent}, less than the previous {self.kind} took "
                f"({mib(previous)}): the next save may fail for lack of space. Free some space, or keep "
                "fewer checkpoints (HFCheckpoint's save_total_limit, ModelCheckpoint's save_top_k)",
                stacklevel=3,
            )

    def after(self, target: Path) -> None:
        self.previous = size_on_disk(target)


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


def folder_fingerprint(folder: Path) -> str:
    """SHA-256 over the names and bytes of a model folder's weight files."""
    digest = hashlib.sha256()
    for path in weight_files(folder):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
