"""The package's modules import one another without a circle, and the old import paths still work.

Every import counts, read from the source with ``ast``: those under ``if TYPE_CHECKING:`` and those
inside functions too, since a function-level import that dodges a circle at import time still makes
the two modules depend on each other. A package's own ``__init__`` running before its submodules is
not counted as an edge: that is Python's loading order, not a dependency the code chose.
"""

from __future__ import annotations

import importlib

import pytest
from helpers.import_graph import find_cycles, import_graph, strongly_connected, write_tree

from forge_lightning._moved import MOVED


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    groups = [sorted(g) for g in strongly_connected(graph) if len(g) > 1]
    assert not cycles, "import cycles in the package:\n" + "\n".join(
        f"{' -> '.join(cycle)}  (modules that reach one another: {', '.join(group)})"
        for cycle, group in zip(cycles, groups)
    )


def test_the_cycle_finder_sees_type_checking_function_level_and_relative_imports(tmp_path):
    root = write_tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "b.py": "def f():\n    from .sub import c\n",
            "sub/__init__.py": "",
            "sub/c.py": "import pkg.a\n",
            "d.py": "from pkg import a\n",  # a submodule by name: an edge to pkg.a, none back
        },
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.d"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_an_import_of_a_package_name_means_its_init(tmp_path):
    root = write_tree(
        tmp_path / "pkg",
        {"__init__.py": "from pkg.a import x\n", "a.py": "from pkg import helper\nx = 1\n", "helper.py": ""},
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg.a"] == {"pkg.helper"}  # helper is a submodule: no edge to pkg's __init__
    root = write_tree(tmp_path / "pkg", {"a.py": "from pkg import y\nx = 1\n"})
    assert find_cycles(import_graph(root, "pkg")) == [["pkg", "pkg.a", "pkg"]]


# Names importable from their old modules before the sampling types and the reward and data files
# were split (at 267f81d): each must still import from there.
OLD_PATHS = {
    "forge_lightning.rollout": ["SamplingParams", "Rollout", "RolloutSampler", "encode_prompts"],
    "forge_lightning.generation": [
        "GenerationBackend",
        "LogProbGenerationBackend",
        "HFGenerate",
        "SamplingParams",
        "eos_token_ids",
        "generation_backend",
    ],
    # Every public name rewards/library.py defined, and the private one rewards/math_verify_reward.py imports.
    "forge_lightning.rewards": [
        "SLOW_REWARD_SECONDS",
        "RewardOutput",
        "BaseReward",
        "RewardFn",
        "RewardArgument",
        "accepted_kwargs",
        "takes_completions",
        "trl_kwargs",
        "completion_messages",
        "missing_arguments",
        "require_arguments",
        "reward_name",
        "component_names",
        "checked_scores",
        "RewardTimeout",
        "RewardExit",
        "call_reward",
        "ExactMatchReward",
        "FormatReward",
        "LengthPenaltyReward",
        "OverlongPenaltyReward",
        "GSM8KAnswerReward",
        "CompositeReward",
        "as_reward",
        "reward_spec",
        "load_reward",
        "_require_references",
    ],
    # Every public name data/gsm8k.py defined, and the private one test_data.py reads.
    "forge_lightning.data.gsm8k": [
        "HUB_DATASET",
        "HUB_CONFIG",
        "format_prompt",
        "normalize_number",
        "extract_answer",
        "parse_reference",
        "require_in_memory",
        "in_memory_rows",
        "load_gsm8k",
        "load_prompts",
        "load_gsm8k_mock",
        "_MOCK_PROBLEMS",
    ],
}


@pytest.mark.parametrize(("module", "names"), OLD_PATHS.items())
def test_the_old_import_paths_still_work(module, names):
    imported = importlib.import_module(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{module} no longer offers {missing}"


def test_the_library_rewards_keep_their_import_path_in_checkpoints_and_configs():
    from forge_lightning.rewards import CompositeReward, GSM8KAnswerReward, reward_spec

    spec = reward_spec([GSM8KAnswerReward(), (GSM8KAnswerReward(), 2.0, "twice")])
    assert spec["class_path"] == "forge_lightning.rewards.CompositeReward"
    assert (
        spec["init_args"]["rewards_and_weights"][0][0]["class_path"]
        == "forge_lightning.rewards.GSM8KAnswerReward"
    )
    stored = importlib.import_module("forge_lightning.rewards")
    assert stored.CompositeReward is CompositeReward and stored.GSM8KAnswerReward is GSM8KAnswerReward


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_module_path_of_the_flat_layout_still_imports_as_its_new_module(old):
    imported = importlib.import_module(f"forge_lightning.{old}")
    homes = MOVED[old]
    if isinstance(homes, str):  # one object under two names: a monkeypatch through either agrees
        assert imported is importlib.import_module(f"forge_lightning.{homes}")
        assert imported.__spec__.name == f"forge_lightning.{homes}"
    else:  # split: each name found in the first home that has it
        first = importlib.import_module(f"forge_lightning.{homes[0]}")
        public = [name for name in dir(first) if not name.startswith("_")]
        assert public and all(getattr(imported, name) is getattr(first, name) for name in public)
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            imported.no_such_name  # noqa: B018


# Names renamed in their module: the old name gives the new name's object, with a DeprecationWarning.
RENAMED = [
    ("forge_lightning.training.step", "TrainingStep", "BatchTrainer"),
    ("forge_lightning.callbacks", "DifficultyCurriculum", "SettledPromptFilter"),
    ("forge_lightning.callbacks.settled_prompt_filter", "DifficultyCurriculum", "SettledPromptFilter"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED)
def test_a_renamed_name_still_imports_by_its_old_name_with_a_warning(module, old, new):
    imported = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is now {new}"):
        assert getattr(imported, old) is getattr(imported, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        imported.NoSuchName  # noqa: B018


def test_the_batch_advantages_import_from_rewards_where_they_were():
    from forge_lightning.rewards.scoring import batch_advantages, score_groups
    from forge_lightning.scoring import batch_advantages as flat

    from forge_lightning.rewards.batch_scoring import score_groups as moved_scoring
    from forge_lightning.training.step import batch_advantages as moved

    assert batch_advantages is flat is moved and score_groups is moved_scoring


def test_a_name_that_a_split_sent_to_another_module_imports_from_its_old_path():
    from forge_lightning.checkpoint_io import AtomicCheckpointIO, save_run_state
    from forge_lightning.config import check_resume, validate_hparams
    from forge_lightning.tools import EnvironmentReward, InlineCalculator
    from forge_lightning.tools.calculator import CalculatorTools

    from forge_lightning.run.checkpoint_io import AtomicCheckpointIO as moved_io
    from forge_lightning.training.run_state import save_run_state as moved_save

    assert (AtomicCheckpointIO, save_run_state) == (moved_io, moved_save)
    assert callable(check_resume) and callable(validate_hparams)
    assert EnvironmentReward.__module__ == "forge_lightning.rewards.environment"
    assert (
        InlineCalculator.__module__
        == CalculatorTools.__module__
        == "forge_lightning.rollout.tools.calculator"
    )
