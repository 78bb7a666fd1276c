"""StopAtGoal: the goal on values written by hand, a fit it ends early (and one that does not reach
it), a resume after the goal, and a recipe stage it ends."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from forge_lightning.callbacks import HFCheckpoint, StopAtGoal
from forge_lightning.cli.stages import DONE_FILE, run_stages
from forge_lightning.run.folder import LOG_NAME

ROOT = Path(__file__).resolve().parents[2]


def steps_reached(goal: StopAtGoal, values: list[float]) -> list[int]:
    return [step for step, value in enumerate(values, start=1) if goal.reached(step, value)]


def test_the_goal_is_the_mean_of_the_last_window_steps_from_min_steps_on():
    at_most = StopAtGoal("train/completion_length", at_most=30, window=3)
    assert steps_reached(at_most, [88, 40, 31, 29, 30, 20]) == [5, 6]  # (31+29+30)/3 = 30
    at_least = StopAtGoal("train/reward", at_least=0.5, window=2, min_steps=4)
    assert steps_reached(at_least, [0.9, 0.9, 0.9, 0.0, 1.0, -0.2]) == [5]  # not before step 4
    one = StopAtGoal("train/reward", at_least=0.5, window=1)
    assert steps_reached(one, [0.4, 0.5]) == [2]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({}, "needs one goal"),
        ({"at_least": 0.5, "at_most": 0.6}, "needs one goal"),
        ({"monitor": "val/accuracy", "at_least": 0.5}, "must be a training step's metric"),
        ({"at_least": 0.5, "window": 0}, r"StopAtGoal.window must be an integer >= 1, got 0"),
        ({"at_least": 0.5, "min_steps": 1.5}, r"StopAtGoal.min_steps must be an integer >= 1"),
    ],
)
def test_a_goal_that_cannot_work_is_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        StopAtGoal(**kwargs)


def test_a_fit_resumed_from_after_its_goal_stops_at_once():
    goal = StopAtGoal("train/reward", at_least=0.5, window=2)
    goal.reached(1, 0.6)
    goal.reached(2, 0.6)
    goal.reached_step = 2
    resumed = StopAtGoal("train/reward", at_least=0.5, window=2)
    resumed.load_state_dict(goal.state_dict())
    trainer = SimpleNamespace(should_stop=False)
    resumed.on_train_start(trainer, None)
    assert trainer.should_stop and resumed.reached_step == 2 and list(resumed.values) == [0.6, 0.6]


def goal_fit(module, trainer, loader, root: Path, goal: StopAtGoal):
    grpo = module(gradient_accumulation_steps=1, lr_schedule="constant")
    fit = trainer(root, max_steps=5, callbacks=[goal])
    fit.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(5)]))
    return fit


@pytest.mark.integration
def test_a_fit_ends_after_the_step_that_reaches_the_goal(tmp_path, module, trainer, loader):
    # A tiny model's completions are 1-8 tokens: a mean of at most 100 is reached at step 2.
    goal = StopAtGoal("train/completion_length", at_most=100, window=2)
    fit = goal_fit(module, trainer, loader, tmp_path, goal)
    assert fit.global_step == goal.reached_step == 2
    (event,) = [json.loads(line) for line in (tmp_path / LOG_NAME).read_text().splitlines()]
    assert event["step"] == 2 and event["event"] == "goal" and event["mean"] <= 100


@pytest.mark.integration
def test_a_goal_not_reached_leaves_max_steps_the_limit(tmp_path, module, trainer, loader):
    goal = StopAtGoal("train/completion_length", at_most=0.5, window=1)  # never: every completion has a token
    fit = goal_fit(module, trainer, loader, tmp_path, goal)
    assert fit.global_step == 5 and goal.reached_step is None


def test_a_stage_ended_at_its_goal_is_done_and_the_next_one_runs(tmp_path):
    root = tmp_path / "run"
    smoke = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    stages = [{"name": "calc", "trainer": {"max_steps": 25}}, {"name": "chains"}]
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({**smoke, "trainer": {"default_root_dir": str(root)}, "stages": stages}))
    commands = []

    def fit(command: list[str]) -> SimpleNamespace:
        commands.append(command)
        goal = StopAtGoal("train/completion_length", at_most=30)
        goal.reached_step = 9 if len(commands) == 1 else None
        steps = 9 if len(commands) == 1 else 25
        folder = command[command.index("--trainer.default_root_dir") + 1]
        trainer = SimpleNamespace(max_steps=25, global_step=steps, default_root_dir=folder)
        trainer.callbacks = [HFCheckpoint(), goal]
        return SimpleNamespace(trainer=trainer)

    run_stages(["fit", "--config", str(config)], fit)
    assert len(commands) == 2 and commands[1][-2:] == ["--model.model", str(root / "calc" / "final")]
    calc, chains = (json.loads((root / name / DONE_FILE).read_text()) for name in ("calc", "chains"))
    assert (calc["steps"], calc["at_goal"]) == (9, True)
    assert (chains["steps"], chains["at_goal"]) == (25, False)
