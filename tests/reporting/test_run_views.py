"""What a CLI run shows while it trains: the TensorBoard views and the progress bar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress import rich_progress
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.cli.progress import default_progress_bar


def run_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    """A run of the tiny model with a TensorBoard logger and a RewardLogger reporting every step."""
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 2,
            "limit_val_batches": 0,
            "enable_checkpointing": False,
            "default_root_dir": str(out),
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(out), "name": "tensorboard"},
            },
            "callbacks": [
                {"class_path": "forge_lightning.callbacks.RewardLogger", "init_args": {"logging_steps": 1}}
            ],
        },
        "model": {
            "model": str(model_dir),
            "group_size": 4,
            "max_new_tokens": 6,
            "gradient_accumulation_steps": 1,
        },
        "data": {"source": "mock", "prompts_per_step": 1},
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return ["--config", str(path), *extra]


@pytest.mark.integration
def test_tensorboard_gets_scalars_reward_histogram_and_samples(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    build_cli(["fit", *run_args(tiny_model_dir, out, "--trainer.enable_progress_bar=false")])
    events = EventAccumulator(
        str(next(out.rglob("events.out.tfevents*")).parent), size_guidance={"histograms": 0, "tensors": 0}
    )
    events.Reload()
    tags = events.Tags()
    expected_scalars = {
        "train/reward",
        "train/reward_std",
        "train/frac_zero_std_groups",
        "train/rewards/GSM8KAnswerReward",
        "train/clip_fraction",
        "train/completion_length",
        "train/lr",
        "train/grad_norm",
        "train/kl",
        "perf/tokens_per_s",
    }
    assert expected_scalars <= set(tags["scalars"])
    assert [e.step for e in events.Scalars("train/frac_zero_std_groups")] == [1, 2]

    assert "train/reward_hist" in tags["histograms"]
    histograms = events.Histograms("train/reward_hist")
    assert [h.step for h in histograms] == [1, 2]
    # One report per step, each over that step's rollout: 1 prompt x group_size 4 rewards.
    assert all(h.histogram_value.num == 4 for h in histograms)
    lengths = events.Histograms("train/completion_length_hist")
    assert [h.step for h in lengths] == [1, 2] and all(h.histogram_value.num == 4 for h in lengths)
    assert "train/entropy" in tags["scalars"]

    assert "samples/text_summary" in tags["tensors"]
    table = events.Tensors("samples/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| prompt | completion | reward |")


@pytest.mark.integration
def test_cli_trainer_uses_rich_progress_bar_when_rich_imports(tiny_model_dir, tmp_path):
    pytest.importorskip("rich")
    cli = build_cli(run_args(tiny_model_dir, tmp_path / "run"), run=False)
    assert isinstance(cli.trainer.progress_bar_callback, RichProgressBar)
    assert sum(isinstance(c, ProgressBar) for c in cli.trainer.callbacks) == 1


@pytest.mark.integration
def test_disabled_progress_bar_stays_disabled(tiny_model_dir, tmp_path):
    cli = build_cli(
        run_args(tiny_model_dir, tmp_path / "run", "--trainer.enable_progress_bar=false"), run=False
    )
    assert cli.trainer.progress_bar_callback is None


def test_progress_bar_falls_back_to_tqdm_without_rich(monkeypatch):
    monkeypatch.setattr(rich_progress, "_RICH_AVAILABLE", False)
    assert isinstance(default_progress_bar(), TQDMProgressBar)


@pytest.mark.integration
def test_wandb_gets_histograms_and_a_samples_table_with_each_reward_component(
    tmp_path, module, trainer, loader, monkeypatch
):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from forge_lightning.callbacks import RewardLogger

    def count_a(prompts, responses):
        return [float(r.count("a")) for r in responses]

    def length(prompts, responses):
        return [len(r) / 10 for r in responses]

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), project="forge-test", offline=True)
    sent: list[tuple[int, dict]] = []
    log_metrics = logger.log_metrics

    def spy(metrics, step=None):
        sent.append((step, metrics))
        log_metrics(metrics, step)

    monkeypatch.setattr(logger, "log_metrics", spy)
    grpo = module(reward=[(count_a, 1.0, "a"), (length, 1.0, "length")], gradient_accumulation_steps=1)
    fit = trainer(tmp_path, max_steps=2, logger=logger, callbacks=[RewardLogger(logging_steps=1)])
    fit.fit(grpo, loader([{"prompt": "q"}] * 2))
    logger.experiment.finish()

    hists = [(step, m) for step, m in sent if "train/reward_hist" in m]
    assert [step for step, _ in hists] == [1, 2]
    assert all(type(m["train/completion_length_hist"]).__name__ == "Histogram" for _, m in hists)
    tables = sorted(tmp_path.rglob("files/media/table/samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "a", "length"]
    assert len(table["data"]) == 4  # group_size 4 samples of the step's one prompt
    prompt, completion, total, a, length_score = table["data"][0]
    assert a == completion.count("a") and length_score == pytest.approx(len(completion) / 10)
