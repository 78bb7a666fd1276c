"""The CLI end to end on a tiny model, and every shipped config kept parseable."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from forge_lightning.callbacks.reward_logger import (
    ASYNC_JSONL_KEYS,
    CORRECTION_JSONL_KEYS,
    JSONL_KEYS,
    SERVER_JSONL_KEYS,
    TOOL_JSONL_KEYS,
)
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.cli.stages import without_stages
from forge_lightning.run.folder import RunFolder

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
OVERLAYS = sorted((ROOT / "configs" / "overlays").glob("*.yaml"))
ABLATIONS = sorted((ROOT / "configs" / "ablations").glob("*.yaml"))
# Every config and overlay combination README shows: each config alone, gsm8k.yaml with each
# overlay, and arithmetic_cpu.yaml with each of its ablations.
COMBINATIONS = [[c] for c in CONFIGS] + [[ROOT / "configs" / "gsm8k.yaml", o] for o in OVERLAYS]
COMBINATIONS += [[ROOT / "configs" / "arithmetic_cpu.yaml", a] for a in ABLATIONS]
# Those that keep Lightning checkpoints to resume from.
RESUMABLE = [
    c for c in COMBINATIONS if (yaml.safe_load(c[0].read_text()).get("checkpoint") or {}).get("save_last")
]


def config_args(files: list[Path]) -> list[str]:
    return [arg for f in files for arg in ("--config", str(f))]


@contextmanager
def fits_of(files: list[Path]) -> Iterator[list[tuple[list[str], list[dict]]]]:
    """Each fit that ``files`` run (one; a recipe's one per stage, cli/stages.py): its config
    arguments and the settings they layer, in order."""
    layers = [yaml.safe_load(f.read_text()) for f in files]
    with without_stages(config_args(files)) as staged:
        if not staged.stages:
            yield [(staged.args, layers)]
            return
        yield [
            ([*staged.args, "--config", str(staged.stage_file(k))], [*layers, stage.settings])
            for k, stage in enumerate(staged.stages)
        ]


@pytest.mark.parametrize("files", COMBINATIONS, ids=["+".join(f.stem for f in c) for c in COMBINATIONS])
def test_every_config_and_overlay_parses_to_the_settings_it_names(files, capsys):
    with fits_of(files) as fits:
        for args, layers in fits:
            with pytest.raises(SystemExit) as exit_info:
                build_cli(["fit", *args, "--print_config"])
            assert exit_info.value.code == 0
            printed = yaml.safe_load(capsys.readouterr().out)
            expected: dict[tuple[str, str], object] = {}
            for layer in layers:  # a later file's value wins, as LightningCLI layers them
                for section, values in layer.items():
                    if isinstance(values, dict):
                        scalars = {k: v for k, v in values.items() if isinstance(v, (str, int, float, bool))}
                        expected.update({(section, key): value for key, value in scalars.items()})
            assert expected
            for (section, key), value in expected.items():
                values = printed[section]
                values = values.get("init_args", values) if key not in values else values  # data: a class
                assert values[key] == value, (section, key)


@pytest.mark.integration
@pytest.mark.parametrize("files", RESUMABLE, ids=["+".join(f.stem for f in c) for c in RESUMABLE])
def test_ckpt_path_last_finds_the_checkpoint_under_every_config_and_overlay(files, tmp_path):
    root = tmp_path / "run"
    with fits_of(files) as fits:  # a recipe's first stage
        args = [*fits[0][0], f"--trainer.default_root_dir={root}", "--trainer.accelerator=cpu"]
        args += ["--trainer.devices=1", "--trainer.strategy=auto", "--model.generation_backend=hf"]
        cli = build_cli(args, run=False)
    folders = [Path(cb.dirpath) for cb in cli.trainer.checkpoint_callbacks if cb.dirpath]
    assert folders == [root / "checkpoints"]
    assert cli.trainer.checkpoint_callback.save_last
    assert Path(cli.trainer.logger.log_dir).parent == root / "tensorboard"
    folder = RunFolder(root, folders)
    assert folder.newest_checkpoint() is None
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert folder.newest_checkpoint() == root / "checkpoints" / "last.ckpt"


@pytest.mark.integration
def test_fit_writes_checkpoint_jsonl_and_tensorboard(
    tiny_model_dir, tmp_path, tiny_overrides, capsys, recwarn
):
    out = tmp_path / "run"
    build_cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            *tiny_overrides(tiny_model_dir, out),
            "--trainer.max_steps=3",
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2
    records = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    expected = {"step", "epoch", *JSONL_KEYS, "rewards/GSM8KAnswerReward", "rewards/GSM8KAnswerReward_std"}
    expected -= {"sampling_rounds", "groups_dropped"}  # logged with dynamic sampling only
    expected -= {"groups_filtered"}  # and with a callback that may filter (callbacks/rl_loop.py)
    # and with asynchronous rollouts, rollout correction, tools, rollout servers
    expected -= {*ASYNC_JSONL_KEYS, *CORRECTION_JSONL_KEYS, *TOOL_JSONL_KEYS, *SERVER_JSONL_KEYS}
    assert set(records[0]) == expected
    events = EventAccumulator(str(next(out.rglob("events.out.tfevents*")).parent))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/reward", "train/kl", "train/loss", "perf/tokens_per_s"} <= scalars
    assert "hp_metric" not in scalars  # TensorBoard's constant -1 placeholder
    assert len(events.Scalars("train/reward")) == 3
    assert (out / "2" / "config.json").is_file()  # smoke.yaml saves every 2 steps
    # The summary printed at the end says what happened and where everything is.
    summary = capsys.readouterr().out.split("Training finished at step 3.")[1]
    first, last = records[0]["reward"], records[-1]["reward"]
    assert f"reward       {first:.3f} (step 1) -> {last:.3f} (step 3)" in summary
    assert f"log          {out / 'training_log.jsonl'}" in summary
    assert f"checkpoints  {out / 'checkpoints'}  (resume with --ckpt_path last)" in summary
    assert f"model        {out / 'final'}" in summary
    assert f"tensorboard  tensorboard --logdir {out / 'tensorboard'}" in summary
    # ModelCheckpoint's advice to keep the weights from before each step does not apply here.
    assert not [w for w in recwarn if "pre-optimization state" in str(w.message)]
    # One copy of the training state (1.6 GB for the 135M model), not last.ckpt and a step's too.
    assert [p.name for p in (out / "checkpoints").glob("*.ckpt")] == ["last.ckpt"]
    build_cli(
        ["fit", *smoke_args(tiny_model_dir, out, tiny_overrides), "--trainer.max_steps=4", "--ckpt_path=last"]
    )
    records = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # resumed at step 2, step 3 redone
    assert [p.name for p in (out / "checkpoints").glob("*.ckpt")] == ["last.ckpt"]


@pytest.mark.integration
@pytest.mark.parametrize("files", RESUMABLE, ids=["+".join(f.stem for f in c) for c in RESUMABLE])
def test_every_config_keeps_one_copy_of_the_training_state(files, tmp_path):
    with fits_of(files) as fits:
        for fit_args, _ in fits:
            args = [*fit_args, f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu"]
            args += ["--trainer.devices=1", "--trainer.strategy=auto", "--model.generation_backend=hf"]
            (saver,) = build_cli(args, run=False).trainer.checkpoint_callbacks
            assert saver.save_last is True and saver.save_top_k == 0  # last.ckpt alone, rewritten each time


@pytest.mark.integration
def test_gsm8k_recipe_runs_one_step_on_a_tiny_model_and_local_data(
    tiny_model_dir, gsm8k_dir, tmp_path, tiny_overrides
):
    out = tmp_path / "gsm8k"
    build_cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "gsm8k.yaml"),
            *tiny_overrides(tiny_model_dir, out),
            "--trainer.max_steps=1",
            "--trainer.max_epochs=1",
            "--model.gradient_accumulation_steps=1",
            "--data.source=local",
            f"--data.path={gsm8k_dir}",
            "--data.max_samples=4",
        ]
    )
    assert (out / "final" / "model.safetensors").is_file()


def callbacks_of(cli, kind):
    return [cb for cb in cli.trainer.callbacks if isinstance(cb, kind)]


@pytest.mark.integration
def test_each_run_callback_is_set_from_the_command_line_by_name(tiny_model_dir, tmp_path, tiny_overrides):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from forge_lightning.callbacks import HFCheckpoint, RewardLogger

    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), *tiny_overrides(tiny_model_dir, tmp_path)]

    def settings(cli):
        kinds = (ModelCheckpoint, HFCheckpoint, RewardLogger)
        (saver,), (hf,), (logger,) = (callbacks_of(cli, k) for k in kinds)
        return saver._every_n_train_steps, saver.save_last, hf.save_steps, logger.logging_steps

    cli = build_cli(args, run=False)
    assert settings(cli) == (2, True, 2, 1)  # smoke.yaml's

    overrides = ["--checkpoint.every_n_train_steps=3", "--hf_checkpoint.save_steps=7"]
    cli = build_cli([*args, *overrides, "--reward_logger.logging_steps=5"], run=False)
    assert settings(cli) == (3, True, 7, 5)
    assert cli.trainer.checkpoint_callback.dirpath == str(tmp_path / "checkpoints")

    cli = build_cli([*args, "--hf_checkpoint=null", "--reward_logger=null"], run=False)
    assert callbacks_of(cli, HFCheckpoint) == callbacks_of(cli, RewardLogger) == []
    cli = build_cli([*args, "--trainer.enable_checkpointing=false"], run=False)
    assert callbacks_of(cli, ModelCheckpoint) == [] and len(callbacks_of(cli, HFCheckpoint)) == 1


@pytest.mark.integration
def test_a_run_callback_listed_in_trainer_callbacks_replaces_its_group(
    tiny_model_dir, tmp_path, tiny_overrides
):
    from forge_lightning.callbacks import HFCheckpoint

    listed = '[{"class_path": "forge_lightning.callbacks.HFCheckpoint", "init_args": {"save_steps": 4}}]'
    config = ROOT / "configs" / "custom_reward.yaml"
    args = ["--config", str(config), *tiny_overrides(tiny_model_dir, tmp_path)]
    cli = build_cli([*args, "--hf_checkpoint=null", f"--trainer.callbacks={listed}"], run=False)
    assert [cb.save_steps for cb in callbacks_of(cli, HFCheckpoint)] == [4]
    # custom_reward.yaml sets the group (save_steps 0): configured twice, refused by name.
    with pytest.raises(SystemExit, match="HFCheckpoint is configured twice.*hf_checkpoint"):
        build_cli([*args, f"--trainer.callbacks={listed}"], run=False)


def test_a_data_setting_may_be_null_on_the_command_line(capsys):
    # jsonargparse before 4.40 crashed on a null init arg of the (subclass-mode) datamodule.
    with pytest.raises(SystemExit) as exit_info:
        build_cli(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "smoke.yaml"),
                "--data.max_samples",
                "null",
                "--print_config",
            ]
        )
    assert exit_info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["max_samples"] is None


def smoke_args(model_dir, out, tiny_overrides) -> list[str]:
    return ["--config", str(ROOT / "configs" / "smoke.yaml"), *tiny_overrides(model_dir, out)]


@pytest.mark.integration
def test_checkpoint_null_keeps_no_lightning_checkpoint(tiny_model_dir, tmp_path, tiny_overrides):
    cli = build_cli([*smoke_args(tiny_model_dir, tmp_path, tiny_overrides), "--checkpoint=null"], run=False)
    assert cli.trainer.checkpoint_callbacks == []  # not Lightning's default ModelCheckpoint instead


@pytest.mark.integration
def test_other_loggers_write_into_the_run_folder(tiny_model_dir, tmp_path, tiny_overrides, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    args = smoke_args(tiny_model_dir, tmp_path / "run", tiny_overrides)
    cli = build_cli([*args, "--trainer.logger+=CSVLogger", "--trainer.logger+=WandbLogger"], run=False)
    csv, wandb = cli.trainer.loggers
    assert isinstance(csv, CSVLogger) and isinstance(wandb, WandbLogger)
    assert csv.save_dir == wandb.save_dir == str(tmp_path / "run")  # not ./ (W&B) or an error (CSV)
    chosen = tmp_path / "elsewhere"
    cli = build_cli([*args, "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={chosen}"], run=False)
    assert cli.trainer.logger.save_dir == str(chosen)


def test_an_out_of_range_setting_is_one_line(tiny_model_dir, tmp_path, tiny_overrides):
    with pytest.raises(SystemExit, match=r"^fit: group_size must be an integer >= 2, got 1$"):
        build_cli([*smoke_args(tiny_model_dir, tmp_path, tiny_overrides), "--model.group_size=1"], run=False)


@pytest.mark.integration
def test_abbreviated_flags_are_refused_and_exact_ones_parse(tiny_model_dir, tmp_path, tiny_overrides, capsys):
    args = smoke_args(tiny_model_dir, tmp_path, tiny_overrides)
    with pytest.raises(SystemExit) as stopped:
        build_cli([*args, "--model.temp", "0.5"], run=False)  # was taken for --model.temperature
    assert stopped.value.code == 2 and "--model.temp" in capsys.readouterr().err
    extra = ["--model.temperature", "0.5", "--trainer.callbacks+=LearningRateMonitor"]
    cli = build_cli([*args, *extra], run=False)
    assert cli.model.hparams.temperature == 0.5
    assert any(type(c).__name__ == "LearningRateMonitor" for c in cli.trainer.callbacks)


@pytest.mark.integration
def test_the_progress_bar_shows_no_logger_version(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from forge_lightning.cli.progress import default_progress_bar

    trainer = Trainer(logger=CSVLogger(tmp_path), default_root_dir=tmp_path, enable_checkpointing=False)
    assert "v_num" not in default_progress_bar().get_metrics(trainer, None)


@pytest.mark.integration
def test_a_preflight_over_its_limit_exits_with_its_message(tiny_model_dir, tmp_path, tiny_overrides):
    flags = ["--model.preflight=true", "--model.preflight_memory_gb=0.1", "--trainer.max_steps=1"]
    with pytest.raises(SystemExit) as stopped:  # the message as the exit code: no traceback
        build_cli(["fit", *smoke_args(tiny_model_dir, tmp_path, tiny_overrides), *flags])
    message = str(stopped.value.code)
    assert message.startswith("Preflight: the worst-case first step (4 prompts x 4 completions")
    assert "over the limit of 102.4 MiB (preflight_memory_gb)" in message
    assert not list(tmp_path.rglob("*.ckpt"))  # stopped before any step
