"""``forge-lightning check-resume``: a config run straight, killed at its hard moments and resumed,
PASS when every logged value and weight agrees, else FAIL and the first difference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from forge_lightning.callbacks.kill_point import KillPointSpec
from forge_lightning.cli.check_resume import CheckError, kill_runs, shortened, steps_per_batch
from forge_lightning.cli.forge_cli import build_cli, main

TESTS = Path(__file__).resolve().parents[1]

# A sync run with accumulation: its reward (tests/helpers/faults.py) varies among the tiny model's samples.
CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  max_steps: 3
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
model:
  model: {model}
  reward: helpers.faults.distinct_characters
  group_size: 4
  max_new_tokens: 6
  learning_rate: 0.01
  warmup_steps: 1
  gradient_accumulation_steps: 2
  kl_beta: 0.05
data:
  source: mock
  prompts_per_step: 2
"""


@pytest.fixture
def config(tiny_model_dir, tmp_path, monkeypatch) -> Path:
    """The config's file; its runs import tests/helpers/faults.py."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "accumulation.yaml"
    path.write_text(CONFIG.format(model=tiny_model_dir))
    return path


def check(*args: str) -> int:
    """``forge-lightning check-resume *args``; its exit status."""
    try:
        main(["check-resume", *args])
    except SystemExit as exit_:
        return exit_.code
    return 0


@pytest.mark.integration
def test_a_config_with_accumulation_resumes_exactly_at_every_hard_moment(config, tmp_path, capsys):
    work = tmp_path / "work"
    assert check("--config", str(config), "--model.learning_rate=0.02", "--workdir", str(work)) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "PASS"
    assert "kill_inside_step: killed inside step 2, after a backward in its batch 2 of 2" in out
    assert "kill_checkpoint_write: killed while step 2's last.ckpt is written" in out
    assert "rollouts_in_flight" not in out  # a sync run has none
    # The user's override and config hold; the folder and the checkpoints are check-resume's.
    ran = yaml.safe_load((work / "straight" / "config.yaml").read_text())
    assert ran["model"]["learning_rate"] == 0.02 and ran["model"]["gradient_accumulation_steps"] == 2
    assert ran["trainer"]["default_root_dir"] == str(work / "straight")
    assert ran["checkpoint"]["init_args"]["every_n_train_steps"] == 1
    for run in ("straight", "kill_inside_step", "kill_checkpoint_write"):
        log = (work / run / "training_log.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in log] == [1, 2, 3], run
    for run in ("kill_inside_step", "kill_checkpoint_write"):  # each resumed from step 1's checkpoint
        assert "Restored all states from the checkpoint" in (work / f"{run}.log").read_text()


@pytest.mark.integration
def test_a_resume_that_skips_the_rng_restore_fails_at_its_first_difference(config, tmp_path, capsys):
    # faults.SkipRngRestore leaves the resumed process's RNG as it starts instead of the checkpoint's.
    args = [
        "--config",
        str(config),
        "--trainer.callbacks+=helpers.faults.SkipRngRestore",
        "--workdir",
        str(tmp_path),
    ]
    assert check(*args) == 1
    out = capsys.readouterr().out
    fail = [line for line in out.splitlines() if line.startswith("FAIL: ")]
    assert len(fail) == 1 and fail[0].startswith("FAIL: kill_inside_step, training_log.jsonl step 2, "), out
    assert ": straight " in fail[0] and ", resumed " in fail[0]
    assert "PASS" not in out and "kill_checkpoint_write" not in out  # it stops at the first


def test_the_top_level_help_names_check_resume(capsys):
    with pytest.raises(SystemExit):
        build_cli(["--help"])
    assert "check-resume --config X [overrides]" in capsys.readouterr().out


def test_a_config_without_checkpoints_or_with_a_ckpt_path_is_refused(config, tmp_path, capsys):
    assert check("--config", str(config), "--checkpoint=null", "--workdir", str(tmp_path)) == 2
    assert "keeps no Lightning checkpoint" in capsys.readouterr().err
    assert check("--config", str(config), "--ckpt_path=last") == 2
    assert "each run starts fresh" in capsys.readouterr().err
    assert not (tmp_path / "straight").exists()


def test_the_runs_are_shortened_into_their_own_folders_with_a_checkpoint_a_step():
    config = {
        "trainer": {"callbacks": None},
        "checkpoint": {"init_args": {"dirpath": "/elsewhere", "every_n_train_steps": 50}},
        "reward_logger": {"init_args": {"output_dir": None, "logging_steps": 10}},
        "hf_checkpoint": None,
    }
    flags = shortened(config, steps=4, every=1)
    expected = ["--trainer.max_steps=4", "--checkpoint.every_n_train_steps=1", "--checkpoint.save_last=true"]
    expected += ["--checkpoint.dirpath=null", "--reward_logger.logging_steps=1", "--trainer.logger=false"]
    assert set(expected) <= set(flags)
    assert flags[-1] == "--trainer.callbacks+=forge_lightning.callbacks.KillPoint"
    listed = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]
    with pytest.raises(CheckError, match="lists a ModelCheckpoint: give its settings in the checkpoint"):
        shortened({**config, "trainer": {"callbacks": listed}}, steps=4, every=1)


@pytest.mark.parametrize(
    ("model", "k", "points"),
    [
        ({"gradient_accumulation_steps": 2}, 1, ["backward@2/2", "write@2/last.ckpt"]),
        ({"rollout_mode": "async"}, 1, ["backward@2/1", "write@2/last.ckpt", "batch_end@2"]),
        (
            {"steps_per_generation": 2, "gradient_accumulation_steps": 3},
            2,
            ["backward@3/1", "write@4/last.ckpt"],
        ),
    ],
)
def test_each_kill_falls_after_the_first_checkpoint_and_async_runs_add_rollouts_in_flight(model, k, points):
    assert steps_per_batch(model) == k  # the steps between checkpoints
    runs = kill_runs(model, k)
    assert [str(run.point) for run in runs] == points
    assert all(isinstance(run.point, KillPointSpec) for run in runs)
