"""The tests' own layout: what test modules share lives in tests/helpers/ (fakes, tiny models,
runners, the user code that subprocesses and sandbox workers import by name, torchrun's scripts)
and fixtures in conftest.py, so no test module imports another test module or conftest. Every
import counts, read from the source with ``ast``: those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Scripts that are neither tests nor helpers, each with why it stays where it is.
SCRIPTS = {"gpu/check.py": "the GPU check's runner, started by gpu/check.sh beside it"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module name) of every absolute import in ``path``'s source."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def is_test_module(name: str) -> bool:
    return name == "conftest" or name.startswith("test_")


def test_no_test_module_or_helper_imports_a_test_module_or_conftest():
    checked = sorted(TESTS.rglob("test_*.py")) + sorted((TESTS / "helpers").rglob("*.py"))
    wrong = [
        f"{path.relative_to(TESTS)}:{line} imports {name} (move what it needs to tests/helpers/)"
        for path in checked
        for line, name in imported_modules(path)
        if is_test_module(name)
    ]
    assert len(checked) > 100 and not wrong, "\n".join(wrong)


def test_every_module_below_tests_is_a_test_conftest_a_helper_or_a_named_script():
    others = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("*.py"))
        if not path.name.startswith("test_")
        and path.name != "conftest.py"
        and "helpers" not in path.relative_to(TESTS).parts
        and str(path.relative_to(TESTS)) not in SCRIPTS
    ]
    assert others == [], f"modules that belong in tests/helpers/: {others}"


def test_the_scan_sees_imports_inside_functions_and_of_submodules(tmp_path):
    source = tmp_path / "test_x.py"
    source.write_text(
        "import os\n\ndef f():\n    from test_y import z\n    import conftest.a\nfrom . import b\n"
    )
    assert sorted(imported_modules(source)) == [(1, "os"), (4, "test_y"), (5, "conftest")]
