"""Sampled evaluation: ``n`` completions per validation prompt besides the greedy one, and what
they say of the policy: mean@n, pass@k, maj@k, how many prompts it always or never solves.

A sample is right when its accuracy score is at least 0.5 (the accuracy check scores 1 when right);
mean@n is the mean of the scores themselves, so it is ``val/accuracy`` of sampled completions.

maj@k is the expected correctness of a majority vote over ``k`` of the ``n`` samples, taken over
every one of the C(n, k) subsets. A sample votes for its answer key (``answer_key(completion)``);
a key of None (no answer) never wins, and a subset of such samples alone scores 0. Ties go to the
key whose first sample comes earliest among the ``n`` (the order the answers file keeps). A key is
right when its first sample is (with GSM8K's check every sample of a key agrees). The expectation
is exact for every ``n``: it counts the subsets each right key wins from the keys' multiplicities
(:func:`majority_at`), at a cost of about ``n`` small polynomial products per distinct key.

Evaluation leaves training alone: the samples are drawn under a forked torch RNG seeded from
(seed, step, batch, rank), the seed being ``seed_everything``'s (``PL_GLOBAL_SEED``, else 0), and
:class:`TrainingRandomState` puts back the RNG state a fit had before its validation (Lightning's
validation loader draws a seed from it for each pass).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from forge_lightning.evaluation.validation import answer_facts, score_accuracy
from forge_lightning.reporting.metrics import RunningMetrics
from forge_lightning.rewards.calls import RewardCalls
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.types import Rollout
from forge_lightning.run.fit import FitShape

AnswerKey = Callable[[str], Hashable]


def report_ks(n: int) -> list[int]:
    """The k of pass@k and maj@k: 1, 2, 4, ... up to ``n``, and ``n`` itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if not n or ks[-1] == n else [*ks, n]


def sampled_keys(n: int) -> tuple[str, ...]:
    """The ``val/`` metrics a sampled evaluation of ``n`` completions per prompt logs (none for 0)."""
    if n <= 0:
        return ()
    per_k = [f"{kind}@{k}" for kind in ("pass", "maj") for k in report_ks(n)]
    return (f"mean@{n}", *per_k, "frac_all_correct", "frac_none_correct", *SAMPLED_LENGTH_KEYS)


