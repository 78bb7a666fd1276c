"""One backward pass of the GRPO loss over a rollout, micro-batch by micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning.grpo import (
    LossSettings,
    backward_weight,
    entropy_bonus,
    grpo_loss,
    kl_penalised_rewards,
    masked_mean,
    micro_batch_weight,
    step_count,
)
from forge_lightning.models.sharding import is_sharded
from forge_lightning.reporting.metrics import LOSS_STATS, add_micro_batch
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.micro_batches import MicroBatch, padding_fraction
from forge_lightning.rollout.types import Rollout
from forge_lightning.training.context import StepContext
from forge_lightning.training.dynamic_sampling import SamplingRounds


class LossPasses:
    """Backpropagates the loss over a rollout, each micro-batch's backward weighted so that the
    optimizer step, once it divides by the step's count (see grpo.backward_weight), has the
    gradient of the loss over all of the step's rollouts."""

    def __init__(self, scorer: LogProbScorer, loss: LossSettings, mask_truncated: bool) -> None:
        self.scorer = scorer
        self.loss = loss
        self.mask_truncated = mask_truncated  # completions cut at the length cap weigh nothing
        self.count = torch.zeros(())  # the optimizer step's loss normaliser so far (grpo.step_count)
        # The KL in the reward: the rollout whose sampling-policy and reference log-probs rewards_with_kl
        # took, and those, for fixed_log_probs to reuse rather than run the forwards again.
        self._reward_log_probs: tuple[Rollout, Tensor, Tensor] | None = None

    def take_count(self) -> Tensor:
        """The step's loss normaliser on this rank, and start the next step's at zero."""
        count, self.count = self.count, torch.zeros(())
        return count

    def fixed_log_probs(
        self, model: PreTrainedModel, reference: ReferenceSource | None, rollout: Rollout, passes: int
    ) -> tuple[Tensor | None, Tensor | None]:
        """The old policy's and the reference's log-probs, both fixed before any update of these
        ``passes``. With one pass the old policy is the policy itself, whose detached log-probs
        grpo_loss takes when old_logp is None: no extra forward. (It is also the proximal policy of
        a stale async rollout, whose sampling policy's log-probs, rollout.behav_logp, came with it.)"""
        taken, self._reward_log_probs = self._reward_log_probs, None
        if taken is not None and taken[0] is rollout:  # rewards_with_kl scored this rollout already
            _, sampled, ref_logp = taken
            return (sampled if passes > 1 else rollout.old_logp), ref_logp
        ref_logp = self.reference_log_probs(reference, rollout)
        old_logp = rollout.old_logp
        if old_logp is None and passes > 1:
            old_logp = self.scorer.log_probs_no_grad(model, rollout)
        return old_logp, ref_logp

    def rewards_with_kl(
        self, model: PreTrainedModel, reference: ReferenceSource | None, rollout: Rollout, rewards: Tensor
    ) -> Tensor:
        """The ``(P*G,)`` rewards the advantages are made of: ``rewards`` as they are, or with
        the KL in the reward each less the KL weight x its completion's KL between the sampling policy
        (``rollout.old_logp``, else the policy's, before any update) and the reference
        (grpo.kl_penalised_rewards); :meth:`fixed_log_probs` of this rollout reuses both."""
        if not self.loss.kl_in_reward or rollout.completion_ids.shape[0] == 0:
            return rewards
        ref_logp = self.reference_log_probs(reference, rollout)
        assert ref_logp is not None  # the KL in the reward needs a KL weight > 0 (LossSettings)
        sampled = rollout.old_logp
        if sampled is None:
            sampled = self.scorer.log_probs_no_grad(model, rollout)
        self._reward_log_probs = (rollout, sampled, ref_logp)
        mask = rollout.loss_mask(self.mask_truncated)
        return kl_penalised_rewards(
            rewards, sampled, ref_logp, mask, self.loss.kl_beta, self.loss.kl_estimator
        )

    def reference_log_probs(self, reference: ReferenceSource | None, rollout: Rollout) -> Tensor | None:
        """The reference's log-probs ``(P*G, Lc)``; None when no loss term reads them."""
        if not self.loss.needs_reference or rollout.completion_ids.shape[0] == 0:
            return None
        if reference is None:
            raise RuntimeError(
                f"kl_beta={self.loss.kl_beta} with loss_type={self.loss.loss_type!r} needs a reference "
                "model, but no ReferenceModel callback provided one; add "
                "forge_lightning.callbacks.ReferenceModel() to the trainer's callbacks or set kl_beta=0"
            )
        with reference.scope():
            return self.scorer.log_probs_no_grad(reference.model, rollout)

    def micro_batches(self, rollout: Rollout, model: PreTrainedModel) -> list[MicroBatch]:
        return self.scorer.micro_batches(rollout, model)

    def learns(self, advantages: Tensor, model: PreTrainedModel) -> bool:
        """Whether a micro-batch whose rows have ``advantages`` needs its backward: not where the
        loss is advantage-weighted (LossSettings.advantage_weighted) and every advantage is 0 (a
        group whose rewards are all equal), whose gradient is exactly 0. Its forward still runs,
        without gradients, for the metrics (the entropy, the loss's statistics). A sharded model
        (FSDP2) runs every backward: its forwards and backwards gather the weights, in the same
        order on every rank."""
        if not self.loss.advantage_weighted or is_sharded(model):
            return True
        return bool(advantages.ne(0).any())

    def backward_calls(self, rollout: Rollout, advantages: Tensor, model: PreTrainedModel) -> int:
        """The backward calls a pass over ``rollout`` makes: one per micro-batch that
        :meth:`learns`, and one zero-weight call where none does (the gradient then exists, zero,
        as the micro-batches' own backwards would have left it: AdamW's moments still move)."""
        batches = self.micro_batches(rollout, model)
        learning = sum(self.learns(advantages[batch.rows], model) for batch in batches)
        return learning + _zero_gradient_call(batches, learning)

    def backward_calls_missing(self, made: int, context: StepContext) -> int:
        """Zero-weight backward calls this rank must add to match the others' all-reduces: with a
        token budget each rank packs its rollout into its own number of micro-batches, and with an
        advantage-weighted loss each skips the backward of its own zero-advantage micro-batches."""
        differs = self.scorer.micro_batch_tokens is not None or self.loss.advantage_weighted
        if not differs or context.world_size == 1:
            return 0
        return SamplingRounds.backward_calls_missing(made, context.reduce, context.device)

    def backward(
        self,
        model: PreTrainedModel,
        rollout: Rollout,
        advantages: Tensor,
        old_logp: Tensor | None,
        ref_logp: Tensor | None,
        backward: Callable[[Tensor], Any],
        profile: Callable[[str], Any],
        extra: int = 0,
    ) -> dict[str, Tensor]:
        """One pass (``backward``: the module's manual_backward), then ``extra`` zero-weight
        backwards, so that this rank joins the other ranks' all-reduces. Adds the pass's share of
        the step's loss normaliser to :attr:`count`; returns its loss statistics, detached, with the
        share of its forwards' tokens that were padding (``padding_fraction``)."""
        mask = rollout.loss_mask(self.mask_truncated)  # (P*G, Lc)
        totals: dict[str, Tensor] = {}
        batches = self.scorer.micro_batches(rollout, model)
        learned = 0
        for batch in batches:
            rows = batch.rows
            learns = self.learns(advantages[rows], model)
            with profile("logprob"), nullcontext() if learns else torch.no_grad():
                logp, entropy = self.scorer.log_probs_and_entropy(
                    model, rollout, batch, entropy_grad=self.loss.entropy_coef > 0
                )
                loss, metrics = grpo_loss(
                    logp,
                    _rows(old_logp, rows),
                    _rows(ref_logp, rows),
                    advantages[rows],
                    mask[rows],
                    self.loss,
                    behav_logp=_rows(rollout.behav_logp, rows),
                )
                loss = loss - entropy_bonus(entropy, mask[rows], self.loss)
            if learns:
                weight = backward_weight(self.loss, mask[rows], mask).to(loss.device)
                with profile("backward"):
                    backward(loss * weight)
                learned += 1
            metrics["entropy"] = masked_mean(entropy.detach(), mask[rows])
            share = micro_batch_weight(self.loss, mask[rows], mask).to(loss.device)
            add_micro_batch(totals, loss, metrics, share, mask[rows].sum() / mask.sum().clamp(min=1))
        extra += _zero_gradient_call(batches, learned)
        if extra:
            params = [p for p in model.parameters() if p.requires_grad]
            for _ in range(extra):
                backward(torch.stack([p.sum() for p in params]).sum() * 0.0)
        self.count = self.count + step_count(self.loss, mask)
        if not totals or not mask.any():  # nothing trained (or every token masked): no values
            # (each key still updated, empty, so that every rank joins each metric's reduction)
            return {key: torch.zeros(0) for key in (*LOSS_STATS, "padding_fraction")}
        return {**totals, "padding_fraction": torch.tensor(padding_fraction(batches, rollout))}


def _zero_gradient_call(batches: list[MicroBatch], learning: int) -> int:
    """The zero-weight backward a pass adds where it has micro-batches but none learns (1, else 0):
    the gradient then exists, zero, as their own backwards would have left it."""
    return 1 if batches and not learning else 0


def _rows(values: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if values is None else values[rows]


class ReferenceSource(Protocol):
    """What the module needs of the frozen reference: the model, and the context its forward runs
    in (the adapter switched off when a LoRA policy's own base weights are the reference)."""

    @property
    def model(self) -> PreTrainedModel: ...

    def scope(self) -> AbstractContextManager[Any]: ...
