"""The CLI end to end on a tiny model, and every shipped config kept parseable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from forge_lightning.callbacks.reward_logger import JSONL_KEYS
from forge_lightning.cli import build_cli

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def tiny_overrides(model_dir: Path, out: Path) -> list[str]:
    return [
        f"--model.model={model_dir}",
        "--model.group_size=4",
        "--model.max_new_tokens=6",
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}",
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "model:" in capsys.readouterr().out


def test_fit_writes_checkpoint_jsonl_and_tensorboard(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    build_cli(
        [
            "fit",
            "--config",
            str(Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"),
            *tiny_overrides(tiny_model_dir, out),
            "--trainer.max_steps=3",
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2
    records = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    expected = {"step", "epoch", *JSONL_KEYS, "rewards/GSM8KAnswerReward"}
    assert set(records[0]) == expected
    events = EventAccumulator(str(next(out.rglob("events.out.tfevents*")).parent))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/reward", "train/kl", "train/loss", "perf/tokens_per_s"} <= scalars
    assert len(events.Scalars("train/reward")) == 3
    assert (out / "2" / "config.json").is_file()  # smoke.yaml saves every 2 steps


def test_gsm8k_recipe_runs_one_step_on_a_tiny_model_and_local_data(tiny_model_dir, gsm8k_dir, tmp_path):
    out = tmp_path / "gsm8k"
    build_cli(
        [
            "fit",
            "--config",
            str(Path(__file__).resolve().parents[1] / "configs" / "gsm8k.yaml"),
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
