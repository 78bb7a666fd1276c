"""The log-prob scorer through the LM head a chunk at a time: the full logits' values and
gradients, with prefix sharing, LoRA and autocast, without the whole batch's logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.models import make_model
from helpers.rollouts import mixed_rollout

from forge_lightning.models.lora import LoraSettings, apply_lora
from forge_lightning.rollout.logprobs import LogProbScorer

VOCAB = 40
ENDS = [9, 3, 7, 9, 2, 5]  # 2 groups of 3, mixed lengths
PROMPTS = [5, 2]
FULL = LogProbScorer(temperature=0.7, chunk_size=4, head_chunk_size=None)  # the model's own logits


def values_and_gradients(model, scorer: LogProbScorer, rollout) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One whole-rollout training pass: the log-probs and entropies (P*G, Lc) on the completions'
    tokens, and the parameters' gradients of a weighted sum of the log-probs (the loss's path)."""
    model.zero_grad()
    (batch,) = scorer.micro_batches(rollout, model)
    logp, entropy = scorer.log_probs_and_entropy(model, rollout, batch)
    mask = rollout.completion_mask
    (logp * torch.linspace(-1, 1, mask.numel()).view_as(mask) * mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp.detach() * mask, entropy.detach() * mask, grads


def assert_same(got, want, rtol=1e-5, atol=1e-5) -> None:
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    assert len(got[2]) == len(want[2]) and any(g.abs().sum() > 0 for g in want[2])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=10 * rtol, atol=atol)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_head_chunks_give_the_full_logits_values_and_gradients(shared_prefix):
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    full = dataclasses.replace(FULL, shared_prefix=shared_prefix)
    want = values_and_gradients(model, full, rollout)
    for head_chunk_size in (5, 1000):
        chunked = dataclasses.replace(full, head_chunk_size=head_chunk_size)
        assert_same(values_and_gradients(model, chunked, rollout), want)
        mask = rollout.completion_mask
        no_grad = chunked.log_probs_no_grad(model, rollout)  # the reference's and old policy's
        torch.testing.assert_close(no_grad * mask, want[0], rtol=1e-5, atol=1e-5)


def test_head_chunks_through_a_lora_adapter_give_its_values_and_gradients():
    model = apply_lora(make_model(VOCAB), LoraSettings(r=4, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a fresh adapter is zero: make it count
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    chunked = dataclasses.replace(FULL, head_chunk_size=5)
    assert_same(values_and_gradients(model, chunked, rollout), values_and_gradients(model, FULL, rollout))
    with model.disable_adapter():  # the reference: the base weights alone
        base = FULL.log_probs_no_grad(model, rollout)
        torch.testing.assert_close(chunked.log_probs_no_grad(model, rollout), base, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(chunked.log_probs_no_grad(model, rollout), base)


def test_head_chunks_under_bfloat16_autocast_match_the_full_logits_to_its_precision():
    model = make_model(VOCAB, tie_word_embeddings=False)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    chunked = dataclasses.replace(FULL, head_chunk_size=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = values_and_gradients(model, chunked, rollout)
        want = values_and_gradients(model, FULL, rollout)
    assert got[0].dtype == torch.float32
    assert_same(got, want, rtol=2e-2, atol=2e-2)


def test_a_training_pass_keeps_no_logits_of_the_whole_micro_batch():
    model = make_model(VOCAB)
    rollout = mixed_rollout(VOCAB, ENDS, PROMPTS, group_size=3)
    head = model.get_output_embeddings()
    outputs: list[torch.Size] = []
    head.register_forward_hook(lambda module, args, out: outputs.append(out.shape))
    saved: list[torch.Tensor] = []
    scorer = LogProbScorer(head_chunk_size=5)  # the module's other defaults
    (batch,) = scorer.micro_batches(rollout, model)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp, _ = scorer.log_probs_and_entropy(model, rollout, batch)
    logp.sum().backward()
    assert outputs == []  # the head's weight is used, not its forward over every position
    # Nothing kept for the backward holds a vocabulary-wide row but the head's own weight.
    assert all(t.shape[-1] != VOCAB or t is head.weight for t in saved)
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
