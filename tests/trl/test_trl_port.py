"""A realistic TRL GRPO script (its own batch shape, several weighted rewards reading a dataset
column, a tool, LoRA, a transformers callback, an eval set) ports with only its import changed."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from forge_lightning.testing import tiny_policy
from forge_lightning.trl import GRPOConfig, GRPOTrainer


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name.
        unit: The temperature unit, celsius or fahrenheit.
    """
    return f"It is 21 degrees {unit} in {city}."


def mentions_answer(completions, answer, **kwargs):
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [-len(c[-1]["content"]) / 8 for c in completions]


class CountSteps(TrainerCallback):
    def __init__(self):
        self.steps, self.logs = [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(logs)


def rows(n: int) -> Dataset:
    cities = ["Paris", "Oslo", "Lima", "Rome", "Cairo", "Quito"]
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Weather in {city}?"}], "answer": city}
            for city in cities[:n]
        ]
    )


@pytest.mark.integration
def test_a_realistic_trl_script_ports_with_only_its_import_changed(tmp_path):
    policy = tiny_policy()
    before = {n: p.clone() for n, p in policy.model.named_parameters()}
    counter = CountSteps()
    # -- the script, as written for TRL (its import line aside) --
    training_args = GRPOConfig(
        output_dir=str(tmp_path / "weather-grpo"),
        num_generations=4,
        per_device_train_batch_size=8,  # completions: 2 prompts a micro-batch
        gradient_accumulation_steps=2,
        max_completion_length=16,
        beta=0.04,
        learning_rate=1e-3,
        temperature=0.9,
        reward_weights=[1.0, 0.5],
        max_steps=2,
        logging_steps=1,
        save_steps=1,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        bf16=False,
        report_to="tensorboard",
        seed=7,
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=[mentions_answer, short],
        args=training_args,
        train_dataset=rows(4),
        eval_dataset=rows(6).select([4, 5]),
        processing_class=policy.tokenizer,
        peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
        tools=[get_weather],
        callbacks=[counter],
    )
    result = trainer.train()
    # -- what it did --
    assert result.global_step == 2 and counter.steps == [1, 2]
    settings = trainer.module.hparams
    assert (settings.group_size, settings.kl_beta, settings.max_new_tokens) == (4, 0.04, 16)
    # 2 micro-batches of 8 completions a step, one generation a step (TRL's default): 4 prompts a
    # batch, one batch a step, a forward/backward per 8 completions
    assert trainer.datamodule.prompts_per_step == 4 and settings.steps_per_generation == 1
    assert (settings.gradient_accumulation_steps, settings.train_micro_batch_size) == (1, 8)
    assert settings.tools == ["test_trl_port.get_weather"]
    assert settings.peft["r"] == 8 and settings.peft["target_modules"] == ["q_proj", "v_proj"]
    assert settings.reward["init_args"]["rewards_and_weights"] == [
        ["test_trl_port.mentions_answer", 1.0],
        ["test_trl_port.short", 0.5],
    ]
    assert [entry["step"] for entry in trainer.state.log_history] == [1, 2]
    assert {"reward", "kl", "loss"} <= set(counter.logs[0])
    assert "val/reward" in trainer.trainer.callback_metrics  # the eval set, at step 2
    run = tmp_path / "weather-grpo"
    assert sorted(p.name for p in run.iterdir() if p.name.isdigit()) == ["2"]  # save_total_limit=1
    assert json.loads((run / "final" / "adapter_config.json").read_text())["r"] == 8
    assert (run / "checkpoints" / "last.ckpt").is_file() and any((run / "tensorboard").iterdir())
    changed = [n for n, p in trainer.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert changed  # the adapter trained (lora_B starts at zero)
    base = {unwrapped(n): p for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert base.keys() == before.keys()
    assert all(torch.equal(before[n], base[n]) for n in before)  # the base weights did not


def unwrapped(name: str) -> str:
    """A PEFT model's parameter name as the plain model names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")
