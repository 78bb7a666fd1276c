"""The custom-reward example: its checks, and configs/custom_reward.yaml parsed and run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.examples.rewards import (
    WORD_BUDGET,
    concise_answer,
    gives_answer,
    has_answer_line,
    shows_working,
    states_answer,
)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "custom_reward.yaml"
COMPONENTS = ("correct", "concise", "answer_line", "working")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7\nAnswer: 7", True),
        ("Answer: $1,800\n\n", True),
        ("Answer: -2.5", True),
        ("So 6 * 7 = 42. Answer: 42.", True),
        ("Final answer: 42", True),
        ("Answer: 42 apples", False),
        ("Answer: 7\nThat was easy.", False),
        ("Answer: seven", False),
        ("The answer is 7", False),
        ("", False),
    ],
)
def test_has_answer_line_wants_a_number_on_the_last_line(text, expected):
    assert has_answer_line(text) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 7", True),
        ("3 + 4 = 7\nAnswer: 7\nThat was easy.", True),
        ("So 6 * 7 = 42. Answer: 42.\n\nStep 2: check it", True),
        ("The answer is: 7\nAnswer: seven", False),
        ("Answer: 42 apples\nmore", False),
        ("", False),
    ],
)
def test_gives_answer_finds_the_answer_line_anywhere(text, expected):
    assert gives_answer(text) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 7", True),
        ("The answer is 600.", True),
        ("So the final result is: $1,200", True),
        ("The answer is 40 minutes.", True),
        ("The total is 15 apples.", False),
        ("12 is the answer.", False),
        ("The answer is 7\nThanks for asking.", False),
        ("We add 3 and 4.", False),
        ("", False),
    ],
)
def test_states_answer_accepts_any_stated_result_on_the_last_line(text, expected):
    assert states_answer(text) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 + 4 = 7 apples.", True),
        ("12 x 3 = 36", True),
        ("$1,200 * 2 = $2,400", True),
        ("10 / 3 = 3.33", True),
        ("3 + 4 = 8", False),
        ("100 * 2 = 201", False),
        ("10 / 3 = 3.4", False),
        ("5 / 0 = 1", False),
        ("no numbers at all", False),
    ],
)
def test_shows_working_counts_only_right_calculations(text, expected):
    assert shows_working(text) is expected


def test_concise_answer_pays_for_right_answers_and_less_for_long_ones():
    short = "3 + 4 = 7\nAnswer: 7"
    long = " ".join(["so"] * (2 * WORD_BUDGET - 2)) + "\nAnswer: 7"
    scores = concise_answer(["p"] * 3, [short, long, "Answer: 8"], ["7", "7", "7"])
    assert scores == [1.0, pytest.approx(0.5), 0.0]


def test_custom_reward_config_parses(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(CONFIG), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "forge_lightning.examples.rewards.concise_answer" in printed
    assert "format_fn: forge_lightning.examples.rewards.has_answer_line" in printed


@pytest.mark.integration
def test_custom_reward_config_logs_every_component(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    build_cli(
        [
            "fit",
            "--config",
            str(CONFIG),
            f"--model.model={tiny_model_dir}",
            "--model.max_new_tokens=6",
            "--trainer.max_steps=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={out}",
        ]
    )
    (record,) = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert record["step"] == 1
    assert {f"rewards/{name}" for name in COMPONENTS} <= set(record)
    assert all(0.0 <= record[f"rewards/{name}"] <= 1.0 for name in COMPONENTS)


@pytest.mark.integration
def test_a_run_with_a_reward_list_reruns_from_its_saved_config(tiny_model_dir, tmp_path, tiny_overrides):
    import yaml

    first = tmp_path / "first"
    smoke = CONFIG.parent / "smoke.yaml"
    rewards = "--model.reward=[helpers.rewards.count_a, helpers.rewards.varied]"
    build_cli(
        [
            "fit",
            "--config",
            str(smoke),
            *tiny_overrides(tiny_model_dir, first),
            rewards,
            "--trainer.max_steps=1",
        ]
    )
    (saved,) = first.rglob("config.yaml")
    assert yaml.safe_load(saved.read_text())["model"]["reward"] == [
        "helpers.rewards.count_a",
        "helpers.rewards.varied",
    ]
    again = tmp_path / "again"
    build_cli(["fit", "--config", str(saved), f"--trainer.default_root_dir={again}"])
    (record,) = [json.loads(line) for line in (again / "training_log.jsonl").read_text().splitlines()]
    assert {"rewards/count_a", "rewards/varied"} <= set(record)
