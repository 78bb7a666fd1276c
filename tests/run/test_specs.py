"""Objects as plain data and back (run/specs.py): what a checkpoint stores of a reward given by
import path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.rewards import count_a, varied

from forge_lightning.examples.rewards import has_answer_line
from forge_lightning.rewards.library import (
    CompositeReward,
    ExactMatchReward,
    FormatReward,
    GSM8KAnswerReward,
    LengthPenaltyReward,
    load_reward,
    reward_spec,
)
from forge_lightning.run.specs import from_spec, is_spec, to_spec


def test_an_importable_function_is_its_import_path_and_comes_back_as_itself():
    assert to_spec(count_a) == "helpers.rewards.count_a"
    assert from_spec("helpers.rewards.count_a", Callable[..., Any]) is count_a


def test_an_instance_is_its_class_path_and_its_init_args():
    reward = LengthPenaltyReward(optimal_length=20, min_length=5, max_length=60)
    spec = to_spec(reward)
    assert spec == {
        "class_path": "forge_lightning.rewards.LengthPenaltyReward",
        "init_args": {"optimal_length": 20, "min_length": 5, "max_length": 60, "zero_if_truncated": False},
    }
    back = from_spec(spec)
    assert isinstance(back, LengthPenaltyReward) and (back.min_length, back.max_length) == (5, 60)
    # A string init arg stays a string where the class takes one, and a function where it takes that.
    assert from_spec(to_spec(ExactMatchReward(references=["a.b"]))).references == ["a.b"]
    assert from_spec(to_spec(FormatReward(has_answer_line))).format_fn is has_answer_line


def test_a_composite_reward_keeps_its_components_weights_and_names():
    reward = CompositeReward([(GSM8KAnswerReward(), 3.0, "correct"), (FormatReward(has_answer_line), 1.0)])
    spec = reward_spec(reward)
    assert spec["init_args"]["rewards_and_weights"] == [
        [{"class_path": "forge_lightning.rewards.GSM8KAnswerReward", "init_args": {}}, 3.0, "correct"],
        [
            {
                "class_path": "forge_lightning.rewards.FormatReward",
                "init_args": {"format_fn": "forge_lightning.examples.rewards.has_answer_line"},
            },
            1.0,
        ],
    ]
    back = load_reward(spec)
    assert back.names == ["correct", "FormatReward"] and back.weights == [0.75, 0.25]
    assert reward_spec(back) == spec
    # A list of rewards, with weights or without, as given to the module.
    assert reward_spec([count_a, varied]) == ["helpers.rewards.count_a", "helpers.rewards.varied"]
    assert load_reward(["helpers.rewards.count_a", "helpers.rewards.varied"]) == [count_a, varied]
    weighted = load_reward(reward_spec([(count_a, 2.0), varied]))
    assert weighted.rewards == [count_a, varied] and weighted.weights == pytest.approx([2 / 3, 1 / 3])


def local_reward_factory() -> Callable[..., Any]:
    def local(prompts: list[str], responses: list[str]) -> list[float]:
        return [0.0] * len(responses)

    return local


class _NoAttributes:
    def __init__(self, scale: float) -> None:
        self._scale = scale  # not under its argument's name: the init args are not known


@pytest.mark.parametrize(
    "obj",
    [
        lambda prompts, responses: [0.0] * len(responses),
        local_reward_factory(),
        _NoAttributes(2.0),
        torch.zeros(2),
        [count_a, lambda p, r: r],
        CompositeReward([(lambda p, r: [0.0] * len(r), 1.0)]),
    ],
    ids=["lambda", "local function", "init args unknown", "tensor", "list with a lambda", "composite"],
)
def test_what_has_no_import_path_has_no_spec(obj):
    assert to_spec(obj) is None


def test_specs_are_plain_data_and_building_one_leaves_it_as_it_was():
    spec = ["helpers.rewards.count_a"]
    assert is_spec(spec) and is_spec({"class_path": "x.Y", "init_args": {"a": [1, None]}})
    assert not is_spec([count_a]) and not is_spec({"a": torch.zeros(1)})
    load_reward(spec)
    assert spec == ["helpers.rewards.count_a"]  # a checkpoint's hyperparameters are not rewritten
    with pytest.raises(
        ValueError, match="cannot build an object from its stored form 'helpers.rewards.nothing'"
    ):
        from_spec("helpers.rewards.nothing", Callable[..., Any])
    with pytest.raises(TypeError, match="reward must be a callable .* or the import path of one"):
        load_reward("helpers.rewards.nothing")
