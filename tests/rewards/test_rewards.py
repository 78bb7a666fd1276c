"""Behaviour of the reward classes, the kwarg filtering and the checked entry point ``score``."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import signal
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers.spans import running_at_each_start

from forge_lightning.rewards.batch_scoring import ScoredRewards, score
from forge_lightning.rewards.environment import EnvironmentReward, with_environment_score
from forge_lightning.rewards.library import (
    BaseReward,
    CompositeReward,
    ExactMatchReward,
    FormatReward,
    GSM8KAnswerReward,
    LengthPenaltyReward,
    RewardOutput,
    accepted_kwargs,
    component_names,
    reward_name,
)


class SeedStyleReward(BaseReward):
    """A custom reward written like the seed's template: no ``**kwargs`` in its signature."""

    def __call__(self, prompts, responses) -> RewardOutput:
        return RewardOutput(scores=[0.5 for _ in responses])


def has_digit(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(any(c.isdigit() for c in r)) for r in responses]


def words(n: int) -> str:
    return " ".join(["w"] * n)


# ExactMatchReward


def test_exact_match_is_case_insensitive_substring() -> None:
    out = ExactMatchReward()(["p", "p"], ["The answer is PARIS.", "london"], references=["paris", "Rome"])
    assert out.scores == [1.0, 0.0]


def test_exact_match_call_time_references_override_init() -> None:
    reward = ExactMatchReward(references=["cat"])
    assert reward(["p"], ["a cat"]).scores == [1.0]
    assert reward(["p"], ["a cat"], references=["dog"]).scores == [0.0]


def test_exact_match_without_references_raises() -> None:
    with pytest.raises(ValueError, match="references"):
        ExactMatchReward()(["p"], ["r"])


# FormatReward


def test_format_reward_scores_truthiness_of_format_fn() -> None:
    reward = FormatReward(lambda r: "answer:" in r.lower())
    assert reward(["p", "p"], ["x\nAnswer: 3", "3"]).scores == [1.0, 0.0]


# LengthPenaltyReward


@pytest.mark.parametrize(
    ("word_count", "expected"),
    [
        (200, 1.0),  # optimal
        (50, 0.0),  # min_length
        (500, 0.0),  # max_length
        (125, 0.5),  # halfway between min and optimal
        (350, 0.5),  # halfway between optimal and max
        (49, 0.0),  # below min
        (501, 0.0),  # above max
        (0, 0.0),
    ],
)
def test_length_penalty_pinned_points(word_count: int, expected: float) -> None:
    assert LengthPenaltyReward()(["p"], [words(word_count)]).scores == [pytest.approx(expected)]


def test_length_penalty_counts_whitespace_separated_words() -> None:
    reward = LengthPenaltyReward(optimal_length=3, min_length=1, max_length=5)
    assert reward(["p"], ["  one\ttwo\n\nthree  "]).scores == [1.0]


def test_length_penalty_optimal_at_a_bound_does_not_divide_by_zero() -> None:
    reward = LengthPenaltyReward(optimal_length=10, min_length=10, max_length=10)
    assert reward(["p"] * 3, [words(9), words(10), words(11)]).scores == [0.0, 1.0, 0.0]


def test_length_penalty_rejects_unordered_lengths() -> None:
    with pytest.raises(ValueError, match="min_length <= optimal_length <= max_length"):
        LengthPenaltyReward(optimal_length=40, min_length=50)


# GSM8KAnswerReward


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        ("Answer: $18", "18"),
        ("Answer: 18.00", "18"),
        ("so 1,800 in all.\nAnswer: 1,800", "1800"),
        ("It falls to -7 degrees.\nAnswer: -7", "-7"),
        ("Answer: 13.50", "13.5"),
        ("the result is \\boxed{42}, not 41", "42"),
        ("Answer: 18", 18),
    ],
)
def test_gsm8k_answer_reward_compares_values(response: str, reference: Any) -> None:
    assert GSM8KAnswerReward()(["p"], [response], references=[reference]).scores == [1.0]


@pytest.mark.parametrize("response", ["Answer: 19", "Answer: -18", "no number here", "Answer: 180"])
def test_gsm8k_answer_reward_rejects_other_values(response: str) -> None:
    assert GSM8KAnswerReward()(["p"], [response], references=["18"]).scores == [0.0]


