"""Each setting is declared once, as a field of its group (settings/groups/), and everything else
is read from that field: the module's signature and help, the CLI's flags, the guide's settings
table, the range checks (RULES) and the resume rules (CHANGEABLE_ON_RESUME). A synthetic setting
declared in one place shows up in all of them; and no setting's name is spread over the package."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
from jsonargparse import ArgumentParser

from forge_lightning.data import PromptDataModule
from forge_lightning.module import GRPOLightningModule
from forge_lightning.settings.checks import RULES, check_setting
from forge_lightning.settings.declare import Group, check_value, setting, setting_name
from forge_lightning.settings.groups import (
    CHANGEABLE_ON_RESUME,
    DECLARED,
    changeable_of,
    declared_fields,
    rules_of,
    setting_help,
)
from forge_lightning.settings.signature import (
    bound_settings,
    documented_settings,
    setting_parameters,
    settings_signature,
    settings_table,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "forge_lightning"
GUIDE = ROOT / "notebooks" / "guide.ipynb"


@dataclass(frozen=True)
class ShineSettings(Group):
    """A group a test declares: one setting, and nothing else written anywhere."""

    polish_rounds: int = setting(
        3, check=(lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"), resume=True
    )
    """rounds of polish each completion gets (a synthetic setting)."""


DECLARED_TOO = {**DECLARED, "shine": ShineSettings}


class Probe:
    """A class whose settings are the declared ones plus the test's.

    Args:
        name: an object it is given, not a setting.
    """

    @settings_signature(after={}, declared=DECLARED_TOO)
    def __init__(self, name: str = "probe", **settings: Any) -> None:
        self.name, self.settings = name, bound_settings("Probe", settings, DECLARED_TOO)


documented_settings(Probe, DECLARED_TOO)


def guide_table(cell_id: str) -> str:
    """The settings table the guide shows, as saved: the output of its code cell ``cell_id``."""
    [cell] = [c for c in json.loads(GUIDE.read_text())["cells"] if c.get("id") == cell_id]
    [output] = [o for o in cell["outputs"] if "text/markdown" in o.get("data", {})]
    return "".join(output["data"]["text/markdown"])


def test_a_setting_declared_in_one_place_becomes_a_flag_with_its_help_type_and_default():
    parser = ArgumentParser()
    parser.add_class_arguments(Probe, "model")
    help_text = " ".join(parser.format_help().split())
    assert "--model.polish_rounds" in help_text
    assert "rounds of polish each completion gets (a synthetic setting). (type: int, default: 3)" in help_text
    assert parser.parse_args(["--model.polish_rounds", "5"]).model.polish_rounds == 5
    assert Probe(polish_rounds=5).settings["polish_rounds"] == 5
    assert Probe().settings["polish_rounds"] == 3


def test_a_setting_declared_in_one_place_is_range_checked_and_its_resume_rule_read():
    with pytest.raises(ValueError, match=r"^polish_rounds must be an integer >= 1, got 0$"):
        ShineSettings(polish_rounds=0)
    rule = rules_of(DECLARED_TOO)["polish_rounds"]
    with pytest.raises(ValueError, match=r"^polish_rounds must be an integer >= 1, got 0$"):
        check_value("polish_rounds", 0, rule)
    assert "polish_rounds" in changeable_of(DECLARED_TOO)
    assert "polish_rounds" not in RULES and "polish_rounds" not in CHANGEABLE_ON_RESUME  # the real ones


def test_a_setting_declared_in_one_place_is_listed_in_the_guides_table():
    table = settings_table(Probe, "model")
    row = next(line for line in table.splitlines() if line.startswith("| `--model.polish_rounds` |"))
    assert (
        row
        == "| `--model.polish_rounds` | `3` | rounds of polish each completion gets (a synthetic setting). |"
    )


def test_the_guides_settings_tables_are_the_generated_ones():
    assert guide_table("settings-table") == settings_table(GRPOLightningModule, "model")
    assert guide_table("data-settings-table") == settings_table(PromptDataModule, "data")


def test_an_unknown_keyword_is_pythons_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'polish_round'"):
        Probe(polish_round=5)


def test_the_modules_signature_help_checks_and_resume_rules_are_the_declarations():
    params = inspect.signature(GRPOLightningModule.__init__).parameters
    help_text = setting_help()
    for group, item in declared_fields():
        name = setting_name(item)
        assert params[name].default == item.default, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert help_text[name], f"{name} has no help (an attribute docstring under its field)"
        assert ("check" in item.metadata) == (name in RULES), name
        assert item.metadata["resume"] == (name in CHANGEABLE_ON_RESUME), name
    assert [p.name for p in setting_parameters()] == [n for n in params if n in help_text]


def test_every_modules_flag_has_its_declared_help():
    parser = ArgumentParser()
    parser.add_class_arguments(GRPOLightningModule, "model")
    help_text = " ".join(parser.format_help().split())
    for name, text in setting_help().items():
        assert f"--model.{name} " in help_text, name
        assert " ".join(text.split()[:6]) in help_text, name


def test_every_group_field_is_a_declared_setting():
    for kind in DECLARED.values():
        for item in fields(kind):
            assert "resume" in item.metadata, f"{kind.__name__}.{item.name} is not declared with setting()"


# Settings whose names are in more package files than the three the rule allows (the declaration,
# where it is read, one message), with the most files each may be in: a number that may only go
# down. Each is there for the reason beside it: a field or keyword of a public type of the layers
# below (renaming it would break users' code), or a word the package uses for something else too.
SPREAD: dict[str, int] = {
    # Rollout.group_size, GenerationRequest.group_size, the episode runners' keyword, the servers' wire
    "group_size": 42,
    "max_new_tokens": 29,  # SamplingParams.max_new_tokens, HF generate's keyword (the servers' too)
    "temperature": 22,  # SamplingParams.temperature, LogProbScorer's and the loss's keyword
    "top_p": 11,  # SamplingParams.top_p, HF's and vLLM's keyword
    "top_k": 10,  # SamplingParams.top_k, HF's and vLLM's keyword
    "min_p": 8,  # SamplingParams.min_p, HF's and vLLM's keyword
    "repetition_penalty": 8,  # SamplingParams.repetition_penalty, HF's and vLLM's keyword
    "stop": 45,  # SamplingParams.stop; and the English word (a run, a worker, a loop stops)
    # Read by the rollout server too, from the run's own config (cli/serve.py loads its model).
    "model_dtype": 4,
    "attn_implementation": 4,
    "vllm_gpu_memory_utilization": 4,
    "rollout_servers": 4,  # checked with the others (settings/checks.py); the bench's flag
    "generation_kwargs": 4,  # TRL's name (bench/trl_reference.py); the engines' refused keys
    "max_prompt_length": 8,  # PromptFormat's field and rollout.sampler.max_prompt_length()
    "use_chat_template": 6,  # PromptFormat's field, RewardModel's keyword
    "system_prompt": 9,  # PromptFormat's, RewardModel's, PolicyContext's, testing.scripted's
    "chat_template_kwargs": 5,  # PromptFormat's field, FunctionTools' keyword
    "loss_type": 4,  # grpo.LossSettings' field
    "kl_beta": 7,  # grpo.LossSettings' field; the bench's reference losses
    "kl_in_reward": 4,  # grpo.LossSettings' field
    "num_iterations": 5,  # checked with others (checks.py), and read from a checkpoint (cli/check_resume.py)
    "steps_per_generation": 6,  # as num_iterations; and the bench's flag
    "use_engine_logprobs": 7,  # refused by name where an engine or tool loop cannot give them; the bench
    "rollout_correction": 8,  # grpo.LossSettings' field; refused by name where an engine cannot give it
    "learning_rate": 5,  # read for the rescaled peak (module.py); TRL's name in the bench
    "gradient_accumulation_steps": 8,  # as num_iterations; the Trainer's refusal; TRL's name in the bench
    "dynamic_sampling": 10,  # also training/dynamic_sampling.py's name, which its imports spell
    "generation_backend": 11,  # also registry.generation_backend() and prepare_policy's keyword
    # refused by name by the engines that cannot sample in it; the benches' flag; read by the rollout
    # server from the run's config (cli/serve.py)
    "rollout_precision": 8,
    "rollout_mode": 6,  # read from a checkpoint (cli/check_resume.py); the bench's flag
    "rollout_device": 4,  # checked with rollout_mode (checks.py) and by the worker's device check
    "rollout_memory_fraction": 5,  # as rollout_device; read by the rollout server from the run's config
    "train_micro_batch_size": 6,  # the preflight's advice (its memory error, its suggestions); the bench
    "train_micro_batch_tokens": 4,  # as train_micro_batch_size
    "prefix_sharing": 5,  # prepare_policy's and WorkerSettings' keyword; the bench
    "gradient_checkpointing": 7,  # prepare_policy's keyword; the preflight's advice; the bench; TRL's name
    "on_reward_error": 4,  # testing.scripted's keyword (the users' test kit)
    "reward_timeout": 5,  # rewards.score()'s keyword; an example's config
    "calculator": 13,  # also rollout/tools/calculator.py and the calculator tool's name
    "max_tool_calls": 7,  # ToolRolloutSampler's and testing.scripted's keyword; the benches
    "tool_timeout": 4,  # testing.scripted's keyword
    "agent": 12,  # also rollout/agents/ and the word for what runs an episode
    "sandbox": 34,  # also run/sandbox*.py, the Sandbox class and every call's sandbox= keyword
    "preflight": 10,  # also training/preflight.py and the word for the worst-case step
}
# Files the rule does not count: TRL's names for the settings (settings/trl_names.py), the old
# module paths (_moved.py: module names), and the two
# front doors whose users write the settings' names as their own config's fields: TRL's GRPOConfig
# and its translation (trl/, TRL's vocabulary, field for field) and Forge's GRPOConfig (compat.py);
# and the benches' TRL side (scripts run in TRL's own venv, importing nothing of this package,
# that spell TRL's GRPOConfig fields, and the race's driver that hands a config's settings to one
# as its flags).
EXEMPT = {
    "settings/trl_names.py",
    "_moved.py",
    "compat.py",
    "bench/trl_reference.py",
    "bench/trl_time_reference.py",
    "bench/time_to_accuracy.py",
}
EXEMPT_FOLDERS = ("trl/",)


def files_naming(name: str) -> list[str]:
    word = re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")
    found = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        if where not in EXEMPT and not where.startswith(EXEMPT_FOLDERS) and word.search(path.read_text()):
            found.append(where)
    return sorted(found)


@pytest.mark.parametrize("name", [setting_name(item) for _, item in declared_fields()])
def test_no_settings_name_is_in_more_than_three_package_files(name):
    found = files_naming(name)
    allowed = SPREAD.get(name, 3)
    assert len(found) <= allowed, f"{name} is named in {len(found)} files (at most {allowed}): {found}"


def test_the_spread_list_names_only_settings_still_over_the_limit():
    settings = {setting_name(item) for _, item in declared_fields()}
    assert set(SPREAD) <= settings
    settled = [name for name in SPREAD if len(files_naming(name)) <= 3]
    assert not settled, f"within three files now, take them out of SPREAD: {settled}"


def test_check_setting_keeps_the_old_messages():
    with pytest.raises(ValueError, match=r"^group_size must be an integer >= 2, got 1$"):
        check_setting("group_size", 1)
    with pytest.raises(ValueError, match=r"^prompt_truncation must be 'left' or 'error', got 'x'$"):
        check_setting("prompt_truncation", "x")
