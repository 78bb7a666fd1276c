"""Micro-batches of a rollout: by count, or packed by a token budget (rollout/micro_batches.py)."""

from __future__ import annotations

import itertools
import random

import pytest
from helpers.rollouts import mixed_rollout

from forge_lightning.rollout.micro_batches import padding_fraction, plan_micro_batches

# 4 prompts x 3 completions of mixed lengths (a completion's end: its EOS column + 1).
ENDS = [12, 3, 7, 12, 2, 5, 9, 4, 1, 6, 12, 3]
PROMPTS = [5, 2, 8, 3]


def rows_of(batches) -> list[list[int]]:
    return [b.rows.tolist() for b in batches]


def test_a_token_budget_packs_the_longest_together_and_pads_none_where_lengths_pair_up():
    # One-token prompts; completions of 4, 1, 4 and 1 tokens; 10 tokens hold two rows of 1 + 4.
    rollout = mixed_rollout(20, [4, 1, 4, 1], [1, 1, 1, 1], group_size=1)
    batches = plan_micro_batches(rollout, tokens=10)
    assert rows_of(batches) == [[0, 2], [1, 3]]
    assert [(b.prompt_width, b.completion_width) for b in batches] == [(1, 4), (1, 1)]
    assert padding_fraction(batches, rollout) == 0.0
    # Two rows at a time in order: each micro-batch pads a 1-token completion to 4 tokens.
    by_count = plan_micro_batches(rollout, size=2)
    assert rows_of(by_count) == [[0, 1], [2, 3]]
    assert padding_fraction(by_count, rollout) == pytest.approx(1 - 14 / 20)


