"""Dynamic sampling (DAPO): optimizer steps built from informative groups only.

A group whose rewards are all equal has zero advantages and so no policy gradient: a step made of
such groups is wasted. With dynamic sampling each ``training_step`` is one sampling round over
the batch Lightning hands it (the data position counts every batch drawn, used or dropped, so a
resumed run draws the same ones): its informative groups are backpropagated at once and the others
dropped. The optimizer steps once the informative groups gathered since the last step, over every
rank, reach ``world_size x prompts per batch x batches per optimizer step``, or after
``max_sampling_rounds`` rounds (training then goes on with what there is, and says so), or at the
end of the epoch. Surplus groups of the last round stay in that step; none is carried over. With
a KL penalty a dropped group also loses its KL gradient. A step with no informative group at all
still calls ``optimizer.step()`` with every gradient None (AdamW then changes nothing, not even by
weight decay) so that ``global_step`` and the schedule advance; it is counted in
``train/empty_steps``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from forge_lightning.training.context import Reduce


@dataclass
class SamplingRounds:
    """The rounds of the optimizer step in progress, counted over every rank."""

    max_rounds: int
    rounds: int = 0
    gathered: int = 0
    dropped: int = 0

    def add(self, informative: int, dropped: int) -> None:
        """One more round, with its informative and dropped groups (summed over the ranks)."""
        self.rounds += 1
        self.gathered += informative
        self.dropped += dropped

    def add_round(self, keep: Tensor, reduce: Reduce, *, target: int, last_batch: bool) -> bool:
        """Count a round's informative groups (``keep``, (P,) bool) and dropped ones over every rank
        (``reduce``: every rank calls this each round); whether it ends the step."""
        counts = torch.tensor([float(keep.sum()), float((~keep).sum())], device=keep.device)
        informative, dropped = reduce(counts, "sum").tolist()
        self.add(int(informative), int(dropped))
        return self.should_step(target, last_batch)

    @staticmethod
    def backward_calls_missing(made: int, reduce: Reduce, device: torch.device) -> int:
        """How many backward passes fewer than the most any rank makes this round (the ranks
        train different numbers of micro-batches, or none): each must still join DDP's all-reduce
        of every one, with a zero-weight backward. Call it before any backward of the round, so
        that every rank issues its collectives in the same order."""
        most = reduce(torch.tensor(float(made), device=device), "max")
        return int(most) - made

    def should_step(self, target: int, last_batch: bool) -> bool:
        """Whether this round ends the optimizer step (warning when it ends short of ``target``)."""
        if self.gathered >= target or last_batch:
            return True
        if self.rounds >= self.max_rounds:
            warnings.warn(
                f"dynamic sampling: {self.gathered} informative group(s) of {target} after "
                f"{self.rounds} rounds (max_sampling_rounds); stepping with what there is",
                stacklevel=2,
            )
            return True
        return False

    def pop(self) -> dict[str, float]:
        """The finished step's counts, for the metrics; then a fresh step."""
        counts = {
            "sampling_rounds": float(self.rounds),
            "groups_dropped": float(self.dropped),
            "empty_steps": float(self.gathered == 0),
        }
        self.rounds = self.gathered = self.dropped = 0
        return counts
