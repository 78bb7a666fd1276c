"""The CLI as a Lightning user reaches for it: only the subcommands that work, the module's own
settings named where Lightning's automatic ones do not apply, and any LightningDataModule as --data."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from forge_lightning.cli.forge_cli import build_cli

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_the_cli_offers_no_subcommand_without_a_step(subcommand, capsys):
    with pytest.raises(SystemExit) as stopped:
        build_cli([subcommand, "--config", str(SMOKE)])
    assert stopped.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.parametrize(
    ("flag", "pointer"),
    [
        ("--trainer.gradient_clip_val=1.0", "model.max_grad_norm"),
        ("--trainer.accumulate_grad_batches=4", "model.gradient_accumulation_steps"),
        ("--trainer.gradient_clip_algorithm=value", "model.max_grad_norm"),
    ],
)
def test_lightnings_automatic_settings_point_to_the_modules_own(
    flag, pointer, tmp_path, tiny_model_dir, tiny_overrides
):
    args = ["fit", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path / "run"), flag]
    with pytest.raises(SystemExit, match=f"set {pointer} instead"):
        build_cli(args)
    assert not (tmp_path / "run" / "training_log.jsonl").exists()


class OwnData(pl.LightningDataModule):
    """A user's own datamodule, as the CLI's --data takes it."""

    def __init__(self, copies: int = 2) -> None:
        super().__init__()
        self.copies = copies

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        from forge_lightning.data.datamodule import collate_records

        return DataLoader(
            [{"prompt": "q", "reference": "1"}] * self.copies, batch_size=1, collate_fn=collate_records
        )


@pytest.mark.integration
def test_the_cli_takes_any_lightning_datamodule(tmp_path, tiny_model_dir, tiny_overrides):
    args = ["fit", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path / "run")]
    cli = build_cli(
        [*args, "--data", "test_lightning_cli.OwnData", "--data.copies", "3", "--trainer.max_steps=3"]
    )
    assert isinstance(cli.datamodule, OwnData) and cli.trainer.global_step == 3
    plain = build_cli(
        [*args[1:3], *tiny_overrides(tiny_model_dir, tmp_path / "other"), "--data.source=mock"], run=False
    )
    assert type(plain.datamodule).__name__ == "PromptDataModule"  # the default, no class_path needed
