"""Rollouts built by hand: random tokens with completions of mixed lengths and padded prompts."""

from __future__ import annotations

import torch


def mixed_rollout(
    vocab_size: int, ends: list[int], prompt_lengths: list[int], group_size: int, seed: int = 0
):
    """A rollout of random tokens whose completion ``i`` ends with an EOS (id 1) at column
    ``ends[i] - 1`` (none where ``ends[i]`` is the width, ``max(ends)``): completions of mixed
    lengths, and left-padded prompts of ``prompt_lengths`` tokens."""
    from forge_lightning.rollout.types import Rollout, completion_mask

    generator = torch.Generator().manual_seed(seed)
    width, prompt_width = max(ends), max(prompt_lengths)
    completions = torch.randint(4, vocab_size, (len(ends), width), generator=generator)
    for row, end in enumerate(ends):
        if end < width:
            completions[row, end - 1] = 1
    prompt_mask = torch.tensor([[0] * (prompt_width - n) + [1] * n for n in prompt_lengths])
    prompt_ids = torch.randint(4, vocab_size, prompt_mask.shape, generator=generator) * prompt_mask
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completions,
        completion_mask=completion_mask(completions, [1]),
        group_size=group_size,
        completions=[""] * len(ends),
    )
