"""A Lightning user's habits meet clear answers: only the subcommands that work, the module's own
settings named where Lightning's automatic ones do not apply, a schedule that says when it cannot
know its length, TRL's list of rewards, and a dry run that writes no model files."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_lightning.callbacks import HFCheckpoint, ReferenceModel
from forge_lightning.cli import build_cli
from forge_lightning.rewards import CompositeReward

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_the_cli_offers_no_subcommand_without_a_step(subcommand, capsys):
    with pytest.raises(SystemExit) as stopped:
        build_cli([subcommand, "--config", str(SMOKE)])
    assert stopped.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "pointer"),
    [
        ("--trainer.gradient_clip_val=1.0", "model.max_grad_norm"),
        ("--trainer.accumulate_grad_batches=4", "model.gradient_accumulation_steps"),
    ],
)
def test_lightnings_automatic_settings_point_to_the_modules_own(
    flag, pointer, tmp_path, tiny_model_dir, tiny_overrides
):
    args = ["fit", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path / "run"), flag]
    with pytest.raises(SystemExit, match=f"set {pointer} instead"):
        build_cli(args)
    assert not (tmp_path / "run" / "training_log.jsonl").exists()


def test_a_schedule_sized_without_max_steps_under_max_time_warns(tmp_path, module, trainer, loader, count_a):
    fit = trainer(tmp_path, max_time="00:00:10:00", max_epochs=3)
    with pytest.warns(UserWarning, match="max_time is set but trainer.max_steps is not"):
        fit.fit(module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0), loader([{"prompt": "q"}]))


def test_a_list_of_rewards_is_their_composite_and_anything_else_is_refused_at_once(module):
    def short(prompts, responses):
        return [1.0 / (1 + len(r)) for r in responses]

    def has_a(prompts, responses):
        return [float("a" in r) for r in responses]

    grpo = module(reward=[short, (has_a, 3.0, "a")])
    assert isinstance(grpo.reward, CompositeReward)
    assert grpo.reward.names == ["short", "a"]
    assert "rewards/a" in grpo.train_metrics.means  # each component gets its curve
    with pytest.raises(TypeError, match="reward must be a callable"):
        module(reward="not a function")


def test_fast_dev_run_writes_no_model_files(tmp_path, module, trainer, loader, count_a):
    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.1)
    fit = trainer(tmp_path, fast_dev_run=True, callbacks=[ReferenceModel(), HFCheckpoint(save_steps=1)])
    fit.fit(grpo, loader([{"prompt": "q"}] * 2))
    assert fit.global_step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_validation_metrics_reach_loggers_on_the_optimizer_step_axis(
    tmp_path, module, trainer, loader, count_a
):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    grpo = module(reward=count_a, gradient_accumulation_steps=2, kl_beta=0.0)
    logger = CSVLogger(tmp_path, name="csv")
    fit = trainer(tmp_path, logger=logger, limit_val_batches=1.0, num_sanity_val_steps=0)
    records = [{"prompt": "q", "reference": "1"}] * 4  # 4 batches, 2 optimizer steps
    fit.fit(grpo, loader(records), loader(records[:2], batch_size=2))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    train_steps = sorted({int(r["step"]) for r in rows if r.get("train/reward")})
    val_steps = [int(r["step"]) for r in rows if r.get("val/accuracy")]
    assert train_steps == [1, 2]
    assert val_steps == [2]  # at the epoch's end: optimizer step 2, not batch 3
    assert "val/accuracy" in fit.callback_metrics
