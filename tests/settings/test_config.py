"""Each setting is checked once, in one place, and the error names the field and its range.

The module, the Forge-style GRPOConfig and the callbacks all use these checks; a test per layer
below shows each one reaches them.
"""

from __future__ import annotations

import pytest
from helpers.settings import BAD

from forge_lightning import GRPOConfig, HFCheckpoint, RewardLogger
from forge_lightning.settings.checks import LOSS_FIELDS, RULES, validate_hparams


def test_every_checked_field_has_a_bad_value_here():
    assert set(BAD) == set(RULES) | set(LOSS_FIELDS)


@pytest.mark.parametrize(("field", "value"), sorted(BAD.items()))
def test_a_value_out_of_range_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        validate_hparams({field: value})


def test_a_boolean_is_not_a_number():
    with pytest.raises(ValueError, match="^group_size must be"):
        validate_hparams({"group_size": True})


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"num_iterations": 2, "gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
        ({"dynamic_sampling": True, "num_iterations": 2}, "num_iterations"),
        ({"use_engine_logprobs": True, "loss_type": "forge"}, "forge"),
        ({"use_engine_logprobs": True, "rollout_correction": "mask"}, "rollout_correction"),
        ({"rollout_correction": "mask", "loss_type": "forge"}, "forge"),
        ({"use_engine_logprobs": True, "agent": "forge_lightning.examples.calculator_agent.agent"}, "agent"),
        (
            {"rollout_correction": "mask", "behav_imp_weight_cap": 2.0, "rollout_correction_cap": 2.5},
            "one setting given twice",
        ),
        ({"steps_per_generation": 2, "dynamic_sampling": True}, "steps_per_generation"),
        ({"steps_per_generation": 2, "rollout_mode": "async"}, "steps_per_generation"),
        ({"use_engine_logprobs": True, "repetition_penalty": 1.1}, "repetition_penalty"),
        ({"stop": ["Answer:"], "calculator": "plain"}, "stop"),
        ({"rollout_correction": "mask", "agent": "forge_lightning.examples.calculator_agent.agent"}, "agent"),
        ({"rollout_device": "cuda:1"}, "rollout_mode='async' .* or rollout_servers"),
        ({"generation_backend": "vllm", "use_engine_logprobs": True, "top_p": 0.9}, "top_p"),
        ({"generation_backend": "vllm", "use_engine_logprobs": True, "top_k": 5}, "top_k"),
        ({"advantage_estimator": "reinforce_pp"}, "advantage_scale='none'"),
        ({"advantage_estimator": "reinforce_pp", "advantage_scale": "batch"}, "advantage_scale='none'"),
        ({"kl_in_reward": True, "dynamic_sampling": True}, "kl_in_reward .* dynamic_sampling"),
        ({"kl_in_reward": True, "kl_beta": 0.0}, "set kl_beta > 0"),
        ({"clip_ratio_c": 3.0, "loss_type": "sapo"}, "clip_ratio_c does not go with loss_type 'sapo'"),
        ({"entropy_coef": 0.1, "loss_type": "forge"}, "entropy_coef does not go with loss_type 'forge'"),
    ],
)
def test_settings_that_cannot_go_together_are_refused_naming_them(settings, field):
    with pytest.raises(ValueError, match=field):
        validate_hparams(settings)


def test_an_environment_factory_may_run_in_the_process_sandbox_with_sync_rollouts_only():
    validate_hparams({"environment_factory": "mypkg.Env", "sandbox": "process", "sandbox_workers": 3})
    with pytest.raises(ValueError, match="rollout_mode='async'"):
        validate_hparams({"environment_factory": "mypkg.Env", "sandbox": "process", "rollout_mode": "async"})


@pytest.mark.parametrize(
    ("backend", "key", "value"),
    [
        ("hf", "typical_p", 0.2),
        ("hf", "epsilon_cutoff", 3e-4),
        ("hf", "eta_cutoff", 3e-4),
        ("hf", "no_repeat_ngram_size", 2),
        ("hf", "bad_words_ids", [[5]]),
        ("hf", "suppress_tokens", [5]),
        ("hf", "min_new_tokens", 4),
        ("hf", "sequence_bias", {"5": -1.0}),
        ("vllm", "presence_penalty", 0.5),
        ("vllm", "logit_bias", {"5": 1.0}),
        ("vllm", "min_tokens", 4),
        ("vllm", "best_of", 2),
    ],
)
def test_engine_logprobs_refuse_generation_kwargs_that_reshape_the_distribution(backend, key, value):
    # The engine reports log-probs of the distribution it sampled from: after typical_p & co it is
    # not the policy's, and the first step's ratio would be off 1 (a clip fraction of 0.5 at step 1).
    settings = {"generation_backend": backend, "use_engine_logprobs": True, "generation_kwargs": {key: value}}
    with pytest.raises(ValueError, match=rf"use_engine_logprobs does not go with generation_kwargs {key}"):
        validate_hparams(settings)
    validate_hparams({**settings, "use_engine_logprobs": False})  # alone, the key is a valid setting


@pytest.mark.parametrize(("backend", "key"), [("hf", "renormalize_logits"), ("vllm", "skip_special_tokens")])
def test_engine_logprobs_take_generation_kwargs_that_leave_the_distribution(backend, key):
    validate_hparams(
        {"generation_backend": backend, "use_engine_logprobs": True, "generation_kwargs": {key: True}}
    )


def test_the_module_checks_its_settings_when_built(module):
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5"):
        module(top_p=1.5)
    with pytest.raises(ValueError, match="^clip_epsilon must be in"):
        module(clip_epsilon=0.0)


def test_grpo_config_checks_its_fields_when_built():
    with pytest.raises(ValueError, match="^logging_steps must be"):
        GRPOConfig(logging_steps=0)


def test_the_callbacks_check_their_cadence_when_built():
    with pytest.raises(ValueError, match="^save_steps must be"):
        HFCheckpoint(save_steps=-1)
    with pytest.raises(ValueError, match="^logging_steps must be"):
        RewardLogger(logging_steps=0)


@pytest.mark.parametrize(
    "field", ["learning_rate", "weight_decay", "max_grad_norm", "temperature", "kl_beta"]
)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_setting_that_is_not_finite_is_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        validate_hparams({field: value})


def test_a_resume_refuses_another_reward_and_one_it_cannot_compare():
    from forge_lightning.run.resume import check_resume_settings
    from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME

    saved = {"group_size": 4, "reward": "faults.kill_on_call"}
    with pytest.raises(ValueError, match=r"reward: 'faults.kill_on_call' -> 'faults.term_on_call'"):
        check_resume_settings(
            saved, {"group_size": 4, "reward": "faults.term_on_call"}, changeable=CHANGEABLE_ON_RESUME
        )
    # This run's reward has no import path (so its hyperparameters hold none): not the stored one.
    with pytest.raises(ValueError, match=r"reward: 'faults.kill_on_call' -> an object with no import path"):
        check_resume_settings(saved, {"group_size": 4}, changeable=CHANGEABLE_ON_RESUME)
    check_resume_settings(
        {"group_size": 4}, {"group_size": 4, "reward": "a.b"}, changeable=CHANGEABLE_ON_RESUME
    )  # an older checkpoint
