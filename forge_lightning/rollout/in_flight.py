"""What the asynchronous pipeline (rollout/sources.py's AsyncRollouts) keeps of a batch between
handing it to the rollout servers (serving/) and training it: :class:`InFlight`, the batch and,
once back, its :class:`Finished` result (the completions, the log-probs they were sampled with, the
version that sampled them); the batches in flight as plain data for a checkpoint and back; each
batch's sampling seed (:func:`rollout_seed`); and the split of this machine's CPU threads between
the trainer and a server it starts beside itself (:func:`split_threads`).

Its old paths, ``forge_lightning.rollout.in_flight`` and ``forge_lightning.async_rollout`` (the
in-process rollout worker's module, which the ``local:1`` server replaced), still import
(_moved.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from forge_lightning.rollout.types import Rollout


def rollout_seed(seed: int, index: int) -> int:
    """The sampling seed of the ``index``-th batch handed to the servers in a run seeded ``seed``."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class Finished:
    """A batch's result: the completions, their log-probs under the version that sampled them (the
    oldest, where a weight update landed while they were sampled), and the trainer's wait for it."""

    completion_ids: Tensor  # (P*G, Lc)
    behav_logp: Tensor | None  # (P*G, Lc)
    version: int
    trainer_wait_s: float = 0.0  # the trainer blocked in collect for it
    # A tool-using batch's whole rollout as its tool loop made it (its prompts, model mask,
    # calls and transcripts), on the CPU, without log-probs or environments; None for the others.
    rollout: Rollout | None = None
    # (P*G,) each row's length as the engine reports it, where stop strings end rows (an engine
    # that applies them: the rollout servers); None: each row ends at its first EOS.
    ends: Tensor | None = None


@dataclass
class InFlight:
    """A training batch handed to the servers: the batch as Lightning gave it (every key travels
    with its rollout), its index in the run, its ticket, its encoded prompts and, when back, the
    servers' result (sources.AsyncRollouts builds the rollout from it)."""

    prompts: list[Any]
    batch_kwargs: dict[str, list[Any]]
    batch_idx: int
    index: int = -1
    ticket: int | None = None
    prompt_ids: Tensor | None = None
    prompt_mask: Tensor | None = None
    finished: Finished | None = None


def saved_in_flight(items: Any) -> list[dict[str, Any]]:
    """Finished in-flight batches as plain data, for a checkpoint (``weights_only`` loads it)."""
    saved = []
    for item in items:
        assert item.finished is not None, "collect every in-flight rollout before saving"
        saved.append(
            {
                "prompts": item.prompts,
                "batch_kwargs": item.batch_kwargs,
                "batch_idx": item.batch_idx,
                "index": item.index,
                "prompt_ids": None if item.prompt_ids is None else item.prompt_ids.cpu(),
                "prompt_mask": None if item.prompt_mask is None else item.prompt_mask.cpu(),
                "completion_ids": item.finished.completion_ids,
                "behav_logp": item.finished.behav_logp,
                "version": item.finished.version,
                "rollout": _fields(item.finished.rollout),
                "ends": item.finished.ends,
            }
        )
    return saved


def restored_in_flight(saved: list[dict[str, Any]]) -> list[InFlight]:
    """The in-flight batches :func:`saved_in_flight` kept, finished."""
    return [
        InFlight(
            prompts=d["prompts"],
            batch_kwargs=d["batch_kwargs"],
            batch_idx=d["batch_idx"],
            index=d["index"],
            prompt_ids=d["prompt_ids"],
            prompt_mask=d["prompt_mask"],
            finished=Finished(
                d["completion_ids"],
                d["behav_logp"],
                d["version"],
                rollout=None if d.get("rollout") is None else Rollout(**d["rollout"]),
                ends=d.get("ends"),
            ),
        )
        for d in saved
    ]


def _fields(rollout: Rollout | None) -> dict[str, Any] | None:
    """A rollout as plain data (a checkpoint's ``weights_only`` load takes no dataclass)."""
    return None if rollout is None else {f.name: getattr(rollout, f.name) for f in fields(rollout)}


def split_threads(total: int, worker: int | None) -> tuple[int, int]:
    """(trainer, server) CPU threads out of ``total``: the server's ``worker`` (None: half), the
    trainer the rest, each at least 1."""
    worker = max(1, total // 2) if worker is None else worker
    return max(1, total - worker), worker
