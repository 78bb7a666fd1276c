"""`forge-lightning validate`: a checkpoint folder (full or LoRA adapter) on the validation split."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import tiny_overrides
from test_module import loader, trainer

from forge_lightning.callbacks import HFCheckpoint
from forge_lightning.cli import build_cli
from forge_lightning.lora import LoraSettings
from forge_lightning.module import GRPOLightningModule

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
VAL_KEYS = {"val/accuracy", "val/reward", "val/rewards/GSM8KAnswerReward", "val/completion_length"}


def validate(model: Path, out: Path) -> dict[str, float]:
    cli = build_cli(
        ["validate", "--config", str(SMOKE), *tiny_overrides(model, out), "--trainer.limit_val_batches=1"]
    )
    return {k: float(v) for k, v in cli.trainer.callback_metrics.items()}


def test_validate_reports_accuracy_reward_and_length(tiny_model_dir, tmp_path, capsys):
    metrics = validate(tiny_model_dir, tmp_path / "val")
    assert VAL_KEYS <= metrics.keys()
    assert 0.0 <= metrics["val/accuracy"] <= 1.0
    assert 1.0 <= metrics["val/completion_length"] <= 6.0  # smoke.yaml's length cut to 6 by the overrides
    assert "val/accuracy" in capsys.readouterr().out  # Lightning's results table


def test_validate_with_validation_switched_off_is_an_error_saying_what_to_pass(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="--trainer.limit_val_batches 1.0"):
        build_cli(["validate", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path)])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_validate_evaluates_a_checkpoint_folder_written_by_hf_checkpoint(kind, tiny_model_dir, tmp_path):
    if kind == "lora":
        pytest.importorskip("peft")
    grpo = GRPOLightningModule(
        model=str(tiny_model_dir),
        group_size=2,
        max_new_tokens=4,
        gradient_accumulation_steps=1,
        peft=LoraSettings(r=4, alpha=8) if kind == "lora" else None,
    )
    trainer(tmp_path, max_steps=1, callbacks=[HFCheckpoint(save_steps=0)]).fit(
        grpo, loader([{"prompt": "1 + 1 = ?", "reference": "2"}])
    )
    folder = tmp_path / "final"
    assert (folder / ("adapter_config.json" if kind == "lora" else "model.safetensors")).is_file()

    metrics = validate(folder, tmp_path / "val")
    assert VAL_KEYS <= metrics.keys()