def test_gsm8k_answer_reward_needs_references() -> None:
    with pytest.raises(ValueError, match="references"):
        GSM8KAnswerReward()(["p"], ["Answer: 1"])


# CompositeReward


def test_composite_normalises_weights_to_a_weighted_mean() -> None:
    composite = CompositeReward([(ExactMatchReward(), 3.0), (FormatReward(lambda r: False), 1.0)])
    assert composite.weights == [0.75, 0.25]
    out = composite(["p", "p"], ["42", "7"], references=["42", "42"])
    assert out.scores == [0.75, 0.0]
    assert out.metadata["components"] == {"ExactMatchReward": [1.0, 0.0], "FormatReward": [0.0, 0.0]}


def test_composite_forwards_kwargs_only_to_rewards_that_accept_them() -> None:
    composite = CompositeReward([(SeedStyleReward(), 1.0), (ExactMatchReward(), 1.0), (has_digit, 2.0)])
    out = composite(["p"], ["7"], references=["7"], unrelated="ignored")
    assert out.scores == [pytest.approx(0.25 * 0.5 + 0.25 * 1.0 + 0.5 * 1.0)]


def test_composite_names_are_unique_and_respect_given_names() -> None:
    composite = CompositeReward(
        [
            (FormatReward(bool), 1.0),
            (FormatReward(bool), 1.0),
            (has_digit, 1.0),
            (lambda p, r: [0.0], 1.0, "mine"),
        ]
    )
    assert composite.names == ["FormatReward", "FormatReward_2", "has_digit", "mine"]
    assert component_names(composite) == composite.names


class Scored:
    def __init__(self, score: float) -> None:
        self.score = score

    def get_reward(self) -> float:
        return self.score


def test_an_environments_score_joins_a_reward_set_weighted_as_the_mean_of_the_others() -> None:
    alone = with_environment_score(has_digit)
    assert alone.names == ["has_digit", "EnvironmentReward"] and alone.weights == [0.5, 0.5]
    envs = [Scored(1.0), Scored(0.0)]
    assert alone(["p", "p"], ["a1", "b1"], environments=envs).scores == [1.0, 0.5]
    weighted = with_environment_score(CompositeReward([(has_digit, 3.0), (FormatReward(bool), 1.0, "ok")]))
    assert weighted.names == ["has_digit", "ok", "EnvironmentReward"]
    assert weighted.weights == [0.5, pytest.approx(1 / 6), pytest.approx(1 / 3)]  # 3 : 1 : 2
    # Named among the rewards, it keeps the weight given there (0: left out).
    chosen = CompositeReward([(has_digit, 1.0), (EnvironmentReward(), 0.0)])
    assert with_environment_score(chosen) is chosen
    only = EnvironmentReward()
    assert with_environment_score(only) is only


@pytest.mark.parametrize("weights", [(1.0, -1.0), (0.0, 0.0), (math.nan, 1.0)])
def test_composite_rejects_bad_weights(weights: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="weights"):
        CompositeReward([(has_digit, weights[0]), (FormatReward(bool), weights[1])])


# Names and kwarg filtering


def test_reward_name_uses_function_name_or_class_name() -> None:
    assert reward_name(has_digit) == "has_digit"
    assert reward_name(ExactMatchReward()) == "ExactMatchReward"
    assert reward_name(lambda p, r: []) == "lambda"
    assert component_names(has_digit) == ["has_digit"]


def test_accepted_kwargs_filters_by_signature() -> None:
    kwargs = {"references": ["1"], "other": 2}
    assert accepted_kwargs(has_digit, kwargs) == {}
    assert accepted_kwargs(SeedStyleReward(), kwargs) == {}
    assert accepted_kwargs(lambda p, r, references: [], kwargs) == {"references": ["1"]}
    assert accepted_kwargs(ExactMatchReward(), kwargs) == kwargs


# score()


def test_score_accepts_plain_callable_and_reports_it_as_the_component() -> None:
    scored = score(has_digit, ["p", "p"], ["a1", "b"], references=["1", "2"])
    assert scored == ScoredRewards(total=[1.0, 0.0], components={"has_digit": [1.0, 0.0]}, num_errors=0)


def test_score_splits_composite_into_components() -> None:
    composite = CompositeReward([(GSM8KAnswerReward(), 1.0), (SeedStyleReward(), 1.0, "style")])
    scored = score(composite, ["p", "p"], ["Answer: 3", "Answer: 4"], references=["3", "3"])
    assert scored.components == {"GSM8KAnswerReward": [1.0, 0.0], "style": [0.5, 0.5]}
    assert scored.total == [0.75, 0.25]