@pytest.mark.parametrize("tokens", [30, 60, 150])
def test_every_row_once_within_the_budget_and_balanced(tokens):
    rollout = mixed_rollout(20, ENDS, PROMPTS, group_size=3)
    batches = plan_micro_batches(rollout, tokens=tokens)
    assert sorted(r for rows in rows_of(batches) for r in rows) == list(range(12))
    sizes = [len(b.rows) * (b.prompt_width + b.completion_width) for b in batches]
    assert all(size <= tokens for size in sizes)
    # Balanced: no smaller budget packs into as few micro-batches, and no row runs a column its
    # micro-batch's longest prompt or completion does not need.
    assert len(plan_micro_batches(rollout, tokens=max(sizes) - 1)) > len(batches)
    lengths, prompts = rollout.completion_mask.sum(1), rollout.prompt_mask.sum(1)
    for b in batches:
        assert b.completion_width == lengths[b.rows].max()
        assert b.prompt_width == prompts[b.rows // 3].max()
    same_count = plan_micro_batches(rollout, size=-(-12 // len(batches)))
    assert padding_fraction(batches, rollout) < padding_fraction(same_count, rollout)


def test_shared_prompts_pack_whole_groups_and_split_a_group_over_the_budget():
    # Group 0: a 3-token prompt and completions of 4 and 1 (3 + 2 x 4 = 11 tokens shared); group 1:
    # a 1-token prompt and two 1-token completions (1 + 2 x 1 = 3).
    rollout = mixed_rollout(20, [4, 1, 1, 1], [3, 1], group_size=2)
    batches = plan_micro_batches(rollout, tokens=11, shared=True)
    assert rows_of(batches) == [[0, 1], [2, 3]] and all(b.shared for b in batches)
    # With 8 tokens group 0 fits no more: its rows go apart (3 + 4, 3 + 1), unshared.
    batches = plan_micro_batches(rollout, tokens=8, shared=True)
    assert rows_of(batches) == [[0], [1], [2, 3]]
    assert [b.shared for b in batches] == [False, False, True]
    assert padding_fraction(batches, rollout) == 0.0


def test_single_rows_replace_shared_groups_where_they_run_fewer_tokens():
    # Two groups, each a 1-token prompt with completions of 8 and 1 tokens: shared, each group
    # runs 1 + 2 x 8 = 17 tokens (34 in all); rows of like length, 2 x 9 + 2 x 2 = 22.
    rollout = mixed_rollout(20, [8, 1, 8, 1], [1, 1], group_size=2)
    batches = plan_micro_batches(rollout, tokens=20, shared=True)
    assert rows_of(batches) == [[0, 2], [1, 3]] and not any(b.shared for b in batches)
    assert padding_fraction(batches, rollout) == 0.0


def test_a_token_budget_cuts_a_group_into_runs_of_like_lengths_each_running_its_prompt_once():
    # Two groups of 6 (prompts of 6 and 4 tokens), each with long completions (12) among short
    # ones (2-3): the long ones run apart from the short, each run with its group's prompt once.
    rollout = mixed_rollout(20, [12, 2, 12, 3, 2, 3, 12, 2, 3, 2, 2, 3], [6, 4], group_size=6)
    batches = plan_micro_batches(rollout, tokens=200, shared=True)
    assert rows_of(batches) == [[0, 2], [1, 3, 4, 5], [6], [7, 8, 9, 10, 11]]
    assert [b.share for b in batches] == [2, 4, 1, 5]
    assert [(b.prompt_width, b.completion_width) for b in batches] == [(6, 12), (6, 3), (4, 12), (4, 3)]
    # 6 + 2 x 12 + 6 + 4 x 3 + 4 + 12 + 4 + 5 x 3 = 83 tokens; whole groups 154, single rows 144.
    assert sum(b.tokens for b in batches) == 83
    assert sum(b.tokens for b in plan_micro_batches(rollout, size=6, shared=True)) == 154
    assert sum(b.tokens for b in plan_micro_batches(rollout, tokens=200)) == 144
    assert padding_fraction(batches, rollout) == pytest.approx(1 - 78 / 83)
    # A row cap cuts the runs too: at most 3 rows each.
    assert max(len(b.rows) for b in plan_micro_batches(rollout, size=3, tokens=200, shared=True)) == 3


@pytest.mark.parametrize("seed", range(6))
def test_the_runs_are_the_cuts_of_the_longest_first_rows_that_run_the_fewest_tokens(seed):
    # Against every way of cutting each group's rows, longest first, into consecutive runs.
    chance = random.Random(seed)
    ends = [chance.choice([1, 2, 3, 5, 8, 13, 20]) for _ in range(14)] + [20, 20]
    rollout = mixed_rollout(30, ends, [7, 3], group_size=8)
    planned = sum(b.tokens for b in plan_micro_batches(rollout, tokens=10_000, shared=True))
    lengths = rollout.completion_mask.sum(1).tolist()

    def fewest(rows: list[int], prompt: int) -> int:
        widths = sorted((lengths[r] for r in rows), reverse=True)
        best = prompt + len(widths) * widths[0]  # no cut
        for cuts in range(1, len(widths)):
            for at in itertools.combinations(range(1, len(widths)), cuts):
                edges = (0, *at, len(widths))
                best = min(best, sum(prompt + (b - a) * widths[a] for a, b in itertools.pairwise(edges)))
        return best

    # (Whole groups, 330 tokens or more, and single rows, 432, never run fewer here.)
    assert planned == fewest(list(range(8)), 7) + fewest(list(range(8, 16)), 3)


def test_by_count_micro_batches_are_consecutive_and_shared_when_they_hold_whole_groups():
    rollout = mixed_rollout(20, ENDS, PROMPTS, group_size=3)
    assert rows_of(plan_micro_batches(rollout)) == [list(range(12))]
    batches = plan_micro_batches(rollout, size=6, shared=True)
    assert rows_of(batches) == [list(range(6)), list(range(6, 12))]
    assert all(b.shared for b in batches)
    assert [b.shared for b in plan_micro_batches(rollout, size=4, shared=True)] == [False] * 3


def test_by_count_micro_batches_within_one_group_share_its_prompt_once_each():
    # 2 groups of 6 in micro-batches of 3: each holds half a group and runs its prompt once.
    rollout = mixed_rollout(20, ENDS, [5, 8], group_size=6)
    batches = plan_micro_batches(rollout, size=3, shared=True)
    assert rows_of(batches) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [b.share for b in batches] == [3, 3, 3, 3]
    assert [b.prompt_width for b in batches] == [5, 5, 8, 8]
    # Micro-batches of 4 cross the groups' border at rows 4-7: that one runs a prompt a row.
    assert [b.share for b in plan_micro_batches(rollout, size=4, shared=True)] == [4, 1, 4]
    assert [b.share for b in plan_micro_batches(rollout, size=3)] == [1, 1, 1, 1]  # no sharing asked


def test_a_row_cap_holds_with_a_token_budget():
    rollout = mixed_rollout(20, ENDS, PROMPTS, group_size=3)
    batches = plan_micro_batches(rollout, size=2, tokens=1000)
    assert len(batches) == 6 and all(len(b.rows) == 2 for b in batches)
    lengths = [int(rollout.completion_mask[b.rows].sum(1).max()) for b in batches]
    assert lengths == sorted(lengths, reverse=True)  # longest first
    assert padding_fraction(batches, rollout) < padding_fraction(plan_micro_batches(rollout, size=2), rollout)
