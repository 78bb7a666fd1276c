"""What comes back from the servers as rows: a request's prompts unpadded for the wire, the
answers of its shares put back in the prompts' order, and the rows padded as an engine's
``Completions`` (or the async pipeline's ``Finished``) hold them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from forge_lightning.rollout.engines.base import Completions
from forge_lightning.serving.wire import GenerateAnswer


@dataclass
class Sampled:
    """What the servers sampled for a request, rows in the request's order (P*G, groups
    contiguous), unpadded as they came: ids, the log-prob each was sampled with (when asked), and
    the weight version that sampled each."""

    ids: list[list[int]]
    logp: list[list[float]] | None
    versions: list[list[int]]

    def completions(self, pad_token_id: int, device: torch.device) -> Completions:
        """The rows right-padded with ``pad_token_id`` as one engine's ``Completions``; ``ends``
        is each row's length (through its EOS, or the token that completed a string that ends it)."""
        ends = torch.tensor([len(row) for row in self.ids], dtype=torch.long, device=device)
        ids = padded(self.ids, pad_token_id, torch.long).to(device)
        logp = None if self.logp is None else padded(self.logp, 0.0, torch.float32).to(device)
        return Completions(ids, ends=ends, logp=logp)

    @property
    def oldest_version(self) -> int:
        """The oldest weights that sampled a token of the request (-1 for no token at all)."""
        return min((v for row in self.versions for v in row), default=-1)


def padded(rows: Sequence[Sequence[float]], fill: float, dtype: torch.dtype) -> Tensor:
    """(N, longest) ``rows`` right-padded with ``fill``."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def unpadded_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> list[list[int]]:
    """Each left-padded prompt row's tokens, as the servers take them."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]


def rows_by_prompt(
    part: list[int], answer: GenerateAnswer, copies: int
) -> dict[int, tuple[list[list[int]], list[list[float]] | None, list[list[int]]]]:
    """An answer's rows, ``copies`` (the group's size) per prompt of ``part``, by prompt index."""
    if len(answer.completions) != len(part) * copies:
        raise RuntimeError(
            f"a rollout server answered {len(answer.completions)} rows for {len(part)} prompts of "
            f"{copies}: it does not speak this trainer's protocol"
        )
    out = {}
    for k, index in enumerate(part):
        rows = slice(k * copies, (k + 1) * copies)
        logp = None if answer.logp is None else answer.logp[rows]
        out[index] = (answer.completions[rows], logp, answer.versions[rows])
    return out


def joined(answered: dict[int, Any], prompts: int, logprobs: bool) -> Sampled:
    """The rows of every prompt, in the prompts' order."""
    ids, logp, versions = [], [] if logprobs else None, []
    for index in range(prompts):
        rows, row_logp, row_versions = answered[index]
        ids += rows
        versions += row_versions
        if logp is not None:
            logp += row_logp if row_logp is not None else [[0.0] * len(r) for r in rows]
    return Sampled(ids, logp, versions)
