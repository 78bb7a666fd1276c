"""Gradient checkpointing and bf16 mixed precision with generation inside the step, on CPU."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from forge_lightning.models.hf_compat import is_checkpointing
from forge_lightning.models.lora import LoraSettings

pytestmark = pytest.mark.integration  # every test here builds a Trainer or starts a process


def distinct_chars(prompts: list[str], responses: list[str]) -> list[float]:
    """Scores that differ within a group, so the step has a gradient to take."""
    return [float(len(set(r))) for r in responses]


@pytest.mark.parametrize(
    ("checkpointing", "precision", "lora"),
    [(True, "32-true", False), (False, "bf16-mixed", False), (True, "bf16-mixed", True)],
    ids=["checkpointing", "bf16-mixed", "lora-checkpointing-bf16"],
)
def test_one_step_trains_with_checkpointing_and_mixed_precision(
    checkpointing, precision, lora, tmp_path, module, trainer, loader
):
    if lora:
        pytest.importorskip("peft")
    pl.seed_everything(0)
    grpo = module(
        reward=distinct_chars,
        gradient_checkpointing=checkpointing,
        gradient_accumulation_steps=1,
        peft=LoraSettings(r=4, alpha=8, dropout=0.0) if lora else None,
    )
    grpo.configure_model()
    trained = {n: p.detach().clone() for n, p in grpo.model.named_parameters() if p.requires_grad}
    fit = trainer(tmp_path, max_steps=1, precision=precision)
    fit.fit(grpo, loader([{"prompt": "ab"}, {"prompt": "cd"}]))

    assert fit.global_step == 1 and math.isfinite(grpo.last_step.metrics["train/loss"])
    assert is_checkpointing(grpo.model) == checkpointing  # restored after each generate
    after = dict(grpo.model.named_parameters())
    assert any(not torch.equal(after[n], before) for n, before in trained.items())
    assert all(p.dtype == torch.float32 for p in after.values())  # mixed precision keeps fp32 weights