@pytest.mark.parametrize(
    ("bad_scores", "message"),
    [
        ([1.0], "returned 1 scores for 2"),
        ([1.0, None], "returned None at index 1"),  # a lone reward: None scores nothing
        ([1.0, math.nan], "non-finite"),
        ([math.inf, 0.0], "non-finite"),
        ([1.0, "1"], "non-number"),
    ],
)
def test_score_rejects_bad_output_naming_the_reward(bad_scores: list[Any], message: str) -> None:
    def broken(prompts: list[str], responses: list[str]) -> list[Any]:
        return bad_scores

    with pytest.raises(ValueError, match=message) as info:
        score(broken, ["p", "p"], ["a", "b"])
    assert "'broken'" in str(info.value)


def test_score_names_the_failing_component_of_a_composite() -> None:
    composite = CompositeReward([(has_digit, 1.0), (lambda p, r: [math.nan] * len(r), 1.0, "nanny")])
    with pytest.raises(ValueError, match="'nanny'"):
        score(composite, ["p"], ["1"])


def fails_on_bad(prompts: list[str], responses: list[str], references: list[str]) -> list[float]:
    if any(r == "bad" for r in responses):
        raise KeyError("boom")
    return [1.0 if r == ref else 0.5 for r, ref in zip(responses, references)]


def test_score_on_error_raise_names_the_first_failing_sample() -> None:
    with pytest.raises(RuntimeError, match="'fails_on_bad' failed on sample 1") as info:
        score(fails_on_bad, ["p"] * 4, ["ok", "bad", "ok", "bad"], references=["ok", "x", "no", "x"])
    assert isinstance(info.value.__cause__, KeyError)


def test_score_on_error_zero_zeroes_and_counts_failing_samples() -> None:
    with pytest.warns(UserWarning, match="raised on 2 of 4 samples"):
        scored = score(
            fails_on_bad,
            ["p"] * 4,
            ["ok", "bad", "ok", "bad"],
            on_error="zero",
            references=["ok", "x", "no", "x"],
        )
    # Per-sample kwargs were sliced: sample 2 saw its own reference "no", so it keeps 0.5.
    assert scored.total == [1.0, 0.0, 0.5, 0.0]
    assert scored.num_errors == 2


