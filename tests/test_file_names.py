"""A file's name says where you are: no two modules of the package share a file name (a package's
``__init__.py`` and ``__main__.py`` aside), so that ``sampler.py`` in a traceback or a review is one
file. A renamed module keeps its old import path in _moved.py; that each old path imports as its
new module is test_imports.py's check, and here that no old path is still a file of its own (the
file would be imported instead, and the entry never read)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from helpers.import_graph import ROOT, write_tree

from forge_lightning._moved import MOVED

SHARED_BY_EVERY_PACKAGE = {"__init__.py", "__main__.py"}


def repeated_file_names(root: Path) -> dict[str, list[str]]:
    """Each file name that more than one module below ``root`` has -> those modules' paths."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in SHARED_BY_EVERY_PACKAGE:
            where[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_two_files_of_the_package_share_a_name():
    repeated = repeated_file_names(ROOT)
    assert not repeated, "file names used twice (rename one, its old path kept in _moved.py):\n" + "\n".join(
        f"{name}: {', '.join(paths)}" for name, paths in sorted(repeated.items())
    )


def test_the_check_finds_a_name_used_in_two_folders(tmp_path):
    root = write_tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "rollout/__init__.py": "",
            "rollout/sampler.py": "",
            "data/__init__.py": "",
            "data/sampler.py": "",
            "data/loader.py": "",
        },
    )
    assert repeated_file_names(root) == {"sampler.py": ["data/sampler.py", "rollout/sampler.py"]}


def test_no_old_import_path_is_still_a_module_of_its_own():
    shadowed = [
        old
        for old in MOVED
        if (ROOT / (old.replace(".", "/") + ".py")).is_file()
        or (ROOT / old.replace(".", "/") / "__init__.py").is_file()
    ]
    assert shadowed == [], (
        f"old paths in _moved.py that are files again (the entry is never read): {shadowed}"
    )
