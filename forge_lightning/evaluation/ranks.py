"""Each validation prompt counted once over the ranks of a distributed run.

Lightning gives a distributed validation a ``DistributedSampler``, which repeats the first prompts
of the dataset so that every rank gets as many (ranks that ran out would leave the others waiting
in a collective: a sharded policy's generate gathers weights from every rank). The repeats are the
last rows of a rank's share. Every rank samples its whole share, repeats included, so that the
ranks stay in step; only the rows it owns count in its metrics and answers
(:class:`ValidationRows`), and rank 0 writes every rank's answers in the dataset's order
(:func:`gathered_answers`). A loader whose sampler is not a ``DistributedSampler`` (a user's own,
with ``use_distributed_sampler=False``) is taken to give each rank prompts of its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from forge_lightning.rollout.types import Rollout


def owned_samples(loaders: Any, world_size: int) -> int | None:
    """How many of this rank's validation samples (from ``loaders``, Lightning's
    ``val_dataloaders``) are its own (the rest repeat other ranks' prompts); None when all are."""
    loader = loaders[0] if isinstance(loaders, (list, tuple)) and loaders else loaders
    sampler = getattr(loader, "sampler", None)
    if world_size == 1 or not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    size = getattr(sampler, "dataset_size", None)  # EpochShuffleSampler counts without a dataset
    size = len(sampler.dataset) if size is None else size
    if size < sampler.num_replicas:
        raise ValueError(
            f"validation has {size} prompt(s) for {sampler.num_replicas} ranks: every rank needs one "
            "of its own (the sampler would hand some ranks repeats only). Validate on more prompts "
            "or on fewer devices"
        )
    # The sampler's order is padded at its end and dealt out rank by rank: position r + i * W.
    return len(range(sampler.rank, size, sampler.num_replicas))


class ValidationRows:
    """Counts a rank's validation rows as they come, and says how many of each batch it owns."""

    def __init__(self) -> None:
        self.owned: int | None = None
        self.seen = 0

    def start(self, owned: int | None) -> None:
        """A new epoch: this rank owns its first ``owned`` rows (:func:`owned_samples`; None: all)."""
        self.owned, self.seen = owned, 0

    def take(self, rows: int) -> int:
        """How many of the next ``rows`` rows (the first ones) this rank owns."""
        own = rows if self.owned is None else max(0, min(rows, self.owned - self.seen))
        self.seen += rows
        return own


def own_rows(
    own: int, prompts: list[Any], batch_kwargs: dict[str, list[Any]], *rollouts: Rollout | None
) -> tuple[list[Any], dict[str, list[Any]], list[Rollout | None]]:
    """The batch's first ``own`` prompts, their columns and each rollout's groups of them."""
    if own == len(prompts):
        return prompts, batch_kwargs, list(rollouts)
    columns = {key: values[:own] for key, values in batch_kwargs.items()}
    kept = []
    for rollout in rollouts:
        if rollout is not None:
            keep = torch.arange(len(prompts), device=rollout.prompt_ids.device) < own
            rollout = rollout.select_groups(keep)
        kept.append(rollout)
    return prompts[:own], columns, kept


def gathered_answers(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's answers on rank 0, in the order of the sampler's positions (rank r's i-th at
    r + i * W: the dataset's order for Lightning's unshuffled validation sampler); elsewhere this
    rank's own. Every rank must call it."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return answers
    shares: list[list[dict[str, Any]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, answers)
    if dist.get_rank() != 0:
        return answers
    longest = max(len(share or []) for share in shares)
    return [share[i] for i in range(longest) for share in shares if share and i < len(share)]
