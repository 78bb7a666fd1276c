"""notebooks/guide.ipynb, the reference README links to: it runs top to bottom and is saved executed;
every import path, repository file, link and flag it names exists. README's own promises are
checked here too: its settings table gives the code's defaults, it lists every section of the
guide, and its relative links lead to files."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from forge_lightning.callbacks import HFCheckpoint, RewardLogger
from forge_lightning.data import PromptDataModule
from forge_lightning.module import GRPOLightningModule

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "notebooks" / "guide.ipynb"
README = ROOT / "README.md"

# The class each flag group sets (`--model.kl_beta` is GRPOLightningModule's `kl_beta`).
GROUPS = {
    "model": GRPOLightningModule,
    "data": PromptDataModule,
    "trainer": pl.Trainer,
    "checkpoint": ModelCheckpoint,
    "hf_checkpoint": HFCheckpoint,
    "reward_logger": RewardLogger,
}
# jsonargparse's own keys under a group (`--data.help`), not settings.
PARSER_KEYS = {"help", "class_path", "init_args"}
FLAG = re.compile(r"--(" + "|".join(GROUPS) + r")\.(\w+)")
IMPORT_PATH = re.compile(r"\bforge_lightning(?:\.[A-Za-z_]\w*)+")
REPO_PATH = re.compile(r"(?<![\w/.])(?:forge_lightning|configs|tests|notebooks)/[\w/.-]*\w")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def cells() -> list[dict]:
    return json.loads(GUIDE.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def guide_text() -> str:
    """What the guide says: every cell's source, markdown and code (not the outputs, which the code
    computes)."""
    return "\n".join(source(cell) for cell in cells())


def settings(group: str) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(GROUPS[group].__init__).parameters)


def resolves(path: str) -> bool:
    """``importlib.import_module`` on the longest part of ``path`` that is a module, ``getattr``
    for the rest."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not module.startswith(err.name):
                raise  # the module exists but imports something missing
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def imported_paths(code: str) -> set[str]:
    """``forge_lightning...`` names a piece of Python imports (``from forge_lightning.x import y``
    names ``forge_lightning.x.y``)."""
    paths = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "forge_lightning":
            paths.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            paths.update(a.name for a in node.names if a.name.split(".")[0] == "forge_lightning")
    return paths


def test_guide_is_saved_executed():
    code = [cell for cell in cells() if cell["cell_type"] == "code"]
    assert code and all(cell["execution_count"] is not None and cell["outputs"] for cell in code)


@pytest.mark.integration  # starts a kernel process
def test_guide_runs_top_to_bottom_and_tables_every_setting():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(GUIDE, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(GUIDE.parent)}}
    ).execute()
    shown = {cell.get("id"): cell for cell in notebook.cells}
    for cell_id, group in (("settings-table", "model"), ("data-settings-table", "data")):
        [output] = shown[cell_id].outputs
        table = output["data"]["text/markdown"]
        listed = re.findall(rf"^\| `--{group}\.(\w+)` \|", table, re.MULTILINE)
        assert listed == [name for name in settings(group) if name != "self"], cell_id


def test_every_import_path_the_guide_names_resolves():
    text = guide_text()
    paths = set(IMPORT_PATH.findall(text))
    for cell in cells():
        blocks = [source(cell)] if cell["cell_type"] == "code" else PYTHON_BLOCK.findall(source(cell))
        for block in blocks:
            paths |= imported_paths(block)
    assert len(paths) > 10, sorted(paths)  # the patterns still find what the guide names
    missing = sorted(path for path in paths if not resolves(path))
    assert not missing, f"import paths the guide names that do not resolve: {missing}"


def test_every_flag_the_guide_names_is_a_setting():
    flags = set(FLAG.findall(guide_text()))
    assert {group for group, _ in flags} >= {"model", "data", "trainer"}, sorted(flags)
    known = lambda group, name: name in settings(group) or name in PARSER_KEYS  # noqa: E731
    unknown = sorted(f"--{group}.{name}" for group, name in flags if not known(group, name))
    assert not unknown, f"flags the guide names that are no setting: {unknown}"


def test_every_file_and_link_the_guide_names_exists():
    text = guide_text()
    files = set(REPO_PATH.findall(text))
    assert len(files) > 10, sorted(files)
    missing = sorted(path for path in files if not (ROOT / path).exists())
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]
    assert links
    missing += sorted(link for link in links if not (GUIDE.parent / link.split("#")[0]).exists())
    assert not missing, f"files the guide names that do not exist: {missing}"


def readme_settings_rows() -> list[tuple[str, str, str]]:
    """README's settings table: (group, name, the default it states)."""
    section = README.read_text().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `--(\w+)\.(\w+)` \| `([^`]*)` \|", section, re.MULTILINE)


def stated(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: `embedded`


def test_readme_settings_table_gives_the_codes_defaults():
    rows = readme_settings_rows()
    assert len(rows) >= 12
    for group, name, default in rows:
        assert name in settings(group), f"--{group}.{name}"
        assert stated(default) == settings(group)[name].default, f"--{group}.{name}"


def test_readme_lists_every_section_of_the_guide():
    headings = re.findall(r"^## (.+)$", guide_text(), re.MULTILINE)
    section = README.read_text().split("\n## The guide\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \*\*(.+?)\*\*", section, re.MULTILINE)
    assert listed == headings


def test_every_relative_link_in_readme_leads_to_a_file():
    links = [link for link in LINK.findall(README.read_text()) if not re.match(r"[a-z]+:|#", link)]
    assert "notebooks/guide.ipynb" in links
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
