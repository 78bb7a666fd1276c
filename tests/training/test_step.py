"""One training batch (training/step.py) without a Trainer: a plain context, a torch optimizer."""

from __future__ import annotations

import torch
from helpers.steps import COMPLETIONS, PROMPTS, a_batch, optimizer_of

from forge_lightning.training.context import StepContext


def test_a_batch_trains_scores_steps_and_records_without_a_trainer(module, count_a):
    grpo = module(reward=count_a, group_size=2, gradient_accumulation_steps=1, kl_beta=0.0)
    grpo.configure_model()  # the engine the rollout source tells of new weights
    model = grpo.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    backward_calls = []

    def backward(loss: torch.Tensor) -> None:
        backward_calls.append(float(loss.detach()))
        loss.backward()

    record, stepped = grpo.step.train(
        a_batch(), model, None, *optimizer_of(model), StepContext.one_process(backward=backward)
    )
    assert stepped and backward_calls
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step
    rewards = count_a(PROMPTS * 2, COMPLETIONS)
    assert record.metrics["train/reward"] == sum(rewards) / len(rewards)
    assert torch.isfinite(torch.tensor(record.metrics["train/loss"]))


def test_a_batch_inside_an_accumulation_keeps_its_gradient_for_the_step(module, count_a):
    grpo = module(reward=count_a, group_size=2, gradient_accumulation_steps=2, kl_beta=0.0)
    grpo.configure_model()
    model = grpo.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer, scheduler = optimizer_of(model)
    context = StepContext.one_process(num_training_batches=4)

    _, stepped = grpo.step.train(a_batch(0), model, None, optimizer, scheduler, context)
    assert not stepped
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    _, stepped = grpo.step.train(a_batch(1), model, None, optimizer, scheduler, context)
    assert stepped
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
