"""What a sandbox worker may see of the trainer's machine (sandbox/pool.py): the files it may read,
the folders it may only list, and the environment variables that cross into it.

It reads Python's installation (sandbox/isolation.py's :func:`python_installation`), the system's
folders and the user's own modules, no more: each module the prepared rewards, tools and
environments are pickled by reference to (its top-level package's folder, or its file), and the
trainer's other modules imported from the same import root (a module beside it). The import root
itself may only be listed (Python's import finds the module by its folder's names), so a run
folder below it, or any data file beside a module, cannot be read: keep a module's data in its
package's folder. Of the trainer's environment only the variables the run names cross.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from forge_lightning.sandbox.isolation import python_installation


@dataclass(frozen=True)
class WorkerView:
    """What a worker may see of the trainer: the paths it may read, the folders it may only
    list (an import root's names), and the names of the environment variables that cross (their
    values are read when a worker starts, and kept nowhere else)."""

    read: tuple[str, ...] = ()
    list_only: tuple[str, ...] = ()
    env: tuple[str, ...] = ()

    def environment(self) -> dict[str, str]:
        """The trainer's values of :attr:`env` now (a name that is not set does not cross)."""
        return {name: os.environ[name] for name in self.env if name in os.environ}


def worker_view(functions: Iterable[Any], env_names: Iterable[str] = ()) -> WorkerView:
    """The view of workers that run ``functions``: Python's installation, the modules they are
    pickled by reference to and those modules' neighbours (read), their import roots (list), and
    and ``env_names``."""
    installed = python_installation()
    roots, read = set(), set(installed)
    for name in sorted(modules_named(functions)):
        root, path = import_root(name)
        if root is None or _below(path, installed):
            continue
        roots.add(root)
        read.add(path)
    for module in list(sys.modules.values()):  # what the user's modules imported from beside them
        path = getattr(module, "__file__", None)
        root = next((r for r in roots if path and os.path.realpath(path).startswith(r + os.sep)), None)
        if root is not None:
            read.add(_top(os.path.realpath(path), root))
    return WorkerView(tuple(sorted(read)), tuple(sorted(roots - read)), tuple(env_names))


def modules_named(functions: Iterable[Any]) -> set[str]:
    """The modules the pickles of ``functions`` name (each function, class or instance's class,
    and what it holds), so the modules a worker imports to unpickle them."""
    names: set[str] = set()
    for fn in functions:  # protocol 2 names each global as "module name", in one opcode
        for opcode, arg, _ in pickletools.genops(pickle.dumps(fn, protocol=2)):
            if opcode.name in ("GLOBAL", "INST"):
                names.add(str(arg).split(" ")[0])
    return {name for name in names if name in sys.modules}


def import_root(name: str) -> tuple[str | None, str]:
    """The folder on ``sys.path`` that module ``name`` was imported from, and what of it the module
    is (its top-level package's folder, or its file); (None, "") where it has no file."""
    top = sys.modules.get(name.split(".")[0])
    locations = list(getattr(top, "__path__", None) or [])
    file = getattr(top, "__file__", None)
    path = os.path.realpath(locations[0] if locations else file) if (locations or file) else ""
    if not path:
        return None, ""
    return os.path.dirname(path), path


def _top(path: str, root: str) -> str:
    """What below ``root`` holds ``path``: its first folder there, or the file itself."""
    first = os.path.relpath(path, root).split(os.sep)[0]
    return os.path.join(root, first)


def _below(path: str, folders: Iterable[str]) -> bool:
    return any(path == folder or path.startswith(folder + os.sep) for folder in folders)