def test_score_on_error_zero_counts_a_sample_once_across_components() -> None:
    composite = CompositeReward([(fails_on_bad, 1.0), (fails_on_bad, 1.0), (SeedStyleReward(), 2.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scored = score(composite, ["p", "p"], ["ok", "bad"], on_error="zero", references=["ok", "x"])
    assert scored.num_errors == 1
    assert scored.components["fails_on_bad_2"] == [1.0, 0.0]
    assert scored.total == [0.75, 0.25]


def test_score_batch_only_failure_raises_or_falls_back_to_per_sample_scores() -> None:
    def batch_of_one_only(prompts: list[str], responses: list[str]) -> list[float]:
        if len(responses) > 1:
            raise MemoryError("batch too large")
        return [2.0]

    says = (
        r"on the batch of 2 but on no single sample .*: it depends on the batch as a whole, e.g. on its size"
    )
    with pytest.raises(RuntimeError, match=says):
        score(batch_of_one_only, ["p", "p"], ["a", "b"])
    with pytest.warns(UserWarning, match=says):
        scored = score(batch_of_one_only, ["p", "p"], ["a", "b"], on_error="zero")
    assert (scored.total, scored.num_errors) == ([2.0, 2.0], 0)


def test_score_accepts_array_like_output() -> None:
    class ArrayLike:
        def tolist(self) -> list[float]:
            return [0.25]

    assert score(lambda p, r: ArrayLike(), ["p"], ["r"]).total == [0.25]


def test_score_rejects_unknown_on_error() -> None:
    with pytest.raises(ValueError, match="on_error"):
        score(has_digit, ["p"], ["1"], on_error="ignore")  # type: ignore[arg-type]


def test_score_rejects_mismatched_prompts_and_responses() -> None:
    with pytest.raises(ValueError, match="prompts"):
        score(has_digit, ["p"], ["1", "2"])


def test_overlong_penalty_is_zero_then_linear_to_minus_one_at_the_cap():
    from forge_lightning.rewards.library import OverlongPenaltyReward

    reward = OverlongPenaltyReward(max_length=10, buffer=4)
    scores = reward(["p"] * 5, ["r"] * 5, completion_lengths=[3, 6, 8, 10, 12]).scores
    assert scores == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="completion_lengths"):
        reward(["p"], ["r"])
    with pytest.raises(ValueError, match="buffer"):
        OverlongPenaltyReward(max_length=10, buffer=0)


def test_length_penalty_can_leave_truncated_completions_at_zero():
    reward = LengthPenaltyReward(optimal_length=2, min_length=1, max_length=3, zero_if_truncated=True)
    assert reward(["p", "p"], ["two words", "two words"], truncated=[False, True]).scores == [1.0, 0.0]
    assert LengthPenaltyReward(2, 1, 3)(["p"], ["two words"], truncated=[True]).scores == [1.0]


def test_rewards_get_the_per_completion_facts_they_name():
    import torch

    from forge_lightning.rewards.batch_scoring import score_groups
    from forge_lightning.rollout.types import Rollout

    seen = {}

    def facts(prompts, responses, completion_ids, completion_lengths, truncated):
        seen.update(ids=completion_ids, lengths=completion_lengths, truncated=truncated)
        return [0.0] * len(responses)

    ids = torch.tensor([[5, 6, 1, 1], [5, 6, 7, 8]])  # eos 1: the second row is cut off at 4 tokens
    rollout = Rollout(
        prompt_ids=torch.tensor([[3]]),
        prompt_mask=torch.tensor([[1]]),
        completion_ids=ids,
        completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        group_size=2,
        completions=["ab", "abcd"],
        truncated=torch.tensor([False, True]),
    )
    score_groups(facts, ["q"], rollout, {})
    assert seen == {"ids": [[5, 6, 1], [5, 6, 7, 8]], "lengths": [3, 4], "truncated": [False, True]}


def test_an_answer_with_a_leading_point_is_read_as_its_value():
    reward = GSM8KAnswerReward()
    scores = reward(
        ["p"] * 3, ["Answer: .5", "so it is .5 dollars", "Answer: -.25"], references=["0.5", "0.5", "-0.25"]
    )
    assert scores.scores == [1.0, 1.0, 1.0]


def test_a_reward_that_rewrites_its_inputs_changes_nothing_for_the_next():
    seen: list[list[str]] = []

    def vandal(prompts, responses, references):
        responses[:] = ["rewritten"] * len(responses)
        references.clear()
        prompts.clear()
        return [0.0, 0.0]

    def reader(prompts, responses, references):
        seen.append(list(responses) + list(references) + list(prompts))
        return [1.0, 1.0]

    responses, references = ["a", "b"], ["1", "2"]
    scored = score(
        CompositeReward([(vandal, 1.0), (reader, 1.0)]), ["p", "q"], responses, references=references
    )
    assert seen == [["a", "b", "1", "2", "p", "q"]]
    assert responses == ["a", "b"] and references == ["1", "2"]
    assert scored.components["reader"] == [1.0, 1.0]


def test_a_reward_that_empties_its_inputs_is_told_the_true_counts():
    def emptier(prompts, responses):
        responses.clear()
        return [1.0] * len(responses)  # scores for what it now sees: none

    with pytest.raises(ValueError, match="returned 0 scores for 2 responses"):
        score(emptier, ["p", "q"], ["a", "b"])


def _sleeper(prompts, responses):
    time.sleep(30)
    return [1.0] * len(responses)


def test_a_reward_past_its_timeout_is_abandoned_and_named():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reward '_sleeper' took longer than reward_timeout=0.2s"):
        score(_sleeper, ["p", "q"], ["a", "b"], reward_timeout=0.2)
    assert time.monotonic() - start < 5  # one abandoned call, not one per sample


def test_a_timed_out_batch_scores_zero_and_counts_every_sample_under_on_error_zero():
    fine = lambda prompts, responses: [0.5] * len(responses)  # noqa: E731
    with pytest.warns(UserWarning, match="took longer than reward_timeout"):
        scored = score(
            CompositeReward([(_sleeper, 1.0, "slow"), (fine, 1.0, "fine")]),
            ["p", "q"], ["a", "b"], on_error="zero", reward_timeout=0.2,
        )  # fmt: skip
    assert scored.components == {"slow": [0.0, 0.0], "fine": [0.5, 0.5]}
    assert scored.num_errors == 2


def test_a_reward_within_its_timeout_scores_as_usual_and_its_errors_surface():
    assert score(lambda p, r: [2.0] * len(r), ["p"], ["a"], reward_timeout=5).total == [2.0]

    def broken(prompts, responses):
        raise KeyError("no such field")

    with pytest.raises(RuntimeError, match="KeyError"):
        score(broken, ["p"], ["a"], reward_timeout=5)


def quits(prompts, responses):
    raise SystemExit(3)


def interrupts(prompts, responses):
    raise KeyboardInterrupt


@pytest.mark.parametrize("reward_timeout", [None, 5])
def test_a_rewards_own_exit_or_interrupt_stops_with_an_error_naming_it(reward_timeout):
    composite = CompositeReward([(has_digit, 1.0), (quits, 1.0)])
    for reward, raised in (
        (quits, r"SystemExit\(3\)"),
        (interrupts, r"KeyboardInterrupt\(\)"),
        (composite, ""),
    ):
        for on_error in ("raise", "zero"):  # not a sample's error: never scored 0
            with pytest.raises(SystemExit) as stop:
                score(reward, ["p", "q"], ["1", "b"], on_error=on_error, reward_timeout=reward_timeout)
            message = stop.value.code  # a message, so the process exits 1 and prints it
            assert isinstance(message, str), message
            assert re.match(rf"reward '(quits|interrupts)' raised {raised}.* from its own code", message)


def test_a_signal_during_a_reward_call_passes_through_unchanged():
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from forge_lightning.run.signals import sigterm_interrupts

    def signals(signum):
        def reward(prompts, responses):
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises in here
            return [1.0] * len(responses)

        return reward

    # Python's own Ctrl-C handler, as an interactive run has it (a process started in the
    # background of a shell script inherits SIGINT ignored, and Python then installs none).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # a Ctrl-C, as Python raises it
            score(signals(signal.SIGINT), ["p"], ["a"])
        with sigterm_interrupts(), pytest.raises(SIGTERMException) as stop:  # the module's reward calls
            score(signals(signal.SIGTERM), ["p"], ["a"])
        assert type(stop.value) is SIGTERMException and stop.value.code == 143
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_slow_reward_without_a_timeout_is_warned_about_once(monkeypatch):
    from forge_lightning.rewards import library as rewards

    monkeypatch.setattr(rewards, "SLOW_REWARD_SECONDS", 0.1)

    def slow(prompts, responses):
        time.sleep(0.5)
        return [1.0] * len(responses)

    with pytest.warns(UserWarning) as seen:
        assert score(slow, ["p"], ["a"]).total == [1.0]
    assert [str(w.message) for w in seen] == [
        "reward 'slow' has run for more than 0.1s in one call, with no reward_timeout set; if it "
        "hangs, set model.reward_timeout (seconds, e.g. --model.reward_timeout 300) to abandon a "
        "call that takes longer"
    ]
    with warnings.catch_warnings(record=True) as later:  # (the watchdog warns from its own thread)
        warnings.simplefilter("always")
        score(lambda p, r: [1.0] * len(r), ["p"], ["a"])  # a fast one: no warning, even later
        time.sleep(0.3)
        score(slow, ["p"], ["a"], reward_timeout=5)  # a timeout set: no warning either
    assert later == []


def test_none_means_not_applicable_to_a_composites_component():
    def only_even(prompts, responses):
        return [1.0 if i % 2 == 0 else None for i in range(len(responses))]

    def half(prompts, responses):
        return [0.5] * len(responses)

    composite = CompositeReward([(only_even, 1.0, "even"), (half, 1.0, "half")])
    scored = score(composite, ["p"] * 4, ["a", "b", "c", "d"])
    assert scored.total == [0.75, 0.25, 0.75, 0.25]  # None counts 0 (weights stay 1/2 each)
    assert scored.components["even"][0] == 1.0 and math.isnan(scored.components["even"][1])
    assert composite(["p"] * 2, ["a", "b"]).scores == [0.75, 0.25]


def test_none_from_every_component_or_from_a_lone_reward_is_an_error():
    def never(prompts, responses):
        return [None] * len(responses)

    with pytest.raises(ValueError, match="no reward component scored sample 0"):
        score(CompositeReward([(never, 1.0, "a"), (never, 1.0, "b")]), ["p"], ["a"])
    with pytest.raises(ValueError, match="returned None at index 0"):
        score(never, ["p"], ["a"])


async def async_reward(prompts, responses):
    return [1.0] * len(responses)


class AsyncCallReward(BaseReward):
    async def __call__(self, prompts, responses, **kwargs):
        return [0.5] * len(responses)


def hands_back_a_coroutine(prompts, responses):
    return async_reward(prompts, responses)


@pytest.mark.parametrize(
    "reward, value",
    [(async_reward, 1.0), (AsyncCallReward(), 0.5), (hands_back_a_coroutine, 1.0)],
    ids=["async def", "async __call__", "returns a coroutine"],
)
def test_an_async_reward_is_awaited(reward, value) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        assert score(reward, ["p", "q"], ["r", "s"]).total == [value, value]
        assert score(reward, ["p"], ["r"], reward_timeout=5.0).total == [value]
        composite = CompositeReward([(has_digit, 1.0, "digit"), (reward, 1.0, "async")])
        assert score(composite, ["p"], ["1"]).components == {"digit": [1.0], "async": [value]}


def sleeper(seconds: float, value: float, slept: list[tuple[float, float]] | None = None):
    """An async reward that sleeps ``seconds``, then scores ``value``; when each sleep began and
    ended goes into ``slept``."""

    async def sleeps(prompts, responses):
        began = time.monotonic()
        await asyncio.sleep(seconds)
        if slept is not None:
            slept.append((began, time.monotonic()))
        return [value] * len(responses)

    return sleeps


def test_async_rewards_are_awaited_at_once_and_their_scores_come_back_in_order() -> None:
    slept: list[tuple[float, float]] = []
    rewards = [(sleeper(0.4, float(k), slept), 1.0, f"r{k}") for k in range(4)]
    scored = score(CompositeReward(rewards), ["p"], ["a"], reward_timeout=5.0)
    assert scored.components == {f"r{k}": [float(k)] for k in range(4)}
    # how many rewards slept at each one's start: one after another, one; at once, all four, or
    # (where a busy machine starts them late) at least three at some point
    at_once = running_at_each_start(slept)
    assert len(slept) == 4 and max(at_once) >= 3, f"the rewards were awaited one after another: {at_once}"


def test_an_async_reward_past_its_timeout_fails_alone_while_the_others_score() -> None:
    rewards = [(sleeper(2.0, 1.0), 1.0, "slow"), (sleeper(0.0, 2.0), 1.0, "quick")]
    with pytest.warns(UserWarning, match="took longer than reward_timeout=0.3s"):
        scored = score(CompositeReward(rewards), ["p"], ["a"], "zero", reward_timeout=0.3)
    assert scored.components == {"slow": [0.0], "quick": [2.0]}
    assert scored.num_errors == 1


async def blocks_its_loop(prompts, responses):
    time.sleep(5)  # a sync sleep in a coroutine: nothing else runs on its loop meanwhile
    return [1.0] * len(responses)


def test_an_async_reward_that_blocks_its_loop_times_out_warned_about_once(caplog) -> None:
    from forge_lightning.run.user_code import warn_thread_abandoned

    rewards = [(blocks_its_loop, 1.0, "blocks"), (sleeper(0.0, 2.0), 1.0, "quick")]
    warn_thread_abandoned.cache_clear()  # once per process: from this test's first call on
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="forge_lightning.run.user_code"):
        with pytest.warns(UserWarning, match="took longer than reward_timeout=1s"):
            scored = score(CompositeReward(rewards), ["p"], ["a"], "zero", reward_timeout=1.0)
        with pytest.raises(RuntimeError, match="'blocks_its_loop' took longer than reward_timeout=1s"):
            score(blocks_its_loop, ["p"], ["a"], reward_timeout=1.0)
    assert time.monotonic() - start < 4.5, "a blocked loop was waited for (5 s each)"
    assert scored.components == {"blocks": [0.0], "quick": [2.0]} and scored.num_errors == 1
    warned = [r.getMessage() for r in caplog.records if "keeps running" in r.getMessage()]
    assert len(warned) == 1 and "reward_timeout" in warned[0] and "sandbox: process" in warned[0]


def wants_tool_calls(prompts, responses, tool_calls):
    return [float(len(calls)) for calls in tool_calls]


def wants_environments(prompts, completions, environments, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.integration
@pytest.mark.parametrize(
    "reward, needs", [(wants_tool_calls, "tool_calls"), (wants_environments, "environments")]
)
def test_a_reward_needing_a_tool_fact_in_a_run_without_tools_is_refused_before_generating(
    reward, needs, module, trainer, loader, tmp_path
) -> None:
    grpo = module(reward=reward, group_size=2, max_new_tokens=2)
    generated = []
    real = grpo.configure_model

    def counting_generations() -> None:
        real()
        sample = grpo.episodes.__call__
        grpo.episodes = lambda *args, **kwargs: generated.append(1) or sample(*args, **kwargs)

    grpo.configure_model = counting_generations
    settings = r"model\.tools, model\.environment_factory or model\.calculator"
    pattern = rf"needs {needs}.*only a run with tools.*{settings}"
    records = [{"prompt": "ab"}, {"prompt": "cd"}]
    with pytest.raises(ValueError, match=pattern):
        trainer(tmp_path, max_steps=1).fit(grpo, loader(records))
    with pytest.raises(ValueError, match=pattern):
        trainer(tmp_path).validate(grpo, loader(records))
    assert generated == []


@pytest.mark.integration
def test_trl_rewards_get_the_trainer_state_and_a_log_metric_that_logs_under_train(
    module, trainer, loader, tmp_path
) -> None:
    seen = []

    def curriculum(prompts, completions, trainer_state, log_metric, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.epoch, trainer_state.max_steps))
        log_metric("share_with_a", sum("a" in c for c in completions) / len(completions))
        log_metric("step_seen", trainer_state.global_step)
        return [float(trainer_state.global_step)] * len(completions)

    grpo = module(reward=curriculum, group_size=2, max_new_tokens=2, gradient_accumulation_steps=1)
    records = [{"prompt": "ab"}, {"prompt": "cd"}]
    logged = []

    class Metrics(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            logged.append(pl_module.last_step.metrics)

    trainer(tmp_path, max_steps=2, callbacks=[Metrics()]).fit(grpo, loader(records))
    assert seen == [(0, 0.0, 2), (1, 0.5, 2)]
    assert [m["train/step_seen"] for m in logged] == [0.0, 1.0]
    assert all(0.0 <= m["train/share_with_a"] <= 1.0 for m in logged)


@pytest.mark.integration
def test_log_metric_refuses_a_name_the_module_logs_itself(module, trainer, loader, tmp_path) -> None:
    def shadows(prompts, completions, log_metric, **kwargs):
        log_metric("kl", 1.0)
        return [0.0] * len(completions)

    grpo = module(reward=shadows, group_size=2, max_new_tokens=2)
    with pytest.raises(
        ValueError, match=r"log_metric\('kl', \.\.\.\).*train/kl is a metric the module logs itself"
    ):
        trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "ab"}]))


