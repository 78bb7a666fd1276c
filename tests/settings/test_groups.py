"""The module's settings as typed groups (settings/groups/): each group checks its own fields with
the rules and messages of settings/checks.py, ``GRPOSettings.from_hparams`` gives back every flat
setting, a missing key takes the module's default, and below the module no function takes the
flat mapping."""

from __future__ import annotations

import ast
import inspect
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from helpers.settings import BAD

from forge_lightning.module import GRPOLightningModule
from forge_lightning.settings.checks import LOSS_FIELDS, RULES, loss_settings, validate_hparams
from forge_lightning.settings.groups import GROUPS, GRPOSettings, setting_name

PACKAGE = Path(__file__).resolve().parents[2] / "forge_lightning"
# The module's arguments that are objects, not settings of a group.
OBJECTS = ("model", "reward", "tokenizer", "peft", "tools", "environment_factory", "accuracy", "answer_key")
# GRPOConfig's own settings (compat.py), checked by RULES but none of the module's.
CONFIG_ONLY = {"num_train_epochs", "save_steps", "logging_steps"}
# Settings checked outside RULES, with the value each refuses and the other settings that reach
# the same check through validate_hparams.
OTHER_CHECKS = {
    "rollout_device": ("mps", {"rollout_mode": "async"}),
    "rollout_memory_fraction": (1.5, {"rollout_mode": "async"}),
}


def init_parameters() -> dict[str, inspect.Parameter]:
    return dict(list(inspect.signature(GRPOLightningModule.__init__).parameters.items())[1:])


def group_fields() -> list[tuple[str, str, str]]:
    """(group, field, setting) of every field of every group, the group by its GRPOSettings name."""
    return [(group, item.name, setting_name(item)) for group, kind in GROUPS.items() for item in fields(kind)]


def refusal(call) -> str:
    with pytest.raises(ValueError) as refused:
        call()
    return str(refused.value)


@pytest.mark.parametrize(
    ("group", "name", "setting"), [f for f in group_fields() if f[2] in BAD or f[2] in OTHER_CHECKS]
)
def test_a_group_refuses_a_value_out_of_range_as_validate_hparams_does(group, name, setting):
    value, context = OTHER_CHECKS.get(setting, (BAD.get(setting), {}))
    said = refusal(lambda: GROUPS[group](**{name: value}))
    assert setting in said
    assert said == refusal(lambda: validate_hparams({**context, setting: value}))


def test_every_rule_of_a_module_setting_belongs_to_a_group():
    settings = {setting for _, _, setting in group_fields()}
    assert set(RULES) - CONFIG_ONLY <= settings


def test_the_groups_and_the_loss_hold_every_setting_of_the_module_once_with_its_default_and_order():
    params = init_parameters()
    grouped = [setting for _, _, setting in group_fields()]
    assert len(grouped) == len(set(grouped))
    assert not set(grouped) & set(LOSS_FIELDS)
    old = {old.name: old.new for kind in GROUPS.values() for old in kind.old_names}
    assert old == {"behav_imp_weight_cap": "rollout_correction_cap"}
    assert set(params) == set(grouped) | set(LOSS_FIELDS) | set(OBJECTS) | set(old)
    for group, name, setting in group_fields():
        default = next(f.default for f in fields(GROUPS[group]) if f.name == name)
        assert default is not MISSING and default == params[setting].default, setting
    # The signature lists the settings by group, in GRPOSettings' order, the objects with theirs.
    loss = [name for name in LOSS_FIELDS if name not in grouped]
    with_objects = {"tools": ["tools", "environment_factory"], "validation": ["accuracy", "answer_key"]}
    order = ["model", "reward", "tokenizer", "peft"]
    for group in (f.name for f in fields(GRPOSettings)):
        order += loss if group == "loss" else [setting_name(f) for f in fields(GROUPS[group])]
        order += [] if group == "loss" else [old.name for old in GROUPS[group].old_names]
        order += with_objects.get(group, [])
    assert list(params) == order


# Settings off their defaults in every group, which validate_hparams takes together.
CHANGED = dict(
    sandbox_memory_mb=1024,
    sandbox_cpu_seconds=30,
    sandbox_workers=3,
    max_new_tokens=8,
    temperature=0.7,
    top_p=0.95,
    top_k=5,
    min_p=0.05,
    repetition_penalty=1.1,
    stop=["\n\n"],
    generation_kwargs={"renormalize_logits": True},
    max_prompt_length=32,
    prompt_truncation="error",
    use_chat_template=False,
    system_prompt="Be brief.",
    chat_template_kwargs={"enable_thinking": False},
    loss_type="dapo",
    clip_epsilon=0.1,
    clip_epsilon_high=0.3,
    kl_beta=0.0,
    importance_sampling_level="sequence",
    kl_estimator="k2",
    clip_ratio_c=2.5,
    sapo_temperature_pos=0.9,
    sapo_temperature_neg=1.2,
    entropy_coef=0.01,
    advantage_scale="batch",
    advantage_estimator="rloo",
    mask_truncated_completions=True,
    num_iterations=2,
    steps_per_generation=3,
    rollout_correction="truncate",
    rollout_correction_level="sequence",
    rollout_correction_cap=2.5,
    learning_rate=1e-3,
    weight_decay=0.1,
    gradient_accumulation_steps=1,
    max_grad_norm=0.5,
    warmup_steps=2,
    lr_schedule="constant",
    max_consecutive_bad_steps=5,
    max_sampling_rounds=2,
    vllm_gpu_memory_utilization=0.5,
    rollout_precision="int8",
    max_staleness=2,
    rollout_worker_threads=2,
    train_micro_batch_size=2,
    train_micro_batch_tokens=64,
    prefix_sharing=False,
    logprob_chunk_size=None,
    lm_head_chunk_size=None,
    gradient_checkpointing=True,
    model_dtype="auto",
    attn_implementation="eager",
    max_generation_tokens=4096,
    on_reward_error="zero",
    reward_timeout=30.0,
    max_tool_calls=2,
    tool_timeout=5.0,
    max_tool_result_chars=100,
    max_parallel_tool_calls=3,
    agent_timeout=30.0,
    val_num_generations=4,
    val_temperature=0.8,
    val_top_p=0.9,
    val_max_new_tokens=16,
    preflight=True,
    preflight_memory_gb=4.0,
)
# What the settings above exclude, each set changed in a module of its own.
CHANGED_TOO = {
    "tools": dict(dynamic_sampling=True, calculator="plain"),
    "agent": dict(agent="forge_lightning.examples.calculator_agent.agent"),
    "engine": dict(generation_backend="vllm", use_engine_logprobs=True),
    "async": dict(
        rollout_mode="async", rollout_device="cuda", rollout_memory_fraction=0.5, rollout_correction_cap=4.0
    ),
    "kl_in_reward": dict(
        kl_in_reward=True, kl_beta=0.05, advantage_estimator="reinforce_pp", advantage_scale="none"
    ),
}


