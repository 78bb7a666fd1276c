"""A run owns its folder: one process at a time, no fresh run over an old one, leftovers of a
killed run cleaned, and ``--ckpt_path last`` resolved to this run's newest complete checkpoint.

The CLI uses :class:`RunFolder` before ``fit``; a Python user can do the same::

    folder = RunFolder("runs/a", checkpoint_dirs=["runs/a/checkpoints"])
    folder.lock()                       # a second process here fails, naming this one's PID
    ckpt = folder.prepare(resume=True)  # None: nothing to resume, a fresh run starts
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from forge_lightning.run.fileio import MOVED_ASIDE_NAME, TEMPORARY_NAME

log = logging.getLogger(__name__)

LOCK_NAME = ".forge.lock"
LOG_NAME = "training_log.jsonl"
_STEP = re.compile(r"step=(\d+)")
# What a fit killed before its first checkpoint leaves, which --ckpt_path last may start over on.
_RESTARTABLE = (LOG_NAME, "reference")


class RunFolderError(RuntimeError):
    """The folder cannot be used as asked (held by another process, or holds another run)."""


class RunFolder:
    """The run folder ``root`` and the folders its Lightning checkpoints go to.

    Args:
        root: the run folder (``trainer.default_root_dir``): reference/, the HF step folders,
            final/ and ``training_log.jsonl``.
        checkpoint_dirs: every ``ModelCheckpoint.dirpath`` of the run (usually ``root/checkpoints``).
    """

    def __init__(self, root: str | Path, checkpoint_dirs: Iterable[str | Path] = ()) -> None:
        self.root = Path(root)
        self.checkpoint_dirs = [Path(d) for d in checkpoint_dirs]
        self._lock_files: list[int] = []

    # -- one process at a time ----------------------------------------------------------------

    def lock(self) -> None:
        """Hold an OS lock on the run folder (and on each checkpoint folder outside it) until the
        process exits; a killed process releases it. Raises RunFolderError naming the holder."""
        folders = [self.root] + [d for d in self.checkpoint_dirs if not _inside(d, self.root)]
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / LOCK_NAME
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                self.unlock()
                raise RunFolderError(
                    f"{folder} is in use by another run (PID {holder}); wait for it to end, or give "
                    "this run its own folder (--trainer.default_root_dir)"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._lock_files.append(fd)

    def unlock(self) -> None:
        for fd in self._lock_files:
            os.close(fd)  # closing the descriptor releases the flock
        self._lock_files = []

    # -- what is there ------------------------------------------------------------------------

    def contents(self) -> list[Path]:
        """What an earlier fit left here: its log, reference, HF folders and Lightning checkpoints
        (TensorBoard logs alone do not count: a ``validate`` writes them too)."""
        found = [self.root / name for name in (LOG_NAME, "reference", "final")]
        found = [p for p in found if p.exists()]
        if self.root.is_dir():  # HF step folders (a folder named 2024 of the user's is left alone)
            found += sorted(
                p for p in self.root.iterdir() if p.name.isdigit() and (p / "config.json").is_file()
            )
        for folder in self.checkpoint_dirs:
            found += checkpoints(folder)
        return found

    def newest_checkpoint(self) -> Path | None:
        """``last.ckpt`` of this run, else its newest complete checkpoint (each is written whole, so
        any ``.ckpt`` not under a temporary name is complete), else None."""
        for folder in self.checkpoint_dirs:
            if (folder / "last.ckpt").is_file():
                return folder / "last.ckpt"
        candidates = [p for folder in self.checkpoint_dirs for p in checkpoints(folder)]
        if not candidates:
            return None
        return max(candidates, key=lambda p: (_step_of(p), p.stat().st_mtime))

    # -- getting it ready -----------------------------------------------------------------------

    def clean_leftovers(self) -> list[str]:
        """Undo what a kill mid-write left: a folder swap cut between its two renames gets its
        folder back (``.final.old-PID`` -> ``final``), and temporary files and folders are removed.
        Call only while holding the lock (no other process is writing here). Returns what was done."""
        done: list[str] = []
        for folder in [self.root, *self.checkpoint_dirs]:
            if not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                if match := MOVED_ASIDE_NAME.match(path.name):
                    target = folder / match["name"]
                    if target.exists():
                        _remove(path)
                        done.append(f"removed {path}")
                    else:
                        os.replace(path, target)
                        done.append(f"restored {target} from {path.name}")
                elif TEMPORARY_NAME.match(path.name):
                    _remove(path)
                    done.append(f"removed {path}")
        for line in done:
            log.info("run folder: %s", line)
        return done

    def prepare(self, resume: bool, overwrite: bool = False) -> Path | None:
        """Check the folder for a fit and return the checkpoint to resume from (None: a fresh run).

        ``resume`` (``--ckpt_path last``): this run's newest complete checkpoint; with none, a
        fresh run starts and the old log is moved aside, unless the folder holds a run's outputs
        (``_nothing_to_resume``). A fresh run (``resume=False``) in a folder that holds a run is
        refused, unless ``overwrite`` removes that run's outputs first.
        """
        self.clean_leftovers()
        if resume:
            found = self.newest_checkpoint()
            if found is None:
                self._nothing_to_resume(overwrite)
            elif found.name != "last.ckpt":
                log.warning("no last.ckpt: resuming from this run's newest checkpoint, %s", found)
            return found
        existing = self.contents()
        if existing == [self.root / "reference"]:
            # All a fit that failed before its first optimizer step leaves (no log, no checkpoint
            # needs it): no run to protect, and this run writes its own reference.
            _remove(existing[0])
            log.warning("removed %s, left by a fit that took no optimizer step", existing[0])
            return None
        if existing and not overwrite:
            shown = ", ".join(str(p) for p in existing[:4]) + (" ..." if len(existing) > 4 else "")
            raise RunFolderError(
                f"{self.root} already holds a run ({shown}). Continue it with --ckpt_path last, "
                "start this one in a new folder (--trainer.default_root_dir), or replace it with "
                "--overwrite true"
            )
        if existing:
            self._remove_run(existing)
        return None

    def _remove_run(self, outputs: list[Path]) -> None:
        """--overwrite: a run's ``outputs`` go, its curves and validation answers too."""
        for path in [*outputs, self.root / "tensorboard", self.root / "validation"]:
            _remove(path)
        log.warning("--overwrite: removed the previous run's outputs in %s", self.root)

    def _nothing_to_resume(self, overwrite: bool) -> None:
        """``--ckpt_path last`` found no checkpoint in this run's checkpoint folders: a new run
        starts, but never over another run's outputs (``final/``, HF step folders, Lightning
        checkpoints, also in ``<root>/checkpoints`` when the ModelCheckpoint now saves elsewhere),
        which are refused as a fresh fit over them is, unless ``overwrite``. A run killed before
        its first checkpoint leaves only its log (moved aside) and ``reference/`` (written again)."""
        default = self.root / "checkpoints"  # where the CLI puts them when the config says nowhere
        ours = any(d.resolve() == default.resolve() for d in self.checkpoint_dirs)
        strays = [] if ours else checkpoints(default)
        outputs = [
            p for p in [*self.contents(), *strays] if p.parent != self.root or p.name not in _RESTARTABLE
        ]
        if outputs and overwrite:
            return self._remove_run([*outputs, self.root / LOG_NAME])
        if outputs:
            searched = ", ".join(str(d) for d in self.checkpoint_dirs)
            shown = ", ".join(str(p) for p in outputs[:4]) + (" ..." if len(outputs) > 4 else "")
            fixes = [f"continue it: point the ModelCheckpoint's dirpath at {default} (--checkpoint.dirpath)"]
            fixes = fixes if strays else []
            fixes += ["start this run in a new folder (--trainer.default_root_dir)"]
            raise RunFolderError(
                f"--ckpt_path last: there is no checkpoint to resume from in {searched}, but {self.root} "
                f"holds a run ({shown}) that a new run would replace. {'; '.join(fixes)}; or replace "
                "that run with --overwrite true"
            )
        self._start_over("there is no checkpoint to resume from")

    def _start_over(self, why: str) -> None:
        log_file = self.root / LOG_NAME
        if log_file.exists():
            aside = log_file.with_name(f"training_log.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            os.replace(log_file, aside)
            log.warning(
                "--ckpt_path last: %s in %s; starting a new run (old log kept as %s)", why, self.root, aside
            )
        else:
            log.warning("--ckpt_path last: %s in %s; starting a new run", why, self.root)


def checkpoints(folder: Path) -> list[Path]:
    """The complete Lightning checkpoints in ``folder`` (temporary files excluded)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("*.ckpt") if p.is_file() and not p.name.startswith("."))


def _step_of(path: Path) -> int:
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else -1


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_untracked_checkpoints(
    resumed: str | Path, saved: Mapping[str, Any], callbacks: Iterable[object]
) -> list[Path]:
    """Remove the step checkpoints of each ``ModelCheckpoint`` in ``callbacks`` that the state it
    resumes from ``resumed`` (loaded: ``saved``) no longer tracks: left by a kill between a step's
    checkpoint and its ``last.ckpt`` (the redone step then writes ``-v1`` beside it, and the old one
    stays for ever).
    Only files named by that callback's own pattern (``epoch=0-step=4.ckpt``, ``-vN`` versions) go,
    never ``resumed`` or a user's file; kept are its tracked ones (best, top-k, last) and, when it
    keeps every checkpoint, all up to the resumed step. Call on rank 0 while holding the lock."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    step, states = int(saved.get("global_step", -1)), saved.get("callbacks", {})
    removed: list[Path] = []
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.dirpath:
            continue
        folder, state = Path(callback.dirpath), states.get(callback.state_key)
        if state is None or Path(state.get("dirpath") or folder).resolve() != folder.resolve():
            continue  # not the state this callback resumes (it starts afresh): nothing to judge by
        tracked = {state.get(k) for k in ("best_model_path", "kth_best_model_path", "last_model_path")}
        tracked = {Path(p).name for p in [*tracked, *state.get("best_k_models", {})] if p}
        keeps_all = callback.monitor is None and callback.save_top_k == -1
        pattern = _checkpoint_name(callback)
        for path in checkpoints(folder):
            if path.name in tracked or path.resolve() == Path(resumed).resolve():
                continue
            if pattern.match(path.name) and not (keeps_all and 0 <= _step_of(path) <= step):
                path.unlink()
                removed.append(path)
                log.info("run folder: removed %s (a checkpoint the resumed state does not track)", path)
    return removed


def _checkpoint_name(callback: object) -> re.Pattern[str]:
    """The names ``callback`` (a ModelCheckpoint) gives its step checkpoints, as a pattern: its
    ``filename`` template with every ``{metric}`` a value, an optional version, the extension."""
    template = callback.filename or "{epoch}-{step}"
    parts = []
    for i, piece in enumerate(re.split(r"(\{[^}]*\})", template)):
        if i % 2 == 0:
            parts.append(re.escape(piece))
        else:
            name = piece[1:-1].split(":")[0]
            parts.append((re.escape(name) + "=" if callback.auto_insert_metric_name else "") + r"[^/]+?")
    version = re.escape(callback.CHECKPOINT_JOIN_CHAR) + r"v\d+"
    last = re.escape(callback.CHECKPOINT_NAME_LAST)
    extension = re.escape(callback.FILE_EXTENSION)
    return re.compile(rf"^(?!{last}(?:{version})?\.)" + "".join(parts) + rf"(?:{version})?{extension}$")
