"""The Forge quickstart runs with only its import changed."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning import ExactMatchReward, GRPOConfig, GRPOTrainer
from forge_lightning.rewards.library import BaseReward, RewardOutput


@pytest.mark.integration
def test_forge_quickstart_trains_and_writes_its_outputs(tmp_path):
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    dataset = [
        {"prompt": "What is 2 + 2? Answer:", "reference": "4"},
        {"prompt": "What is 10 - 3? Answer:", "reference": "7"},
    ]
    trainer = GRPOTrainer(
        model=model,
        tokenizer=tokenizer,
        reward_fn=ExactMatchReward(),
        config=GRPOConfig(
            group_size=4,
            num_train_epochs=1,
            max_new_tokens=8,
            gradient_accumulation_steps=1,
            learning_rate=1e-2,
            logging_steps=1,
            output_dir=str(tmp_path / "forge_output"),
        ),
        enable_progress_bar=False,
    )
    trainer.train(dataset)
    out = tmp_path / "forge_output"
    assert trainer.trainer.global_step == 2
    assert (out / "final" / "config.json").is_file()
    assert len((out / "training_log.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "training_log.jsonl").read_text().splitlines()[0])["step"] == 1
    assert trainer.module.hparams.loss_type == "forge"


@pytest.mark.integration
def test_seed_style_custom_reward_without_kwargs_trains(tmp_path):
    class MyReward(BaseReward):
        def __call__(self, prompts, responses) -> RewardOutput:
            # distinct characters: varies within a group, so advantages are non-zero
            return RewardOutput(scores=[len(set(r)) / 4 for r in responses])

    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    before = [p.clone() for p in model.parameters()]
    trainer = GRPOTrainer(
        model,
        tokenizer,
        MyReward(),
        GRPOConfig(
            group_size=4,
            num_train_epochs=1,
            max_new_tokens=4,
            gradient_accumulation_steps=1,
            learning_rate=1e-2,
            output_dir=str(tmp_path),
        ),
        enable_progress_bar=False,
    )
    trainer.train([{"prompt": "hi", "reference": "x"}])
    assert (tmp_path / "final").is_dir()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_config_defaults_are_forges():
    cfg = GRPOConfig()
    assert (cfg.group_size, cfg.clip_epsilon, cfg.kl_beta, cfg.temperature) == (8, 0.2, 0.01, 0.9)
    assert (cfg.max_new_tokens, cfg.learning_rate, cfg.gradient_accumulation_steps) == (512, 5e-6, 4)
    assert (cfg.num_train_epochs, cfg.save_steps, cfg.logging_steps, cfg.seed) == (3, 100, 10, 42)
    assert cfg.output_dir == "forge_output"
