"""Validation of the policy, one batch at a time: each prompt's greedy completion (and, with
sampled validation, n sampled ones) scored into the validation metrics, and every answer
kept for the answers file. The module hands it each validation batch; it never sees a Trainer."""

from __future__ import annotations

from typing import Any

from forge_lightning.evaluation.ranks import ValidationRows, own_rows
from forge_lightning.evaluation.sampled import SampledEvaluation
from forge_lightning.evaluation.validation import check_validation_arguments, score_validation
from forge_lightning.reporting.metrics import RunningMetrics
from forge_lightning.rewards.calls import RewardCalls
from forge_lightning.rewards.extras import RewardExtras
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.types import Rollout


class Evaluator:
    """Scores validation batches and keeps their answers.

    Args:
        reward: the training reward, logged as ``val/reward``.
        accuracy: the correctness check (``val/accuracy``) where a batch has references.
        greedy: the sampling of the greedy completions.
        sampled: the sampled evaluation (mean@n, pass@k, maj@k), or one that samples nothing.
        calls: how the rewards are called (what a reward error does, its time limit, the sandbox).
        metrics: the running validation metrics.
    """

    def __init__(
        self,
        reward: Any,
        accuracy: Any,
        greedy: SamplingParams,
        sampled: SampledEvaluation,
        calls: RewardCalls,
        metrics: RunningMetrics,
    ) -> None:
        self.reward, self.accuracy, self.greedy, self.sampled = reward, accuracy, greedy, sampled
        self.calls, self.metrics = calls, metrics
        # This rank's answers since the epoch began: one dict per prompt (prompt, completion,
        # reference, reward, correct, completion_length, truncated); RewardLogger writes them.
        self.samples: list[dict[str, Any]] = []
        self.rows = ValidationRows()  # which validation rows this rank counts

    def start(self, owned: int | None) -> None:
        """A validation epoch begins; ``owned``: how many of its rows this rank counts (None: all)."""
        self.samples = []
        self.rows.start(owned)

    def batch(
        self,
        sampler: Any,
        model: Any,
        prompts: list[Any],
        batch_kwargs: dict[str, list[Any]],
        seed: int,
        extras: RewardExtras,
        with_tools: bool,
        first: bool,
    ) -> None:
        """Sample and score one batch (``first``: the epoch's first, whose columns are checked
        against what the reward and the accuracy check need; ``seed``: the sampled completions')."""
        if first:
            check_validation_arguments(self.reward, self.accuracy, batch_kwargs, with_tools)
        greedy: Rollout = sampler(model, prompts, self.greedy, group_size=1, rows=batch_kwargs)
        sampled = self.sampled.sample(sampler, model, prompts, batch_kwargs, seed)
        # Under DDP/FSDP the last rows of a rank's share may repeat other ranks' prompts: sampled
        # with the rest, to keep the ranks in step, but counted by their own rank only.
        own = self.rows.take(len(prompts))
        if own == 0:
            return
        prompts, batch_kwargs, (greedy, sampled) = own_rows(own, prompts, batch_kwargs, greedy, sampled)
        answers = score_validation(
            self.reward, self.accuracy, prompts, greedy, batch_kwargs, self.calls, self.metrics, extras
        )
        self.samples += self.sampled.score(
            sampled, prompts, batch_kwargs, answers, self.accuracy, self.calls, self.metrics
        )

    def values(self) -> dict[str, Any]:
        """The epoch's metrics under their logged names (``val/...``), and a new epoch's count."""
        return {f"val/{key}": value for key, value in self.metrics.pop().items()}
