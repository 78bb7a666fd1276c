"""Micro-batches of a rollout: by count, or packed by a token budget (rollout/micro_batches.py)."""

from __future__ import annotations

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