SAMPLED_LENGTH_KEYS = ("sampled_completion_length", "sampled_truncated_fraction")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``c`` right samples among ``n``: 1 - C(n-c, k) / C(n, k), computed
    as 1 - prod_{i=n-c+1..n} (1 - k/i), which neither overflows nor cancels (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _capped_binomial(m: int, cap: int) -> np.ndarray:
    """``sum_{x=0..min(m, cap)} C(m, x) z^x``: the ways to draw x of a key's m samples."""
    return np.array([math.comb(m, x) for x in range(min(m, cap) + 1)], dtype=np.float64)


def majority_at(keys: Sequence[Hashable | None], right: Sequence[bool], ks: Sequence[int]) -> list[float]:
    """maj@k for each k of ``ks``: over every k-subset of the samples (``keys[i]``, ``right[i]``),
    whether its most frequent key (ties: the key seen first; None never wins) is right.

    A right key ``a`` drawn ``t`` times wins when every key seen before it is drawn at most t-1
    times and every later key at most t: the subsets are the coefficient of z^(k-t) in
    C(m_a, t) (1+z)^m_none prod_earlier P(m_b, t-1) prod_later P(m_b, t), P being
    :func:`_capped_binomial`. One product per (a, t) answers every k at once."""
    n = len(keys)
    counts: dict[Hashable, int] = {}
    key_right: dict[Hashable, bool] = {}
    for key, ok in zip(keys, right):
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
            key_right.setdefault(key, bool(ok))
    order = list(counts)  # first-appearance order
    unanswered = np.array([math.comb(n - sum(counts.values()), x) for x in range(n + 1)], dtype=np.float64)
    unanswered = np.trim_zeros(unanswered, "b")
    won = np.zeros(n + 1)  # won[k]: the k-subsets a right key wins
    for a, key in enumerate(order):
        if not key_right[key]:
            continue
        for t in range(1, counts[key] + 1):
            poly = unanswered
            for b, other in enumerate(order):
                if b != a:
                    poly = np.convolve(poly, _capped_binomial(counts[other], t - 1 if b < a else t))
            ways = math.comb(counts[key], t)
            for k in range(t, n + 1):
                if k - t < len(poly):
                    won[k] += ways * poly[k - t]
    return [float(won[k] / math.comb(n, k)) for k in ks]


def prompt_metrics(
    scores: Sequence[float], keys: Sequence[Hashable | None] | None, ks: Sequence[int]
) -> dict[str, float]:
    """One prompt's mean@n, pass@k and (given its samples' answer keys) maj@k for each k of
    ``ks``, and whether all or none of its ``n`` samples are right."""
    n = len(scores)
    right = [s >= 0.5 for s in scores]
    c = sum(right)
    out = {f"mean@{n}": sum(scores) / n}
    out.update({f"pass@{k}": pass_at_k(n, c, k) for k in ks})
    if keys is not None:
        out.update({f"maj@{k}": v for k, v in zip(ks, majority_at(keys, right, ks))})
    out["frac_all_correct"] = float(c == n)
    out["frac_none_correct"] = float(c == 0)
    return out


def sampling_seed(seed: int, step: int, batch_idx: int, rank: int) -> int:
    """A seed for one validation batch's samples, from the run's seed and where the batch is."""
    return int(np.random.SeedSequence([seed, step, batch_idx, rank]).generate_state(1)[0])


@contextmanager
def forked_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's RNG (CPU, and ``device`` when it is a GPU) for the block and put it back after:
    HF generate samples from the global RNG, which training's sampling uses too."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class TrainingRandomState:
    """The torch RNG state (CPU and the training GPU) as it was before a fit's validation, to put
    back after it, so that a run validates without its training drawing other numbers: the
    validation loader draws a seed for each pass (sampled or greedy alike)."""

    def __init__(self) -> None:
        self._state: tuple[Tensor, Tensor | None, torch.device] | None = None

    def save(self, device: torch.device) -> None:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._state = (torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        if self._state is not None:
            cpu, cuda, device = self._state
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)

    def clear(self) -> None:
        self._state = None


def _as_data(key: Hashable | None) -> Any:
    """A key as the answers file can hold it (JSON), its repr when it is no JSON value."""
    return key if key is None or isinstance(key, (str, int, float, bool)) else repr(key)


@dataclass
class SampledEvaluation:
    """``num_generations`` sampled completions per validation prompt (none when 0), drawn with
    ``params``, scored by the accuracy check and voted on by ``answer_key`` (None: no maj@k)."""

    num_generations: int
    params: SamplingParams
    answer_key: AnswerKey | None

    def sample(
        self,
        sampler: Callable[..., Rollout],
        model: Any,
        prompts: list[Any],
        batch_kwargs: dict[str, list[Any]],
        seed: int,
    ) -> Rollout | None:
        """The batch's ``n`` completions per prompt (None when n = 0), drawn by ``sampler`` (the
        module's episode runner, tools and all) under a torch RNG forked and seeded with ``seed``."""
        if self.num_generations <= 0:
            return None
        with forked_rng(seed, next(model.parameters()).device):
            return sampler(model, prompts, self.params, group_size=self.num_generations, rows=batch_kwargs)

    def score(
        self,
        rollout: Rollout | None,
        prompts: list[Any],
        batch_kwargs: dict[str, list[Any]],
        answers: list[dict[str, Any]],
        accuracy: Any,
        calls: RewardCalls,
        metrics: RunningMetrics,
    ) -> list[dict[str, Any]]:
        """The batch's greedy ``answers``, each with its prompt's ``samples`` from ``rollout``
        (completion, key, correct, completion_length, truncated; with tools, tool_calls), and
        their metrics into ``metrics``; ``accuracy`` scores them where the batch has references."""
        if rollout is None:
            return answers
        n = self.num_generations
        metrics.update("sampled_completion_length", rollout.completion_lengths.float())
        metrics.update("sampled_truncated_fraction", rollout.truncation.float())
        scores = None
        if "references" in batch_kwargs:
            scores = score_accuracy(accuracy, prompts, rollout, batch_kwargs, calls).tolist()
        keys = [self.answer_key(c) for c in rollout.completions] if self.answer_key is not None else None
        out = []
        for p, answer in enumerate(answers):
            rows = range(p * n, (p + 1) * n)
            if scores is not None:
                own_keys = None if keys is None else [keys[i] for i in rows]
                metrics.add(prompt_metrics([scores[i] for i in rows], own_keys, report_ks(n)))
            samples = [_sample(rollout, i, keys, scores) for i in rows]
            out.append({**answer, "samples": samples})
        return out


def _sample(
    rollout: Rollout, i: int, keys: list[Hashable | None] | None, scores: list[float] | None
) -> dict[str, Any]:
    """Sampled completion ``i`` as the answers file holds it."""
    entry: dict[str, Any] = {"completion": rollout.completions[i]}
    if keys is not None:
        entry["key"] = _as_data(keys[i])
    if scores is not None:
        entry["correct"] = float(scores[i])
    return {**entry, **answer_facts(rollout, i)}


def batch_sizes(fit: FitShape) -> tuple[int | None, int | None]:
    """The prompts of a training and of a validation batch, from the datamodule's settings
    (``prompts_per_step``, ``val_batch_size``) or else the loaders Lightning has loaded; None where
    unknown."""
    return (
        fit.prompts_per_batch or fit.train_loader_batch_size,
        fit.val_batch_size or fit.val_loader_batch_size,
    )


def run_seed() -> int:
    """The run's seed, as ``seed_everything`` recorded it (0 when none was set)."""
    try:
        return int(os.environ.get("PL_GLOBAL_SEED", "0"))
    except ValueError:
        return 0
