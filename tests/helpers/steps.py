"""One training batch without a Trainer: two prompts, their completions, and a torch optimizer."""

from __future__ import annotations

import torch

from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.rollout.types import Rollout, completion_mask
from helpers.models import make_tokenizer

PROMPTS = ["ab", "ba"]

COMPLETIONS = ["aaaa", "bbbb", "abab", "aaab"]  # two per prompt: each group's rewards differ


def a_rollout() -> Rollout:
    tok = make_tokenizer()
    prompt_ids = torch.tensor([tok.encode(p) for p in PROMPTS])  # (P, Lp), no padding needed
    completion_ids = torch.tensor([tok.encode(c) + [tok.eos_token_id] for c in COMPLETIONS])  # (P*G, Lc)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids,
        completion_mask=completion_mask(completion_ids, [tok.eos_token_id]),
        group_size=2,
        completions=list(COMPLETIONS),
    )


def a_batch(batch_idx: int = 0) -> TrainingBatch:
    return TrainingBatch(PROMPTS, {}, batch_idx, a_rollout())


def optimizer_of(
    model: torch.nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
