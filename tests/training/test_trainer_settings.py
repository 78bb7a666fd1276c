"""A Python Trainer's settings meet clear answers: Lightning's automatic clipping and accumulation
refused with the module's own, a schedule that says when it cannot know its length, a dry run that
writes no model files, and validation metrics on the optimizer step axis."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_lightning.callbacks import HFCheckpoint, ReferenceModel


@pytest.mark.integration
@pytest.mark.parametrize(
    ("setting", "pointer"),
    [
        ({"gradient_clip_val": 1.0}, "model.max_grad_norm"),
        ({"accumulate_grad_batches": 4}, "model.gradient_accumulation_steps"),
        ({"gradient_clip_algorithm": "value"}, "model.max_grad_norm"),
    ],
)
def test_a_python_trainer_with_automatic_settings_is_refused_before_the_model_loads(
    setting, pointer, tmp_path, module, trainer, loader, tiny_model_dir
):
    grpo = module(model=str(tiny_model_dir))
    with pytest.raises(ValueError, match=f"set {pointer} instead"):
        trainer(tmp_path, **setting).fit(grpo, loader([{"prompt": "q"}]))
    assert grpo.model is None  # refused before configure_model, before any rollout


@pytest.mark.integration
def test_a_schedule_sized_without_max_steps_under_max_time_warns(tmp_path, module, trainer, loader, count_a):
    fit = trainer(tmp_path, max_time="00:00:10:00", max_epochs=3)
    with pytest.warns(UserWarning, match="max_time is set but trainer.max_steps is not"):
        fit.fit(module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0), loader([{"prompt": "q"}]))


@pytest.mark.integration
def test_fast_dev_run_writes_no_model_files(tmp_path, module, trainer, loader, count_a):
    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.1)
    fit = trainer(tmp_path, fast_dev_run=True, callbacks=[ReferenceModel(), HFCheckpoint(save_steps=1)])
    fit.fit(grpo, loader([{"prompt": "q"}] * 2))
    assert fit.global_step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.integration
def test_validation_metrics_reach_loggers_on_the_optimizer_step_axis(
    tmp_path, module, trainer, loader, count_a
):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    grpo = module(reward=count_a, gradient_accumulation_steps=2, kl_beta=0.0)
    logger = CSVLogger(tmp_path, name="csv")
    fit = trainer(tmp_path, logger=logger, limit_val_batches=1.0, num_sanity_val_steps=0, log_every_n_steps=1)
    records = [{"prompt": "q", "reference": "1"}] * 4  # 4 batches, 2 optimizer steps
    fit.fit(grpo, loader(records), loader(records[:2], batch_size=2))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    train_steps = sorted({int(float(r["step"])) for r in rows if r.get("train/reward")})
    val_steps = [int(float(r["step"])) for r in rows if r.get("val/accuracy")]
    assert train_steps == [1, 2]
    assert val_steps == [2]  # at the epoch's end: optimizer step 2, not batch 3
    assert "val/accuracy" in fit.callback_metrics
