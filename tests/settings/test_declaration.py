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


# Settings whose names are still spread over more package files than the three the rule allows
# (the declaration, where it is read, one message), with the most files each may be in: a number
# that may only go down. The names most of these share with lower layers' own parameters
# (SamplingParams.temperature, a sampler's group_size), with TRL's and Forge's configs (trl/,
# compat.py) and with English (stop, sandbox, agent) are the bulk of it.
SPREAD: dict[str, int] = {
    "group_size": 42,
    "max_new_tokens": 30,
    "temperature": 27,
    "top_p": 13,
    "top_k": 12,
    "min_p": 9,
    "repetition_penalty": 9,
    "stop": 37,
    "generation_kwargs": 8,
    "max_prompt_length": 9,
    "use_chat_template": 7,
    "system_prompt": 9,
    "chat_template_kwargs": 7,
    "loss_type": 9,
    "kl_beta": 13,
    "importance_sampling_level": 4,
    "kl_estimator": 4,
    "clip_ratio_c": 4,
    "sapo_temperature_pos": 5,
    "sapo_temperature_neg": 5,
    "entropy_coef": 6,
    "kl_in_reward": 7,
    "advantage_scale": 7,
    "advantage_estimator": 4,
    "mask_truncated_completions": 8,
    "num_iterations": 12,
    "steps_per_generation": 17,
    "use_engine_logprobs": 10,
    "rollout_correction": 15,
    "learning_rate": 11,
    "weight_decay": 5,
    "gradient_accumulation_steps": 18,
    "max_grad_norm": 7,
    "warmup_steps": 6,
    "lr_schedule": 5,
    "dynamic_sampling": 14,
    "max_sampling_rounds": 5,
    "generation_backend": 16,
    "vllm_gpu_memory_utilization": 6,
    "rollout_precision": 11,
    "rollout_mode": 9,
    "max_staleness": 6,
    "rollout_device": 4,
    "rollout_memory_fraction": 4,
    "train_micro_batch_size": 9,
    "train_micro_batch_tokens": 5,
    "prefix_sharing": 7,
    "logprob_chunk_size": 4,
    "gradient_checkpointing": 10,
    "model_dtype": 6,
    "attn_implementation": 6,
    "on_reward_error": 10,
    "reward_timeout": 9,
    "calculator": 14,
    "max_tool_calls": 13,
    "tool_call_format": 6,
    "tool_timeout": 7,
    "max_tool_result_chars": 6,
    "agent": 13,
    "sandbox": 34,
    "sandbox_workers": 4,
    "sandbox_env": 4,
    "val_num_generations": 7,
    "preflight": 10,
}
# Files the rule does not count: TRL's names for the settings (settings/trl_names.py), and the two
# front doors whose users write the settings' names as their own config's fields: TRL's GRPOConfig
# and its translation (trl/, TRL's vocabulary, field for field) and Forge's GRPOConfig (compat.py).
EXEMPT = {"settings/trl_names.py", "compat.py"}
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