@pytest.mark.integration
def test_a_reward_that_needs_log_extra_is_refused_by_name_and_one_that_may_take_it_is_warned(
    module, trainer, loader, tmp_path
) -> None:
    def needs_columns(prompts, completions, log_extra, **kwargs):
        return [0.0] * len(completions)

    def may_log_columns(prompts, completions, log_extra=None, **kwargs):
        if log_extra:
            log_extra("golden", list(completions))
        return [0.0] * len(completions)

    records = [{"prompt": "ab"}]
    with pytest.raises(ValueError, match=r"'needs_columns' needs log_extra.*not supported"):
        trainer(tmp_path, max_steps=1).fit(module(reward=needs_columns, group_size=2), loader(records))
    with pytest.warns(UserWarning, match=r"'may_log_columns' takes log_extra.*not supported.*log_metric"):
        trainer(tmp_path, max_steps=1).fit(
            module(reward=may_log_columns, group_size=2, max_new_tokens=2), loader(records)
        )


@pytest.mark.integration
def test_log_metric_in_validation_is_logged_under_val(module, trainer, loader, tmp_path) -> None:
    def counts_b(prompts, completions, trainer_state, log_metric, **kwargs):
        log_metric("share_with_b", sum("b" in c for c in completions) / len(completions))
        return [0.0] * len(completions)

    grpo = module(reward=counts_b, max_new_tokens=2)
    (results,) = trainer(tmp_path).validate(grpo, loader([{"prompt": "ab"}, {"prompt": "cd"}]))
    assert 0.0 <= results["val/share_with_b"] <= 1.0
