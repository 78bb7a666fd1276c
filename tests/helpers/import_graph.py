"""The package's import graph read from the source with ``ast``: every import counts, those under
``if TYPE_CHECKING:`` and inside functions too (test_imports.py, test_layers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "forge_lightning"

ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``__init__`` names its package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module a ``from ... import`` names, with a relative one resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    # In a package's __init__ one dot is the package itself; in a plain module, its parent.
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that importing ``name`` runs: ``name`` itself or its longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports anywhere in its source."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, is_package)
            # ``from pkg import name`` means the submodule ``pkg.name`` where there is one.
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        found.update(owner for n in names if (owner := _owner(n, modules)) is not None)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each group of modules that reach one another."""
    cycles = []
    for group in strongly_connected(graph):
        if len(group) > 1:
            cycles.append(_cycle_within(graph, group))
    return cycles


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative so that a deep chain of imports cannot hit the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    groups.append(group)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return groups


def _cycle_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path back to the group's first module (breadth first, inside the group)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root
