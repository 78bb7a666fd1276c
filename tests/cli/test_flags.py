"""The command line's flags as a TRL user types them: a list setting's append form, a nested flag
on a single class, a misspelt --data.* name, an environment factory that makes no environment, and
where README says the data settings are listed. Each error is one line."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.data import PromptDataModule
from forge_lightning.settings.trl_names import given_model_settings

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]

# Three entries for each list setting of the module (what `fit --help` lists as `--model.<name>+`).
ENTRIES = {
    "reward": ["forge_lightning.rewards.GSM8KAnswerReward"] * 3,
    "stop": ["A", "B", "C"],
    "tools": ["os.getcwd", "os.getpid", "os.getppid"],
    "sandbox_env": ["HOME", "PATH", "LANG"],
    "rollout_servers": ["local:1", "node7:8000", "ray:2"],
}


def printed(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """``fit --print_config`` of ``args``, read back."""
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", *SMOKE, *args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def refused(args: list[str]) -> str:
    """The message a command line is refused with before a Trainer is built."""
    with pytest.raises(SystemExit) as exit_info:
        build_cli([*SMOKE, *args], run=False)
    return str(exit_info.value.code)


def named(entry: object) -> object:
    """An entry as its name: a reward's class (printed as a class_path) by its class name."""
    path = entry["class_path"] if isinstance(entry, dict) else entry
    return path.rsplit(".", 1)[-1] if path.startswith("forge_lightning.") else path


def test_every_list_setting_the_help_offers_an_append_form_for_is_covered(capsys):
    with pytest.raises(SystemExit):
        build_cli(["fit", "--help"])
    appended = re.findall(r"--model\.(\w+)\+ ", capsys.readouterr().out)
    assert sorted(set(appended)) == sorted(ENTRIES)


@pytest.mark.parametrize("setting", sorted(ENTRIES))
def test_the_append_form_of_a_list_setting_appends_to_the_configs_list(setting, tmp_path, capsys):
    first, second, third = ENTRIES[setting]
    config = tmp_path / "list.yaml"
    config.write_text(yaml.safe_dump({"model": {setting: [first]}}))
    args = ["--config", str(config), f"--model.{setting}+", second, f"--model.{setting}+={third}"]
    got = printed(args, capsys)["model"][setting]
    assert [named(entry) for entry in got] == [named(entry) for entry in ENTRIES[setting]]


def test_a_nested_flag_changes_a_single_reward_and_leaves_a_list_a_list(tmp_path, capsys):
    remote = {"class_path": "forge_lightning.rewards.RemoteReward", "init_args": {"url": "http://a:1/s"}}
    moved = {"url": "http://b:2/s", "batch_size": 64, "timeout": 30.0, "retries": 3, "backoff": 0.5}
    moved["api_key_env"] = None
    for given in (remote, [remote]):
        config = tmp_path / "remote.yaml"
        config.write_text(yaml.safe_dump({"model": {"reward": given}}))
        args = ["--config", str(config), "--model.reward.init_args.url=http://b:2/s"]
        reward = printed(args, capsys)["model"]["reward"]
        # A single reward stays one (a list of one is another setting, which a resume refuses).
        changed = {**remote, "init_args": moved}
        assert reward == ([changed] if isinstance(given, list) else changed)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--data.prompts_per_stp", "2"],
            "fit: `prompts_per_stp` is no setting here: did you mean `prompts_per_step`?",
        ),
        (["--data.shufle=false"], "fit: `shufle` is no setting here: did you mean `shuffle`?"),
        (
            ["--data.per_device_train_batch_size", "2"],
            "fit: TRL's `per_device_train_batch_size` is `prompts_per_step` here (--data.prompts_per_step)",
        ),
        (
            ["--data.batches_per_epoch", "2"],
            "fit: `batches_per_epoch` is no setting of PromptDataModule "
            "(`--data.help PromptDataModule` lists them)",
        ),
    ],
)
def test_a_misspelt_data_flag_is_one_line_with_the_closest_name(args, message):
    said = refused(args)
    assert said.startswith(message) and "\n" not in said  # a TRL name's pointer may add a note


def test_a_misspelt_data_key_of_a_config_file_is_one_line_too(tmp_path):
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump({"data": {"class_path": "forge_lightning.data.GSM8KDataModule",
                                               "init_args": {"val_batchsize": 4}}}))  # fmt: skip
    assert (
        refused(["--config", str(config)])
        == "fit: `val_batchsize` is no setting here: did you mean `val_batch_size`?"
    )


def test_the_data_settings_of_another_datamodule_are_its_own():
    default = f"{PromptDataModule.__module__}.{PromptDataModule.__qualname__}"
    assert given_model_settings(["fit", "--data", "my.DataModule", "--data.x", "1"], default, "data") == []
    assert given_model_settings(["fit", "--data=PromptDataModule", "--data.x=1"], default, "data") == ["x"]


@pytest.mark.parametrize(
    ("factory", "said"),
    [
        ("os.getcwd", "getcwd returned str '"),  # a function that makes no environment
        ("json.dumps", "dumps takes arguments"),  # one that cannot be called with none
        ("builtins.dict", "dict is the built-in dict"),
    ],
)
def test_an_environment_factory_that_makes_no_environment_is_one_line(
    factory, said, tiny_model_dir, tmp_path
):
    message = refused([f"--model.model={tiny_model_dir}", f"--trainer.default_root_dir={tmp_path}",
                       "--model.environment_factory", factory])  # fmt: skip
    assert message.startswith(f"fit: environment_factory {said}") and "\n" not in message
    assert message.endswith(
        "it must be a class, or a function that takes no arguments and returns an environment (an object "
        "whose public methods are its tools; reset(**row) and get_reward() optional)"
    )


def test_the_command_readme_gives_for_the_data_settings_lists_each(capsys):
    readme = (ROOT / "README.md").read_text()
    [command] = re.findall(r"`forge-lightning (fit --data\.help \w+)`", readme)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(command.split())
    assert exit_info.value.code == 0
    listed = set(re.findall(r"^\s+--data\.(\w+)", capsys.readouterr().out, re.MULTILINE))
    assert listed == set(inspect.signature(PromptDataModule).parameters)
