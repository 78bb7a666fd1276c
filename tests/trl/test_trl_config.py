"""TRL's GRPOConfig on the TRL route: TRL's names and defaults, every TRL name taken or refused by
name with the reason, and the conversion of TRL's batch (completions) to this package's (prompts)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from transformers import TrainingArguments
from transformers.utils import get_json_schema

from forge_lightning.module import GRPOLightningModule
from forge_lightning.run.specs import import_path
from forge_lightning.settings.trl_names import (
    TRANSFORMERS_4_NAMES,
    TRL_CONFIG_NAMES,
    TRL_DEFAULTS,
    TRL_NAMES,
    TRL_TRAINER_NAMES,
)
from forge_lightning.trl import GRPOConfig, GRPOTrainer
from forge_lightning.trl.lightning import precision
from forge_lightning.trl.script import by_path
from forge_lightning.trl.settings import (
    BatchShape,
    batch_shape,
    module_settings,
    optimizer_steps,
    steps,
)
from forge_lightning.trl.unsupported import NO_COUNTERPART, NO_EFFECT

FIELDS = [f.name for f in dataclasses.fields(GRPOConfig)]


def test_the_defaults_are_trls():
    c = GRPOConfig()
    assert (c.num_generations, c.max_completion_length, c.beta, c.loss_type) == (8, 512, 0.0, "dapo")
    assert (c.learning_rate, c.temperature, c.lr_scheduler_type, c.gradient_checkpointing) == (
        1e-6,
        1.0,
        "linear",
        True,
    )
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.num_train_epochs) == (8, 1, 3.0)
    assert (c.logging_steps, c.save_steps, c.seed, c.report_to, c.eval_strategy) == (10, 500, 42, [], "no")
    # The defaults the table of TRL names records (checked there against TRL's own GRPOConfig).
    for name, trl_default, _, _ in TRL_DEFAULTS:
        assert getattr(c, name) == trl_default, name


def test_every_trl_name_is_a_field_a_name_without_counterpart_or_an_argument_of_the_trainer():
    names = {*TRL_CONFIG_NAMES, *TRANSFORMERS_4_NAMES}
    assert sorted(names - set(FIELDS) - set(NO_COUNTERPART)) == []
    assert set(TRL_TRAINER_NAMES) <= set(inspect.signature(GRPOTrainer.__init__).parameters)


def test_every_field_is_trls_or_transformers_own():
    trl = {*TRL_NAMES, *inspect.signature(GRPOLightningModule.__init__).parameters}
    transformers = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert sorted(set(FIELDS) - trl - transformers) == []


def other(value):
    """A value unlike ``value``, of its kind."""
    if value is None:
        return 1
    if isinstance(value, bool):
        return not value
    return value + 1 if isinstance(value, (int, float)) else f"{value}-other"


@pytest.mark.parametrize("name", sorted(NO_COUNTERPART))
def test_a_name_without_counterpart_is_taken_at_trls_default_and_refused_otherwise(name):
    default, why = NO_COUNTERPART[name]
    GRPOConfig(**{name: default})
    with pytest.raises(ValueError) as refused:
        GRPOConfig(**{name: other(default)})
    assert str(refused.value).startswith(f"GRPOConfig({name}={other(default)!r}) is refused: {why}.")


def test_a_name_that_does_nothing_in_transformers_is_taken_at_any_value():
    GRPOConfig(**{name: True for name in NO_EFFECT})


def test_other_names_are_refused_by_what_they_are():
    with pytest.raises(TypeError, match="TrainingArguments field 'label_smoothing_factor' has no meaning"):
        GRPOConfig(label_smoothing_factor=0.1)
    with pytest.raises(TypeError, match="did you mean 'num_generations'"):
        GRPOConfig(num_generatons=4)
    with pytest.raises(TypeError, match="neither TRL's GRPOConfig nor this route has it"):
        GRPOConfig(group_size=4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loss_type": "bnpo"}, r"loss_type='bnpo'\) is refused: bnpo"),
        ({"scale_rewards": "mean"}, r"scale_rewards='mean'\) is refused: this route takes one of"),
        ({"lr_scheduler_type": "polynomial"}, r"lr_scheduler_type='polynomial'\) is refused"),
        ({"report_to": ["wandb", "trackio"]}, r"is refused for \['trackio'\]"),
        ({"model_init_kwargs": {"load_in_4bit": True}}, r"refused for \['load_in_4bit'\]"),
        ({"num_train_epochs": 1.5}, "Lightning trains whole epochs"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "can not be both configured"),
        ({"num_generations": 1}, "2 or more completions per prompt"),
    ],
)
def test_a_value_without_a_meaning_here_is_refused_naming_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**settings)


def test_scale_rewards_takes_trls_booleans():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


@pytest.mark.parametrize(
    ("settings", "world", "shape"),
    [
        ({}, 1, BatchShape(1, 1, 1, 8)),  # TRL's defaults: one prompt's 8 completions a step
        ({"num_generations": 4, "gradient_accumulation_steps": 2}, 1, BatchShape(4, 1, 1, 8)),
        ({"per_device_train_batch_size": 4, "steps_per_generation": 4}, 1, BatchShape(2, 1, 4, 4)),
        ({"gradient_accumulation_steps": 4, "steps_per_generation": 1}, 1, BatchShape(1, 4, 1, 8)),
        ({"generation_batch_size": 32}, 1, BatchShape(4, 1, 4, 8)),
        ({"generation_batch_size": 32}, 2, BatchShape(2, 1, 2, 8)),
    ],
)
def test_trls_batch_in_completions_becomes_prompts_steps_and_micro_batches(settings, world, shape):
    assert batch_shape(GRPOConfig(**settings), world) == shape


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"per_device_train_batch_size": 6, "num_generations": 4}, 1, "divisible by num_generations"),
        ({"per_device_train_batch_size": 4}, 2, "a prompt's group stays on one device"),
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, 1, "must divide one another"),
        ({"generation_batch_size": 12}, 1, "divisible by the global batch size"),
    ],
)
def test_a_batch_this_package_cannot_shape_is_refused(settings, world, message):
    with pytest.raises(ValueError, match=message):
        batch_shape(GRPOConfig(**settings), world)


def test_the_schedules_length_is_the_step_plans():
    c = GRPOConfig(per_device_train_batch_size=16)  # 2 prompts a step
    shape = batch_shape(c, 1)
    assert optimizer_steps(c, shape, train_size=9, world_size=1) == 15  # 5 steps an epoch, 3 epochs
    c = GRPOConfig(per_device_train_batch_size=4, steps_per_generation=4, max_steps=7)
    assert optimizer_steps(c, batch_shape(c, 1), train_size=9, world_size=1) == 7
    assert (steps(10, 200), steps(0.1, 205), steps(0, 200)) == (10, 21, 0)


def test_the_module_gets_trls_settings_under_their_names_here():
    c = GRPOConfig(beta=0.04, epsilon_high=0.28, scale_rewards=False, min_p=None, warmup_ratio=0.1)
    settings = module_settings(c, batch_shape(c, 1), total_steps=25, evaluates=False)
    assert set(settings) <= set(inspect.signature(GRPOLightningModule.__init__).parameters)
    assert (settings["kl_beta"], settings["clip_epsilon_high"]) == (0.04, 0.28)
    assert settings["advantage_scale"] == "none"
    assert (settings["min_p"], settings["warmup_steps"], settings["lr_schedule"]) == (0.0, 3, "linear")
    assert settings["max_tool_calls"] == settings["max_new_tokens"] == 512  # TRL's None: no limit
    assert settings["generation_backend"] == "hf" and "rollout_correction" not in settings
    assert (settings["model_dtype"], settings["prefix_sharing"]) == ("float32", False)


def test_vllm_and_its_correction_dtype_and_a_constant_schedule_translate():
    c = GRPOConfig(
        use_vllm=True,
        vllm_importance_sampling_mode="token_truncate",
        model_init_kwargs={"dtype": torch.bfloat16, "attn_implementation": "sdpa"},
        lr_scheduler_type="constant",
        warmup_steps=5,
        num_generations_eval=2,
    )
    settings = module_settings(c, batch_shape(c, 1), total_steps=25, evaluates=True)
    assert settings["generation_backend"] == "vllm"
    assert (settings["rollout_correction"], settings["rollout_correction_level"]) == ("truncate", "token")
    assert settings["rollout_correction_cap"] == 3.0
    assert (settings["model_dtype"], settings["attn_implementation"]) == ("bfloat16", "sdpa")
    assert (settings["lr_schedule"], settings["warmup_steps"]) == ("constant", 0)  # transformers' has none
    assert (settings["val_num_generations"], settings["val_temperature"]) == (2, 1.0)


def test_precision_is_trls_bf16_where_transformers_allows_it():
    assert precision(GRPOConfig(fp16=True)) == "16-mixed"
    assert precision(GRPOConfig(bf16=True)) == "bf16-mixed"
    assert precision(GRPOConfig(use_cpu=True)) == "bf16-mixed"
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert precision(GRPOConfig()) == ("bf16-mixed" if bf16 else "32-true")


SCRIPT = '''
def lookup(term: str, limit: int = 3) -> str:
    """Look a term up.

    Args:
        term: What to look up.
        limit: How many results.
    """
    return f"{term}:{limit}"

class Board:
    def reset(self, **row):
        return None

    def place(self, square: str) -> str:
        """Place a piece.

        Args:
            square: Where.
        """
        return square
'''


def test_a_scripts_own_functions_and_classes_get_a_path_of_the_trl_route():
    ran = {"__name__": "__main__"}
    exec(compile(SCRIPT, "script.py", "exec"), ran)
    lookup, board = by_path(ran["lookup"]), by_path(ran["Board"])
    assert import_path(lookup) == "forge_lightning.trl.script.lookup"
    assert import_path(board) == "forge_lightning.trl.script.Board"
    assert inspect.signature(lookup) == inspect.signature(ran["lookup"])
    assert get_json_schema(lookup) == get_json_schema(ran["lookup"])
    assert lookup("cats", limit=2) == "cats:2" and issubclass(board, ran["Board"])
    assert by_path(math.floor) is math.floor  # importable already
    never = lambda x: x  # noqa: E731
    assert by_path(never) is never  # no path to give: the module refuses it by name
    with pytest.raises(AttributeError, match="this process did not run it"):
        from forge_lightning.trl import script

        script.never_registered  # noqa: B018
