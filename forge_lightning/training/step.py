"""What one training batch does, in order, on one screen.

score the completions -> group-relative advantages -> the plan (what the batch trains, when the
optimizer steps) -> the fixed log-probs (old policy, reference) -> the loss passes, each backward
through ``context.backward`` -> the optimizer step where the plan says -> the batch's record.
The context's loop hooks (training/loop_hooks.py; Lightning callbacks in a fit) hear of the
rollout, the rewards and the advantages as they are made; the rewards' hook may drop groups.

:class:`BatchTrainer` (first named ``TrainingStep``) holds the collaborators the module built
once from its settings and takes the loop around it as a
:class:`~forge_lightning.training.context.StepContext` (backward, gather, reduce, world size,
profile): it never sees a Trainer, so it runs in a test on a plain model. :func:`batch_advantages`
makes the batch's advantages, over every rank's groups where the estimator needs the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from transformers import PreTrainedModel

from forge_lightning._moved import renamed
from forge_lightning.grpo import group_advantages, needs_batch
from forge_lightning.reporting.metrics import RunningMetrics, StepRecord
from forge_lightning.reporting.reporter import StepReporter
from forge_lightning.rewards.batch_scoring import score_groups
from forge_lightning.rewards.calls import RewardCalls, RewardFn
from forge_lightning.rewards.extras import RewardExtras
from forge_lightning.rollout.sources import RolloutSource, TrainingBatch
from forge_lightning.rollout.types import Rollout, warn_when_few_tokens_count
from forge_lightning.run.signals import sigterm_interrupts
from forge_lightning.training.context import StepContext
from forge_lightning.training.dynamic_sampling import SamplingRounds
from forge_lightning.training.loop_hooks import checked_keep, kept_groups, zero_dropped
from forge_lightning.training.loss_passes import LossPasses, ReferenceSource
from forge_lightning.training.optim import OptimizerStep
from forge_lightning.training.plan import StepPlan, mean_stats, take_share


class BatchTrainer:
    """One training batch's rollout in, its gradient steps taken and its record out.

    Args:
        reward: the reward the completions are scored with.
        calls: how the reward is called (what its error does, its time limit, its sandbox).
        loss_passes: the backward passes of the loss over a rollout, micro-batch by micro-batch.
        plan: what each batch trains and after which of its passes the optimizer steps.
        optimizer_step: normalise, clip, step and schedule; skip a non-finite gradient.
        reporter: each step's metrics and, at its cadence, the report for the loggers.
        metrics: the running training metrics the reporter reads.
        rollouts: the rollout source, told when the weights changed (the rollout servers sample
            with the new ones).
        scale: the advantages' divisor: the group's std (``group``), the batch's, or ``none``.
        estimator: the advantages' baseline: ``grpo``, ``rloo`` or ``reinforce_pp``
            (batch_advantages below).
    """

    def __init__(
        self,
        reward: RewardFn,
        calls: RewardCalls,
        loss_passes: LossPasses,
        plan: StepPlan,
        optimizer_step: OptimizerStep,
        reporter: StepReporter,
        metrics: RunningMetrics,
        rollouts: RolloutSource,
        *,
        scale: str = "group",
        estimator: str = "grpo",
    ) -> None:
        self.reward, self.calls, self.scale, self.estimator = reward, calls, scale, estimator
        self.loss_passes, self.plan, self.optimizer_step = loss_passes, plan, optimizer_step
        self.reporter, self.metrics, self.rollouts = reporter, metrics, rollouts

    def train(
        self,
        item: TrainingBatch,
        model: PreTrainedModel,
        reference: ReferenceSource | None,
        optimizer: Any,
        scheduler: Any,
        context: StepContext,
    ) -> tuple[StepRecord, bool]:
        """Score ``item``'s rollout, backpropagate its loss and step ``optimizer`` where the plan
        says. Returns the batch's record and whether it ended an optimizer step."""
        profile, rollout, hooks, calls = context.profile, item.rollout, context.hooks, self.calls
        hooks.rollouts_end(rollout, item)
        extras = RewardExtras(context.global_step(), context.epoch_at(item.batch_idx), context.max_steps)
        with profile("reward"), sigterm_interrupts():
            rewards, components, errors = score_groups(
                self.reward, item.prompts, rollout, item.batch_kwargs, calls.on_error, calls.timeout,
                extras.arguments(), calls.sandbox,
            )  # fmt: skip
        self.metrics.add_logged(extras.logged(), "train")  # TRL's log_metric
        keep = self.groups_kept(rewards, item, context)  # (P,) bool; None: every group
        with profile("logprob"):  # with the KL in the reward, each reward less its completion's KL
            shaped = self.loss_passes.rewards_with_kl(model, reference, rollout, rewards)
        # Every group's, dropped or not: the batch's std and the ranks' gather take equal shapes.
        group = rollout.group_size
        advantages = batch_advantages(  # (P*G,)
            shaped, group, self.scale, context.world_size, context.gather, self.estimator
        )
        advantages = zero_dropped(keep, advantages, group)
        hooks.advantages_end(advantages, item)
        plan = self.plan.plan(*kept_groups(keep, rollout, rewards, advantages), item.batch_idx, context)
        # The batch's rollout, or the groups the hooks kept, or (dynamic sampling) their informative ones.
        trained = plan.rollout
        if self.loss_passes.mask_truncated:
            warn_when_few_tokens_count(rollout)
        with profile("logprob"):
            old_logp, ref_logp = self.loss_passes.fixed_log_probs(model, reference, trained, len(plan.passes))
        pass_stats = []
        for part in plan.passes:  # the whole rollout, or one share of its generation
            share, share_advantages, old, ref = take_share(part, trained, plan.advantages, old_logp, ref_logp)
            extra = self.backward_calls_missing(share, share_advantages, model, context)
            pass_stats.append(
                self.loss_passes.backward(
                    model, share, share_advantages, old, ref, context.backward, profile, extra
                )
            )
            if part.step_after:
                with profile("optimizer"):
                    self.step_optimizer(model, optimizer, scheduler, context)
        # What the loss logs: the last pass over the rollout (the mean over its shares).
        per_pass = len(plan.passes) // self.plan.passes
        stats = mean_stats(pass_stats[-per_pass:])
        num_tokens = trained.loss_mask(self.loss_passes.mask_truncated).sum().float()
        self.metrics.add({"reward_errors": errors, "num_tokens": num_tokens, **item.metrics})
        record = self.reporter.record(
            item, rewards, components, stats, plan.steps,
            context.global_step(), context.log_every_n_steps, context.phases(),
        )  # fmt: skip
        return record, plan.stepped

    def groups_kept(self, rewards: Tensor, item: TrainingBatch, context: StepContext) -> Tensor | None:
        """The keep mask ``(P,)`` the rewards' hook returns for ``item``'s groups (None: all),
        its dropped groups counted in ``groups_filtered`` whenever the hooks filter."""
        num_prompts = item.rollout.prompt_ids.shape[0]
        keep = checked_keep(context.hooks.rewards_end(rewards, item), num_prompts, "rewards_end")
        if context.hooks.filters:  # on every rank alike, so that every rank joins the counter's reduction
            self.metrics.add({"groups_filtered": 0.0 if keep is None else float((~keep).sum())})
        return keep

    def backward_calls_missing(
        self, share: Rollout, advantages: Tensor, model: PreTrainedModel, context: StepContext
    ) -> int:
        """Zero-weight backward calls this rank adds to a pass over ``share`` to make as many as
        the busiest rank: DDP all-reduces in each one. Asked before any backward of the pass, of
        the plan (dynamic sampling), the loss passes (a token budget, zero-advantage micro-batches
        without a backward) and, when the hooks filter, of every rank (each kept its own number of
        groups)."""
        made = self.loss_passes.backward_calls(share, advantages, model)
        missing = self.plan.backward_calls_missing(made, context)
        missing = max(missing, self.loss_passes.backward_calls_missing(made, context))
        if context.hooks.filters and context.world_size > 1:
            missing = max(
                missing, SamplingRounds.backward_calls_missing(made, context.reduce, context.device)
            )
        return missing

    def step_optimizer(
        self, model: PreTrainedModel, optimizer: Any, scheduler: Any, context: StepContext
    ) -> None:
        """Step the optimizer on the gradient of the step's batches, and give the engine the new weights."""
        count = context.reduce(self.loss_passes.take_count().to(context.device), "sum")  # every rank's
        self.metrics.add(self.plan.step_ended())  # dynamic sampling's rounds, taken or skipped
        changed, metrics = self.optimizer_step(model, optimizer, scheduler, count, context)
        self.metrics.add(metrics)
        if changed:
            self.rollouts.weights_updated(model)


def batch_advantages(
    rewards: Tensor,
    group_size: int,
    scale: str,
    world_size: int,
    all_gather: Callable[[Tensor], Tensor],
    estimator: str = "grpo",
) -> Tensor:
    """Group-relative advantages of the rewards ``(P*G,)`` by ``estimator``. ``scale="batch"``
    and ``reinforce_pp`` take their std over every rank's groups of this training batch
    (``all_gather``: the module's), all of its micro-batches and its generation's shares
    (later accumulation batches are not sampled yet)."""
    gathered = needs_batch(scale, estimator) and world_size > 1
    batch = all_gather(rewards).reshape(-1) if gathered else None
    return group_advantages(rewards, group_size, scale=scale, batch_rewards=batch, estimator=estimator)


__getattr__ = renamed(__name__, {"TrainingStep": "BatchTrainer"})
