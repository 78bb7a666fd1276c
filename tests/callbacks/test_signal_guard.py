"""SignalGuard: the rule on step records written by hand, and a fit whose reward never varies."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import yaml

from forge_lightning.callbacks.signal_guard import (
    GRAD_NORM,
    ZERO_STD,
    SignalGuard,
    SignalGuardError,
    SignalRule,
    SignalWatch,
    describe,
    group_size_for,
    no_signal_chance,
    reward_advice,
)
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.reporting.metrics import StepRecord

ROOT = Path(__file__).resolve().parents[2]
IDLE = {ZERO_STD: 1.0, GRAD_NORM: 0.0}  # every group's rewards equal, no gradient
LIVE = {ZERO_STD: 0.25, GRAD_NORM: 0.3}


def record(step: int, metrics: dict[str, float], rewards: list[float] = (0.5, 0.5)) -> StepRecord:
    values = torch.tensor(rewards)
    return StepRecord(step, values, torch.ones_like(values), metrics=dict(metrics))


def fired_at(watch: SignalWatch, records: list[tuple[StepRecord, bool | None]]) -> list[int]:
    return [r.step for r, moved in records if watch.observe(r, moved) is not None]


def test_a_stretch_of_idle_steps_fires_once_at_the_patience_step():
    watch = SignalWatch(SignalRule(), patience=3)
    steps = [(record(s, IDLE), False) for s in range(1, 7)]
    assert fired_at(watch, steps) == [3]  # once per stretch, not again at 4, 5, 6


def test_a_step_that_trains_ends_the_stretch():
    watch = SignalWatch(SignalRule(), patience=3)
    kinds = [IDLE, IDLE, LIVE, IDLE, IDLE, IDLE, LIVE, IDLE, IDLE, IDLE]
    steps = [(record(s, m), m is LIVE) for s, m in enumerate(kinds, start=1)]
    assert fired_at(watch, steps) == [6, 10]  # each new stretch counts from its own first step


@pytest.mark.parametrize(
    ("metrics", "moved", "idle"),
    [
        ({ZERO_STD: 0.9, GRAD_NORM: 1.0}, True, True),  # share at the threshold
        ({ZERO_STD: 0.875, GRAD_NORM: 1.0}, True, False),
        ({ZERO_STD: 0.0, GRAD_NORM: 5e-9}, True, True),  # gradient norm below min_grad_norm
        ({ZERO_STD: 0.0, GRAD_NORM: 1e-8}, True, False),
        ({ZERO_STD: 0.0, GRAD_NORM: 1.0}, False, True),  # no trainable tensor changed
        ({ZERO_STD: 0.0, GRAD_NORM: 1.0}, None, False),  # not known: the metrics decide
        ({"train/skipped_steps": 1.0}, False, True),  # a skipped step (no norm logged) moved nothing
    ],
)
def test_each_rule_alone_makes_a_step_idle(metrics, moved, idle):
    assert SignalRule(zero_std_share=0.9, min_grad_norm=1e-8).idle(metrics, moved) is idle


def test_accumulation_batches_add_rewards_and_several_steps_in_one_record_count_each():
    watch = SignalWatch(SignalRule(), patience=4)
    accumulating = record(0, {}, [1.0, 1.0, 1.0])  # a batch that only accumulated gradients
    assert watch.observe(accumulating, None) is None and watch.stretch is None
    assert watch.observe(record(2, IDLE, [1.0]), False) is None  # two steps (steps_per_generation)
    stretch = watch.observe(record(4, IDLE, [1.0]), False)
    assert stretch is not None and (stretch.start, stretch.steps) == (0, 4)
    assert (stretch.rewards.count, stretch.rewards.low, stretch.rewards.high) == (5, 1.0, 1.0)


def test_the_message_gives_the_numbers_and_says_no_group_size_helps_a_constant_reward():
    watch = SignalWatch(SignalRule(), patience=2)
    watch.observe(record(1, {ZERO_STD: 1.0, GRAD_NORM: 0.0}), False)
    stretch = watch.observe(record(2, {ZERO_STD: 0.9, GRAD_NORM: 2e-9}), False)
    message = describe(stretch, SignalRule(), 2, reward_advice(stretch.rewards, 8, False))
    assert message.startswith("SignalGuard: optimizer steps 1-2 (2 in a row, patience 2) trained")
    assert "zero-std groups 95% (idle at >= 90%)" in message
    assert "gradient norm at most 2e-09 (idle below 1e-08)" in message
    assert "trainable weights unchanged since step 0" in message
    assert "The reward never varies (all 4 were 0.5): no G helps" in message


def test_a_pass_rate_suggests_the_group_size_and_dynamic_sampling():
    # p = 0.05: (0.95)^G + 0.05^G <= 0.1 first at G = 45 (0.95^44 = 0.105, 0.95^45 = 0.0994).
    assert no_signal_chance(0.05, 8) == pytest.approx(0.95**8 + 0.05**8)
    assert group_size_for(0.05) == 45
    assert group_size_for(0.5) == 5  # 2 * 0.5^G <= 0.1 from G = 5 (0.0625; 0.125 at 4)
    assert group_size_for(0.0) is None and group_size_for(1.0) is None
    watch = SignalWatch(SignalRule(), patience=1)
    stretch = watch.observe(record(1, IDLE, [1.0] + [0.0] * 19), False)
    advice = reward_advice(stretch.rewards, 8, dynamic_sampling=False)
    assert advice.startswith("Pass rate p=0.050 over 20 0/1 rewards")
    assert "at G=8 0.66; G=45 brings it to 0.1; or dynamic_sampling: true" in advice
    assert "dynamic_sampling" not in reward_advice(stretch.rewards, 8, dynamic_sampling=True)


def test_rewards_that_are_not_zero_or_one_get_no_group_size():
    watch = SignalWatch(SignalRule(), patience=1)
    stretch = watch.observe(record(1, IDLE, [0.25, 0.75, 0.75]), False)
    advice = reward_advice(stretch.rewards, 8, False)
    assert advice.startswith("The rewards are not 0/1 (from 0.25 to 0.75 over 3), so no G is suggested")


def test_groups_that_vary_point_past_the_reward():
    watch = SignalWatch(SignalRule(), patience=1)
    stretch = watch.observe(record(1, {ZERO_STD: 0.25, GRAD_NORM: 0.0}, [0.0, 1.0]), False)
    advice = reward_advice(stretch.rewards, 8, False, groups_vary=True)
    assert advice.startswith("Most groups' rewards vary, so the signal is lost after the reward")


def test_the_counters_survive_a_checkpoint_so_a_resumed_run_fires_at_the_same_step():
    watch = SignalWatch(SignalRule(), patience=3)
    assert fired_at(watch, [(record(1, IDLE), False), (record(2, IDLE), False)]) == []
    buffer = io.BytesIO()
    torch.save(watch.state_dict(), buffer)  # as a Lightning checkpoint holds it
    buffer.seek(0)
    resumed = SignalWatch(SignalRule(), patience=3)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert fired_at(resumed, [(record(3, IDLE), False)]) == [3]
    assert math.isinf(SignalWatch(SignalRule(), 3).state_dict()["pending"]["low"])  # an empty tally


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"mode": "stop"}, "signal_guard.mode must be 'warn' or 'fail'"),
        ({"patience": 0}, "signal_guard.patience must be an integer >= 1"),
        ({"zero_std_share": 1.5}, r"signal_guard.zero_std_share must be in \(0, 1\]"),
        ({"min_grad_norm": -1.0}, "signal_guard.min_grad_norm must be >= 0"),
    ],
)
def test_a_bad_setting_is_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        SignalGuard(**kwargs)


def test_the_cli_group_is_on_by_default_and_smoke_yaml_sets_it(capsys):
    def printed(*args: str) -> dict:
        with pytest.raises(SystemExit) as exit_info:
            build_cli(["fit", *args, "--print_config"])
        assert exit_info.value.code == 0
        return yaml.safe_load(capsys.readouterr().out)["signal_guard"]

    default = printed()
    assert default["class_path"] == "forge_lightning.callbacks.SignalGuard"
    assert (default["init_args"]["mode"], default["init_args"]["patience"]) == ("warn", 10)
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    assert printed(*smoke)["init_args"]["patience"] == 3
    flags = ["--signal_guard.mode=fail", "--signal_guard.patience=5", "--signal_guard.min_grad_norm=1e-6"]
    chosen = printed(*smoke, *flags)["init_args"]
    assert (chosen["mode"], chosen["patience"], chosen["min_grad_norm"]) == ("fail", 5, 1e-6)
    assert printed(*smoke, "--signal_guard=null") is None


def constant(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.5] * len(responses)


def guarded_fit(module, trainer, loader, root: Path, callbacks: list, **kwargs) -> tuple:
    """A Trainer of up to 4 steps (one prompt each) and a tiny module whose reward never varies."""
    grpo = module(reward=constant, gradient_accumulation_steps=1, kl_beta=0.0, max_new_tokens=4)
    fit = trainer(root, **{"max_steps": 4, **kwargs, "callbacks": callbacks})
    return fit, grpo, loader([{"prompt": f"q{i}"} for i in range(4)])


@pytest.mark.integration
def test_a_constant_reward_warns_at_the_patience_step_and_fail_mode_stops_there(
    tmp_path, module, trainer, loader
):
    fit, grpo, data = guarded_fit(module, trainer, loader, tmp_path / "warn", [SignalGuard(patience=3)])
    with pytest.warns(UserWarning, match=r"^SignalGuard: optimizer steps 1-3 \(3 in a row") as caught:
        fit.fit(grpo, data)
    (message,) = [str(w.message) for w in caught if str(w.message).startswith("SignalGuard:")]
    assert "zero-std groups 100%" in message and "gradient norm at most 0 " in message
    assert "trainable weights unchanged since step 0" in message
    assert "The reward never varies (all 12 were 0.5)" in message  # 3 steps of one prompt's 4
    assert fit.global_step == 4  # warn mode: training goes on

    fit, grpo, data = guarded_fit(module, trainer, loader, tmp_path / "fail", [SignalGuard("fail", 3)])
    with pytest.raises(SignalGuardError, match=r"^SignalGuard: optimizer steps 1-3 "):
        fit.fit(grpo, data)
    assert fit.global_step == 3


@pytest.mark.integration
def test_a_run_resumed_mid_stretch_stops_at_the_same_step(tmp_path, module, trainer, loader):
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    callbacks = [SignalGuard("fail", 3), saver]
    fit, grpo, data = guarded_fit(
        module, trainer, loader, tmp_path, callbacks, max_steps=2, enable_checkpointing=True
    )
    fit.fit(grpo, data)  # two idle steps: under the patience
    fit, grpo, data = guarded_fit(module, trainer, loader, tmp_path, [SignalGuard("fail", 3)])
    with pytest.raises(SignalGuardError, match=r"^SignalGuard: optimizer steps 1-3 "):
        fit.fit(grpo, data, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert fit.global_step == 3  # not 5: the two steps before the resume still count


@pytest.mark.integration
def test_the_cli_in_fail_mode_exits_with_the_one_message(tiny_model_dir, tmp_path, tiny_overrides):
    # smoke.yaml with a reward that a random tiny model writing 6 characters never earns: an
    # answer line ("Answer: 7") is longer.
    never = '{"class_path": "forge_lightning.rewards.FormatReward", "init_args": {"format_fn": '
    never += '"forge_lightning.examples.rewards.has_answer_line"}}'
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), *tiny_overrides(tiny_model_dir, tmp_path)]
    args = ["fit", *smoke, f"--model.reward={never}"]
    off = ["--checkpoint=null", "--hf_checkpoint=null", "--trainer.logger=false"]
    with pytest.raises(SystemExit) as stopped:
        build_cli([*args, *off, "--trainer.max_steps=4", "--signal_guard.mode=fail"])
    message = str(stopped.value.code)
    assert message.startswith("SignalGuard: optimizer steps 1-3 (3 in a row, patience 3)"), message
    assert "The reward never varies (all 48 were 0)" in message  # 3 steps of 4 prompts x 4


@pytest.mark.integration
def test_another_lightning_module_trains_undisturbed(tmp_path, trainer, recwarn):
    from lightning.pytorch.demos.boring_classes import BoringModel

    guard = SignalGuard("fail", patience=1)
    fit = trainer(tmp_path, max_steps=2, callbacks=[guard])
    fit.fit(BoringModel())
    assert fit.global_step == 2 and guard.watch.stretch is None
    assert not [w for w in recwarn if "SignalGuard" in str(w.message)]
