"""Lightning's entry points as a Lightning user calls them: ModelCheckpoint's file names beside a
validation, ``trainer.predict`` and ``trainer.test``, the module called before its model is
loaded, and ``fast_dev_run`` writing nothing."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from forge_lightning.callbacks import RewardLogger
from forge_lightning.data import PromptDataModule
from forge_lightning.module import GRPOLightningModule

RECORDS = [
    {"prompt": "q", "reference": "1"},
    {"prompt": "ab", "reference": "2"},
    {"prompt": "c", "reference": "3"},
]


@pytest.mark.integration
def test_checkpoint_files_are_named_for_the_step_they_hold_when_validating_mid_run(
    tmp_path, module, trainer, loader
):
    grpo = module(gradient_accumulation_steps=1, kl_beta=0.0, max_new_tokens=4)
    logger = CSVLogger(tmp_path, name="csv")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    fit = trainer(
        tmp_path,
        max_steps=3,
        logger=logger,
        callbacks=[ckpt],
        enable_checkpointing=True,
        val_check_interval=1,  # a validation after every batch, so before each later checkpoint
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    fit.fit(grpo, loader(RECORDS), loader(RECORDS[:1]))
    held = {p.name: torch.load(p, weights_only=True)["global_step"] for p in (tmp_path / "ckpt").iterdir()}
    assert held == {f"epoch=0-step={step}.ckpt": step for step in (1, 2, 3)}
    assert "step" not in fit.callback_metrics and "val/reward" in fit.callback_metrics
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("val/reward")] == [1, 2, 3]  # the optimizer step


@pytest.mark.integration
@pytest.mark.parametrize("save_last", [None, True])
def test_the_end_message_names_a_checkpoint_a_resume_finds(
    save_last, tmp_path, module, trainer, loader, capsys
):
    grpo = module(gradient_accumulation_steps=1, kl_beta=0.0, max_new_tokens=4)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_last=save_last
    )  # Lightning's default, or save_last
    fit = trainer(
        tmp_path, max_steps=2, callbacks=[ckpt, RewardLogger(logging_steps=1)], enable_checkpointing=True
    )
    fit.fit(grpo, loader(RECORDS))
    summary = capsys.readouterr().out.split("Training finished at step 2.")[1]
    if save_last:
        assert f"checkpoints  {tmp_path / 'ckpt'}  (resume with --ckpt_path last)" in summary
        assert (tmp_path / "ckpt" / "last.ckpt").is_file()
        return
    assert not (tmp_path / "ckpt" / "last.ckpt").exists() and "--ckpt_path last" not in summary
    named = re.search(r"ckpt_path=(\S+);", summary).group(1)
    assert torch.load(named, weights_only=True)["global_step"] == 2  # the newest, which exists


@pytest.mark.integration
def test_predict_returns_each_prompts_greedy_completion(tmp_path, module, trainer, loader):
    grpo = module(max_new_tokens=4)
    batches = trainer(tmp_path).predict(grpo, loader(RECORDS, batch_size=2))
    assert [len(batch) for batch in batches] == [2, 1]
    trainer(tmp_path).validate(grpo, loader(RECORDS, batch_size=2))
    # Greedy: the completions validation scores.
    assert [c for batch in batches for c in batch] == [s["completion"] for s in grpo.validation_samples]


@pytest.mark.integration
def test_predict_with_the_datamodule_completes_its_validation_prompts(tmp_path, module, trainer):
    grpo = module(max_new_tokens=4)
    data = PromptDataModule(source="mock", val_max_samples=3, val_batch_size=2)
    batches = trainer(tmp_path).predict(grpo, datamodule=data)
    assert [len(batch) for batch in batches] == [2, 1]  # the validation prompts, val_batch_size a batch
    trainer(tmp_path).validate(grpo, datamodule=data)
    assert [c for batch in batches for c in batch] == [s["completion"] for s in grpo.validation_samples]


@pytest.mark.integration
@pytest.mark.parametrize("data", ["dataloader", "datamodule"])
def test_trainer_test_is_refused_pointing_to_validate_and_predict(data, tmp_path, module, trainer, loader):
    given = (
        {"dataloaders": loader(RECORDS)}
        if data == "dataloader"
        else {"datamodule": PromptDataModule(source="mock")}
    )
    with pytest.raises(NotImplementedError, match="no test step: evaluate with trainer.validate"):
        trainer(tmp_path).test(module(), **given)


def test_calling_the_module_before_its_model_is_loaded_says_what_to_call(tiny_model_dir):
    grpo = GRPOLightningModule(model=str(tiny_model_dir), group_size=2)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(RuntimeError, match=r"not loaded yet: call configure_model\(\) first"):
        grpo(ids)
    grpo.configure_model()
    assert grpo(ids).shape[:2] == (1, 3)


@pytest.mark.integration
def test_fast_dev_run_writes_no_training_log_and_no_validation_answers(
    tmp_path, module, trainer, loader, capsys
):
    fit = trainer(tmp_path, fast_dev_run=True, callbacks=[RewardLogger(logging_steps=1)])
    fit.fit(
        module(gradient_accumulation_steps=1, kl_beta=0.0, max_new_tokens=4), loader(RECORDS), loader(RECORDS)
    )
    assert fit.global_step == 1
    assert sorted(tmp_path.iterdir()) == []
    assert "validation at step 1 | accuracy" in capsys.readouterr().out  # still said, not written