@pytest.mark.parametrize(
    "changed", [{}, CHANGED, *CHANGED_TOO.values()], ids=["defaults", "changed", *CHANGED_TOO]
)
def test_from_hparams_of_a_module_gives_back_every_setting(module, changed):
    grpo = module(**changed)
    settings = GRPOSettings.from_hparams(grpo.hparams)
    assert grpo.settings == settings
    for group, name, setting in group_fields():
        value = getattr(getattr(settings, group), name)
        assert value == grpo.hparams[setting], setting
        if setting in changed:
            assert value == changed[setting], setting
    assert settings.loss == loss_settings(grpo.hparams)
    for name in LOSS_FIELDS:
        assert getattr(settings.loss, name) == grpo.hparams[name], name


def test_hparams_without_the_newer_settings_build_with_their_defaults():
    # An older checkpoint's hparams: none of the settings that came later (the code read these
    # with hp.get(..., default) before the groups).
    newer = (
        "min_p", "repetition_penalty", "stop", "generation_kwargs", "steps_per_generation",
        "rollout_correction", "rollout_correction_level", "rollout_correction_cap", "rollout_device",
        "rollout_memory_fraction", "max_generation_tokens", "max_prompt_length",
    )  # fmt: skip
    params = init_parameters()
    old = {name: p.default for name, p in params.items() if name not in (*OBJECTS, *newer)}
    old.update(group_size=4, learning_rate=1e-3, loss_type="dr_grpo", max_new_tokens=64)
    old.update(behav_imp_weight_cap=5.0)  # the async cap's former name, at its default then
    settings = GRPOSettings.from_hparams(old)
    assert (settings.sampling.group_size, settings.optimizer.learning_rate) == (4, 1e-3)
    assert (settings.loss.loss_type, settings.loss.max_completion_length) == ("dr_grpo", 64)
    assert settings.loss.behav_imp_weight_cap == 5.0 and settings.loss.rollout_correction == "mask"
    for group, name, setting in group_fields():
        if setting in newer:
            assert getattr(getattr(settings, group), name) == params[setting].default, setting
    assert GRPOSettings.from_hparams({}) == GRPOSettings.from_hparams(
        {name: p.default for name, p in params.items() if name not in OBJECTS}
    )


# The Lightning side: the module, its callbacks and the applications that drive a Trainer (the
# CLI, TRL's interface, and the benchmark, whose step timer is a Lightning callback). Below them a
# collaborator takes its settings group and plain values (run/fit.py's FitShape,
# training/context.py's StepContext), never the flat hyperparameters or the Trainer.
LIGHTNING_SIDE = ("module.py", "callbacks", "cli", "trl", "bench")
HIDDEN = {"hp", "hparams", "trainer"}


def lightning_parameters(root: Path = PACKAGE) -> list[str]:
    """``file:function(name)`` for each function or method of the package that takes a parameter
    named ``hp``, ``hparams`` or ``trainer`` outside the Lightning side."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.split("/")[0] in LIGHTNING_SIDE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p]
                found += [f"{relative}:{getattr(node, 'name', 'lambda')}({n})" for n in names if n in HIDDEN]
    return found


def test_below_the_lightning_side_no_function_takes_the_flat_hyperparameters_or_the_trainer():
    assert lightning_parameters() == []


def test_the_parameter_check_finds_hp_hparams_and_trainer_where_they_are_not_allowed(tmp_path):
    for relative, source in {
        "rollout/a.py": "def pick(model, hp):\n    return hp\n",
        "training/b.py": "class C:\n    def f(self, *, hparams=None):\n        pass\n",
        "evaluation/c.py": "def steps(trainer):\n    return trainer.max_steps\n",
        "module.py": "def g(hp, trainer):\n    pass\n",  # the module holds the flat mapping
        "callbacks/c.py": "def h(hparams, trainer):\n    pass\n",
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source)
    found = lightning_parameters(tmp_path)
    assert found == ["evaluation/c.py:steps(trainer)", "rollout/a.py:pick(hp)", "training/b.py:f(hparams)"]
