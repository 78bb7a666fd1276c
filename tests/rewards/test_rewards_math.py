"""MathVerifyReward: symbolic answer checks when math-verify is installed, a clear error when not."""

from __future__ import annotations

import sys

import pytest

from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rewards.math_verify_reward import MathVerifyReward


def test_missing_math_verify_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    with pytest.raises(ImportError, match=r'pip install "forge-lightning\[math\]"'):
        MathVerifyReward()


@pytest.fixture
def reward():
    return MathVerifyReward()  # math-verify is in the dev extra: these run wherever the tests do


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("Answer: 2/4", "\\frac{1}{2}", 1.0),
        ("We get $\\dfrac12$.", "1/2", 1.0),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("Answer: 1,800", "1800", 1.0),
        ("Answer: 1/3", "1/2", 0.0),
        ("7 first, but the final answer is \\boxed{3}", "7", 0.0),
        ("I do not know", "1/2", 0.0),
    ],
)
def test_equal_values_in_any_notation_score_one(reward, response, reference, expected):
    assert reward(["p"], [response], references=[reference]).scores == [expected]


def test_unparseable_reference_is_an_error(reward):
    with pytest.raises(ValueError, match="could not parse the reference"):
        reward(["p"], ["Answer: 1"], references=[""])


def test_scores_through_the_training_entry_point(reward):
    scored = score(reward, ["p", "p"], ["\\boxed{0.25}", "\\boxed{4}"], references=["\\frac14", "\\frac14"])
    assert scored.total == [1.0, 0.0]
    assert scored.components == {"MathVerifyReward": [1.0, 0.0]}
