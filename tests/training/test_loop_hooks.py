"""The RL loop hooks of one training batch (training/loop_hooks.py), without a Trainer."""

from __future__ import annotations

import pytest
import torch
from helpers.steps import COMPLETIONS, PROMPTS, a_batch, optimizer_of

from forge_lightning.grpo import group_advantages
from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.training.context import StepContext
from forge_lightning.training.loop_hooks import NoHooks


class Recorder:
    """Loop hooks that note each call and return ``keep`` from the rewards' hook."""

    def __init__(self, keep: torch.Tensor | None = None) -> None:
        self.keep, self.calls = keep, []

    @property
    def filters(self) -> bool:
        return self.keep is not None

    def rollouts_end(self, rollout, batch):
        self.calls.append(("rollouts_end", rollout, batch))

    def rewards_end(self, rewards, batch):
        self.calls.append(("rewards_end", rewards.clone(), batch))
        return self.keep

    def advantages_end(self, advantages, batch):
        self.calls.append(("advantages_end", advantages.clone(), batch))


def gradients_of(grpo, batch: TrainingBatch, context: StepContext) -> list[torch.Tensor]:
    """The gradient one batch leaves (accumulation 2: no optimizer step takes it away)."""
    grpo.configure_model()
    optimizer, scheduler = optimizer_of(grpo.model)
    _, stepped = grpo.step.train(batch, grpo.model, None, optimizer, scheduler, context)
    assert not stepped
    return [p.grad.clone() for p in grpo.model.parameters() if p.grad is not None]


def test_the_hooks_hear_of_the_rollout_then_its_rewards_then_its_advantages(module, count_a):
    grpo = module(reward=count_a, group_size=2, gradient_accumulation_steps=1, kl_beta=0.0)
    grpo.configure_model()
    hooks, batch = Recorder(), a_batch()
    grpo.step.train(batch, grpo.model, None, *optimizer_of(grpo.model), StepContext.one_process(hooks=hooks))
    assert [name for name, *_ in hooks.calls] == ["rollouts_end", "rewards_end", "advantages_end"]
    assert all(called_with is batch for *_, called_with in hooks.calls)
    assert hooks.calls[0][1] is batch.rollout
    rewards = torch.tensor(count_a(PROMPTS * 2, COMPLETIONS))
    torch.testing.assert_close(hooks.calls[1][1], rewards)
    torch.testing.assert_close(hooks.calls[2][1], group_advantages(rewards, 2))
    assert "groups_filtered" not in grpo.train_metrics.pop()  # no hook filters: no counter


def test_a_group_the_rewards_hook_drops_is_trained_as_if_its_prompt_were_not_in_the_batch(module, count_a):
    settings = dict(reward=count_a, group_size=2, gradient_accumulation_steps=2, kl_beta=0.0)
    context = StepContext.one_process(num_training_batches=4)
    hooks = Recorder(keep=torch.tensor([False, True]))
    filtered = module(**settings)
    dropped = gradients_of(filtered, a_batch(), StepContext.one_process(num_training_batches=4, hooks=hooks))
    alone = a_batch()
    alone.prompts, alone.rollout = PROMPTS[1:], alone.rollout.select_groups(torch.tensor([False, True]))
    expected = gradients_of(module(**settings), alone, context)
    assert len(dropped) == len(expected)
    for got, want in zip(dropped, expected):
        torch.testing.assert_close(got, want)
    everything = gradients_of(module(**settings), a_batch(), context)
    assert any(not torch.allclose(got, other) for got, other in zip(dropped, everything))
    advantages = hooks.calls[2][1]  # the dropped group's are zero, the kept one's as they were
    assert advantages[:2].tolist() == [0.0, 0.0] and advantages[2:].abs().sum() > 0
    assert filtered.train_metrics.pop()["groups_filtered"] == 1.0


def test_a_rank_whose_groups_are_all_dropped_joins_the_busiest_ranks_backwards_at_zero_weight(
    module, count_a
):
    grpo = module(reward=count_a, group_size=2, gradient_accumulation_steps=1, kl_beta=0.0)
    grpo.configure_model()
    before = [p.detach().clone() for p in grpo.model.parameters()]
    calls: list[float] = []

    def backward(loss: torch.Tensor) -> None:
        calls.append(float(loss.detach()))
        loss.backward()

    def busiest_has_three(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return torch.maximum(tensor, torch.tensor(3.0)) if op == "max" else tensor

    hooks = Recorder(keep=torch.tensor([False, False]))
    # One process: nothing to train, no backward; the step is taken and changes nothing.
    alone = StepContext.one_process(backward=backward, hooks=hooks)
    _, stepped = grpo.step.train(a_batch(), grpo.model, None, *optimizer_of(grpo.model), alone)
    assert stepped and calls == []
    assert all(torch.equal(p, b) for p, b in zip(grpo.model.parameters(), before))
    context = StepContext.one_process(backward=backward, world_size=2, reduce=busiest_has_three, hooks=hooks)
    grpo.step.train(a_batch(), grpo.model, None, *optimizer_of(grpo.model), context)
    assert calls == [0.0, 0.0, 0.0]  # no micro-batch of its own; the busiest rank's three all-reduces joined
    # Without a filter, under a loss with a term beside the advantage (an entropy bonus), every rank runs the
    # backward of its whole batch: no backward added.
    calls.clear()
    plain = StepContext.one_process(backward=backward, world_size=2, reduce=busiest_has_three)
    bonus = module(
        reward=count_a, group_size=2, gradient_accumulation_steps=1, kl_beta=0.0, entropy_coef=0.01
    )
    bonus.configure_model()
    bonus.step.train(a_batch(), bonus.model, None, *optimizer_of(bonus.model), plain)
    assert len(calls) == 1
    # An advantage-weighted loss: each rank skips its own zero-advantage micro-batches, so it joins the
    # busiest rank's calls.
    calls.clear()
    grpo.step.train(a_batch(), grpo.model, None, *optimizer_of(grpo.model), plain)
    assert len(calls) == 3 and calls[1:] == [0.0, 0.0]


def test_a_keep_mask_of_the_wrong_shape_or_dtype_is_refused(module, count_a):
    grpo = module(reward=count_a, group_size=2, gradient_accumulation_steps=1, kl_beta=0.0)
    grpo.configure_model()
    for keep in (torch.tensor([True]), torch.tensor([1, 0])):
        context = StepContext.one_process(hooks=Recorder(keep=keep))
        with pytest.raises(ValueError, match=r"rewards_end returned .* shape \(2,\)"):
            grpo.step.train(a_batch(), grpo.model, None, *optimizer_of(grpo.model), context)


def test_a_context_without_a_trainer_has_hooks_that_do_nothing():
    hooks = StepContext.one_process().hooks
    assert isinstance(hooks, NoHooks) and not hooks.filters
    assert hooks.rewards_end(torch.ones(4), a_batch()) is None
