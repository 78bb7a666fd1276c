"""A seeded, rank-aware, resumable sampler for prompt datasets."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler


class EpochShuffleSampler(DistributedSampler):
    """Indices ``0..num_samples-1``, reshuffled each epoch from ``seed + epoch``.

    - Any epoch's order can be reproduced on its own (Lightning calls :meth:`set_epoch` at the
      start of every epoch).
    - With ``num_replicas`` > 1 each rank takes every ``num_replicas``-th index of the epoch's
      order (padded by wrapping around so every rank gets the same number of prompts: ranks that
      ran out early would leave the others waiting in a collective). It subclasses
      ``DistributedSampler`` so Lightning keeps it instead of wrapping it in another one.
    - :meth:`resume_at` skips the samples of an epoch that were already trained on, so a resumed
      run sees exactly the prompts an uninterrupted one would have seen next.
    """

    def __init__(
        self, num_samples: int, seed: int = 42, shuffle: bool = True, num_replicas: int = 1, rank: int = 0
    ) -> None:
        # DistributedSampler.__init__ wants a dataset and a process group; neither is needed here.
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas), got {rank=} and {num_replicas=}")
        self.dataset_size = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = False
        self.epoch = 0
        self.num_samples = math.ceil(num_samples / num_replicas) if num_samples else 0
        self.total_size = self.num_samples * num_replicas
        self._skip_epoch: int | None = None
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, consumed: int) -> None:
        """Skip this rank's first ``consumed`` samples the next time ``epoch`` is iterated."""
        self._skip_epoch, self._skip = epoch, consumed

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        if order and len(order) < self.total_size:
            order += (order * math.ceil(self.total_size / len(order)))[: self.total_size - len(order)]
        mine = order[self.rank : self.total_size : self.num_replicas]
        if self._skip_epoch == self.epoch:
            mine = mine[self._skip :]
            self._skip_epoch, self._skip = None, 0  # later epochs start from their beginning
        return iter(mine)

    def __len__(self) -> int:
        # The full epoch's length even when resuming mid-epoch: Lightning counts batches from the
        # restored position, so the epoch still ends where it would have.
        return self.num_samples
