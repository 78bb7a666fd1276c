"""The loss passes over a rollout (training/loss_passes.py): token-budget micro-batches give the
whole rollout's loss and gradient, and every rank makes as many backward calls."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers.models import make_model
from helpers.rollouts import mixed_rollout

from forge_lightning.grpo import LossSettings
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.training.context import StepContext
from forge_lightning.training.loss_passes import LossPasses

VOCAB = 40
ENDS = [12, 3, 7, 12, 2, 5, 9, 4, 1, 6, 12, 3]  # 4 groups of 3, mixed lengths
PROMPTS = [5, 2, 8, 3]


def one_pass(model, rollout, loss_type: str, **scorer) -> tuple[dict, list[torch.Tensor], torch.Tensor, int]:
    """One loss pass: its statistics, the gradient, the step's count and the micro-batches."""
    torch.manual_seed(0)
    reference = make_model(VOCAB, seed=3)
    ref_logp = LogProbScorer().log_probs_no_grad(reference, rollout)
    passes = LossPasses(LogProbScorer(temperature=0.7, **scorer), LossSettings(loss_type=loss_type), False)
    model.zero_grad()
    advantages = torch.linspace(-1, 1, len(ENDS))
    stats = passes.backward(
        model, rollout, advantages, None, ref_logp, torch.Tensor.backward, lambda phase: nullcontext()
    )
    grads = [p.grad.clone() for p in model.parameters()]
    return stats, grads, passes.take_count(), len(passes.micro_batches(rollout, model))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize(
    ("shared_prefix", "tokens"),
    # Shared: whole groups and single rows (40), groups of prompts 1 and 3 together (80).
    [(True, 40), (True, 80), (False, 60)],
)
def test_a_token_budget_gives_the_whole_rollouts_loss_and_gradient_with_less_padding(
    loss_type, shared_prefix, tokens
):
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    whole, whole_grads, whole_count, _ = one_pass(model, rollout, loss_type, shared_prefix=shared_prefix)
    packed, grads, count, micro = one_pass(
        model, rollout, loss_type, shared_prefix=shared_prefix, micro_batch_tokens=tokens
    )
    assert micro >= 3
    assert any(g.abs().sum() > 0 for g in whole_grads)
    for key in ("loss", "policy_loss", "kl", "entropy"):
        torch.testing.assert_close(packed[key], whole[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(count, whole_count)
    for a, b in zip(grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert packed["padding_fraction"] < whole["padding_fraction"]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_runs_of_like_lengths_cut_from_a_group_give_the_whole_groups_loss_and_gradient(loss_type):
    # Each group of 6 holds long completions among short ones: its long rows and its short rows run
    # apart, each run with the group's prompt once (rollout/micro_batches.py).
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, [12, 2, 12, 3, 2, 3, 12, 2, 3, 2, 2, 3], [6, 4], group_size=6)
    whole, whole_grads, whole_count, _ = one_pass(model, rollout, loss_type, micro_batch_size=6)
    runs, grads, count, micro = one_pass(model, rollout, loss_type, micro_batch_tokens=200)
    assert micro == 4
    for key in ("loss", "policy_loss", "kl", "entropy"):
        torch.testing.assert_close(runs[key], whole[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(count, whole_count)
    for a, b in zip(grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert runs["padding_fraction"] < whole["padding_fraction"] / 5


def test_with_a_token_budget_a_rank_adds_zero_weight_backwards_up_to_the_most_micro_batches():
    def other_rank_has_seven(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return torch.maximum(tensor, torch.tensor(7.0)) if op == "max" else tensor

    two_ranks = StepContext.one_process(world_size=2, reduce=other_rank_has_seven)
    packed = LossPasses(LogProbScorer(micro_batch_tokens=60), LossSettings(), False)
    assert packed.backward_calls_missing(3, two_ranks) == 4
    assert packed.backward_calls_missing(3, StepContext.one_process()) == 0
    # Micro-batches by count: every rank has as many rows, so as many micro-batches.
    by_count = LossPasses(LogProbScorer(micro_batch_size=2), LossSettings(), False)
    assert by_count.backward_calls_missing(3, two_ranks) == 0


def test_a_step_under_a_token_budget_makes_as_many_backward_calls_as_the_busiest_rank(module, count_a):
    from forge_lightning.rollout.sources import TrainingBatch

    grpo = module(
        reward=count_a, group_size=3, gradient_accumulation_steps=1, kl_beta=0.0, train_micro_batch_tokens=60
    )
    grpo.configure_model()
    rollout = mixed_rollout(len(grpo.tokenizer), ENDS, PROMPTS, group_size=3)
    rollout.completions = ["a" * n for n in ENDS]
    made = len(grpo.step.loss_passes.micro_batches(rollout, grpo.model))
    calls: list[float] = []

    def backward(loss: torch.Tensor) -> None:
        calls.append(float(loss.detach()))
        loss.backward()

    def busiest_has_ten(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return torch.maximum(tensor, torch.tensor(10.0)) if op == "max" else tensor

    context = StepContext.one_process(backward=backward, world_size=2, reduce=busiest_has_ten)
    optimizer = torch.optim.SGD(grpo.model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batch = TrainingBatch(["p"] * len(PROMPTS), {}, 0, rollout)
    grpo.step.train(batch, grpo.model, None, optimizer, scheduler, context)
    assert 1 < made < 10
    assert len(calls) == 10 and calls[made:] == [0.0] * (10 - made)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_micro_batches_smaller_than_a_group_share_its_prompt_and_give_the_whole_rollouts_gradient(loss_type):
    # 2 groups of 6, micro-batches of 3 rows and of 2: each within one group runs its prompt once.
    ends, prompts = ENDS, [5, 8]
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, ends, prompts, group_size=6)
    whole, whole_grads, whole_count, _ = one_pass(model, rollout, loss_type, shared_prefix=False)
    for size in (3, 2):
        scorer = LogProbScorer(micro_batch_size=size)
        assert [b.share for b in scorer.micro_batches(rollout, model)] == [size] * (12 // size)
        parts, grads, count, micro = one_pass(model, rollout, loss_type, micro_batch_size=size)
        assert micro == 12 // size
        for key in ("loss", "policy_loss", "kl", "entropy"):
            torch.testing.assert_close(parts[key], whole[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(count, whole_count)
        for a, b in zip(grads, whole_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class EveryBackward(LossPasses):
    """The loss passes as they were: every micro-batch's backward, whatever its advantages."""

    def learns(self, advantages: torch.Tensor, model) -> bool:
        return True


def counted_pass(passes: LossPasses, model, rollout, advantages) -> tuple[dict, list, int]:
    """One pass from no gradient: its statistics, the gradient (None where none) and its backward calls."""
    model.zero_grad(set_to_none=True)
    calls = []

    def backward(loss: torch.Tensor) -> None:
        calls.append(float(loss.detach()))
        loss.backward()

    stats = passes.backward(model, rollout, advantages, None, None, backward, lambda phase: nullcontext())
    return stats, [None if p.grad is None else p.grad.clone() for p in model.parameters()], len(calls)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("scorer", [{"micro_batch_size": 3}, {"micro_batch_tokens": 40}])
def test_zero_advantage_micro_batches_skip_their_backward_with_the_same_gradient_and_statistics(
    loss_type, scorer
):
    # Groups 0 and 2 of 4 have equal rewards (advantage 0 on every row): their backward adds nothing.
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    advantages = torch.tensor([0.0, 0, 0, 0.5, -1, 0.5, 0, 0, 0, -0.3, 0.6, -0.3])
    loss = LossSettings(loss_type=loss_type, kl_beta=0.0)
    every = EveryBackward(LogProbScorer(temperature=0.7, **scorer), loss, False)
    skips = LossPasses(LogProbScorer(temperature=0.7, **scorer), loss, False)
    made = len(skips.micro_batches(rollout, model))
    learning = skips.backward_calls(rollout, advantages, model)
    assert 0 < learning < made
    want, want_grads, want_calls = counted_pass(every, model, rollout, advantages)
    got, grads, calls = counted_pass(skips, model, rollout, advantages)
    assert (want_calls, calls) == (made, learning)
    for a, b in zip(grads, want_grads):
        assert torch.equal(a, b)  # bit for bit: the skipped backwards added exact zeros
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    torch.testing.assert_close(skips.take_count(), every.take_count())


def test_a_pass_whose_advantages_are_all_zero_leaves_a_zero_gradient_as_before():
    # Not None: AdamW still steps its moments on a zero gradient, as it did on the backwards' zeros.
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    advantages = torch.zeros(len(ENDS))
    loss = LossSettings(kl_beta=0.0)
    skips = LossPasses(LogProbScorer(micro_batch_size=3), loss, False)
    assert skips.backward_calls(rollout, advantages, model) == 1
    want, want_grads, want_calls = counted_pass(
        EveryBackward(LogProbScorer(micro_batch_size=3), loss, False), model, rollout, advantages
    )
    got, grads, calls = counted_pass(skips, model, rollout, advantages)
    assert (want_calls, calls) == (4, 1)
    assert all(g is not None and not g.any() for g in grads)
    for a, b in zip(grads, want_grads):
        assert torch.equal(a, b)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize(
    "settings",
    [{"kl_beta": 0.04}, {"kl_beta": 0.0, "entropy_coef": 0.01}, {"loss_type": "forge", "kl_beta": 0.0}],
)
def test_a_loss_with_a_term_beside_the_advantage_runs_every_backward(settings):
    # A KL term or an entropy bonus has a gradient where the advantage is 0; forge's ratio is against
    # the reference.
    loss = LossSettings(**settings)
    assert not loss.advantage_weighted
    passes = LossPasses(LogProbScorer(micro_batch_size=3), loss, False)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    assert passes.backward_calls(rollout, torch.zeros(len(ENDS)), make_model(VOCAB)) == 4
    assert LossSettings(kl_beta=0.04, kl_in_reward=True).advantage_weighted  # the KL is in the advantage then


def test_where_ranks_skip_their_own_zero_advantage_backwards_each_adds_up_to_the_busiest():
    def other_rank_has_four(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return torch.maximum(tensor, torch.tensor(4.0)) if op == "max" else tensor

    two_ranks = StepContext.one_process(world_size=2, reduce=other_rank_has_four)
    by_count = LossPasses(LogProbScorer(micro_batch_size=3), LossSettings(kl_beta=0.0), False)
    assert by_count.backward_calls_missing(1, two_ranks) == 3
    assert by_count.backward_calls_missing(1, StepContext.one_process()) == 0


def test_a_sharded_model_runs_every_backward(monkeypatch):
    # FSDP2 gathers the weights in each forward and backward, so every rank keeps them in one order.
    import forge_lightning.training.loss_passes as loss_passes

    passes = LossPasses(LogProbScorer(micro_batch_size=3), LossSettings(kl_beta=0.0), False)
    rollout, model = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3), make_model(VOCAB)
    assert passes.backward_calls(rollout, torch.zeros(len(ENDS)), model) == 1
    monkeypatch.setattr(loss_passes, "is_sharded", lambda model: True)
    assert passes.backward_calls(rollout, torch.zeros(len(ENDS)), model) == 4
