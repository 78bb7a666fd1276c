"""The package's folders are layers, and a layer imports only the layers below it.

Read from the source with the import graph of helpers/import_graph.py (every import counts: under
``if TYPE_CHECKING:``, inside functions). On top of that order, the two rules a reader relies on
are checked by name: ``grpo/`` (the math) imports nothing of the package, and ``rollout/`` (prompts
in, a Rollout out) imports neither ``training/`` nor ``callbacks/``. And the callbacks read the
module only through their typed protocols (callbacks/protocols.py), never by probing it with
``getattr``/``hasattr``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.import_graph import ROOT, import_graph, write_tree

# Bottom to top. A module may import its own folder and the folders of lower layers, nothing else:
# an import between two folders of one layer, or upwards, is an arrow back up.
LAYERS: list[tuple[str, ...]] = [
    ("_moved",),  # where the old module paths lead
    ("grpo", "run", "sandbox"),  # the math; a run's files and checkpoints; where user code runs
    ("models", "data"),  # the policy model; the prompts
    ("rollout",),  # prompts in, a Rollout out: samplers, engines, tools
    ("serving",),  # rollout servers: the wire format, the decode loop, the weight push
    ("rewards", "reporting"),  # scores of a rollout; what a step reports
    ("training", "evaluation"),  # one training batch; validation
    ("settings",),  # the module's settings and the parts built from them
    ("callbacks",),  # Lightning callbacks around the module
    ("module",),  # GRPOLightningModule
    # the entry points (TRL's interface among them); the test kit for users' code
    ("compat", "cli", "bench", "examples", "testing", "trl"),
    ("__init__", "__main__"),  # the package's own names
]

NEVER = {"grpo": None, "rollout": {"training", "callbacks"}}  # None: nothing of the package
GSM8K = "forge_lightning.data.gsm8k"


def folder_of(module: str, package: str) -> str:
    """``pkg.rollout.engines.hf`` -> ``rollout``; ``pkg.module`` -> ``module``; ``pkg`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: dict[str, set[str]], package: str, layers: list[tuple[str, ...]]) -> list[str]:
    """One line per import that goes to a folder of the same or a higher layer, or to a folder
    no layer lists, and per import a rule of ``NEVER`` forbids."""
    rank = {folder: i for i, group in enumerate(layers) for folder in group}
    problems = []
    for module, imported in sorted(graph.items()):
        source = folder_of(module, package)
        for target in sorted(imported):
            into = folder_of(target, package)
            if into == source:
                continue
            if source not in rank or into not in rank:
                problems.append(
                    f"{module} -> {target}: a folder no layer lists ({into if source in rank else source})"
                )
            elif rank[into] >= rank[source]:
                problems.append(f"{module} -> {target}: {source} may not import {into} (same layer or above)")
            forbidden = NEVER.get(source, set())
            if source in NEVER and (forbidden is None or into in forbidden):
                problems.append(f"{module} -> {target}: {source}/ must not import {into}/")
    return problems


def probes_of_the_module(path: Path) -> list[str]:
    """``getattr(pl_module, ...)`` / ``hasattr(pl_module, ...)`` calls in a file: a callback
    guessing what the module offers instead of asking for a protocol."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in ("pl_module", "module")
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_folder_imports_only_the_layers_below_it():
    problems = layer_violations(import_graph(), "forge_lightning", LAYERS)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_every_folder_and_top_level_module_has_a_layer():
    on_disk = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    listed = {folder for group in LAYERS for folder in group}
    assert on_disk == listed, (
        f"not in a layer: {sorted(on_disk - listed)}; no longer there: {sorted(listed - on_disk)}"
    )


# GSM8K's reading of an answer (data/gsm8k.py) is the data's and its reward's: the module takes its
# default answer key from that reward, and no layer between them reads GSM8K's format.
KNOWS_GSM8K = {"data", "rewards", "bench", "examples"}


def test_only_the_data_its_reward_and_the_entry_points_know_gsm8ks_answers():
    readers = {folder_of(m, "forge_lightning") for m, imported in import_graph().items() if GSM8K in imported}
    assert readers <= KNOWS_GSM8K, f"GSM8K's answers read outside {sorted(KNOWS_GSM8K)}: {sorted(readers)}"


def test_callbacks_read_the_module_through_protocols_not_probes():
    probes = [p for path in sorted((ROOT / "callbacks").glob("*.py")) for p in probes_of_the_module(path)]
    assert not probes, "callbacks probing the module:\n" + "\n".join(probes)


def test_the_layer_check_fails_on_an_import_upwards_across_a_layer_and_into_a_forbidden_folder(tmp_path):
    root = write_tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "grpo/__init__.py": "from pkg.run import files\n",  # grpo imports nothing of the package
            "run/__init__.py": "",
            # upwards, from inside a function
            "run/files.py": "def f():\n    from pkg.rollout import sampler\n",
            "rollout/__init__.py": "",
            "rollout/sampler.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.training import step\n"
            ),
            "training/__init__.py": "",
            "training/step.py": "from pkg.rollout import sampler\n",  # downwards: fine
        },
    )
    layers = [("grpo", "run"), ("rollout",), ("training",), ("__init__",)]
    problems = layer_violations(import_graph(root, "pkg"), "pkg", layers)
    assert problems == [
        "pkg.grpo -> pkg.run.files: grpo may not import run (same layer or above)",
        "pkg.grpo -> pkg.run.files: grpo/ must not import run/",
        "pkg.rollout.sampler -> pkg.training.step: rollout may not import training (same layer or above)",
        "pkg.rollout.sampler -> pkg.training.step: rollout/ must not import training/",
        "pkg.run.files -> pkg.rollout.sampler: run may not import rollout (same layer or above)",
    ]


def test_the_probe_check_finds_a_callback_that_probes_the_module(tmp_path):
    path = tmp_path / "callback.py"
    path.write_text(
        "def on_train_batch_end(trainer, pl_module):\n"
        "    every = getattr(pl_module, 'report_every', 1)\n"
        "    if hasattr(pl_module, 'last_step'):\n"
        "        return getattr(trainer, 'global_step', 0)\n"  # the trainer: not the module
    )
    assert probes_of_the_module(path) == [
        "callback.py:2: getattr(pl_module, 'report_every', 1)",
        "callback.py:3: hasattr(pl_module, 'last_step')",
    ]
