"""Log-probs through a linear head a chunk at a time: the full logits' values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge_lightning.grpo import token_log_probs_and_entropy
from forge_lightning.grpo.linear_log_probs import linear_token_log_probs


def inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 4, dtype=dtype, requires_grad=True)  # (B, T, H)
    weight = torch.randn(11, 4, dtype=dtype, requires_grad=True)  # (V, H)
    return hidden, weight, torch.randint(0, 11, (3, 5))


def by_hand(hidden, weight, targets, temperature):
    """Log-probs and entropies of the full logits, by plain autograd (entropy with its gradient)."""
    log_probs = torch.log_softmax(F.linear(hidden, weight) / temperature, dim=-1)  # (B, T, V)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_give_the_full_logits_values_and_gradients_entropy_included(chunk_size, temperature):
    hidden, weight, targets = inputs()
    logp, entropy = linear_token_log_probs(hidden, weight, targets, temperature, chunk_size)
    want_logp, want_entropy = by_hand(hidden, weight, targets, temperature)
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, want_entropy)
    a, b = torch.linspace(-1, 1, 15).view(3, 5), torch.linspace(2, -1, 15).view(3, 5)
    got = torch.autograd.grad((logp * a + entropy * b).sum(), (hidden, weight))
    want = torch.autograd.grad((want_logp * a + want_entropy * b).sum(), (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_gradcheck_in_float64():
    hidden, weight, targets = inputs()

    def both(h, w):
        return linear_token_log_probs(h, w, targets, 0.8, 2)

    assert torch.autograd.gradcheck(both, (hidden, weight))


def test_log_probs_alone_equal_the_logits_path_and_keep_no_entropy():
    hidden, weight, targets = inputs(torch.float32)
    logp, entropy = linear_token_log_probs(hidden, weight, targets, 0.7, 4, with_entropy=False)
    want, _ = token_log_probs_and_entropy(F.linear(hidden, weight), targets, 0.7)
    assert entropy is None
    torch.testing.assert_close(logp, want)
    got = torch.autograd.grad(logp.sum(), (hidden, weight))
    expected = torch.autograd.grad(want.sum(), (hidden, weight))
    for g, w in zip(got, expected):
        torch.testing.assert_close(g, w)


def test_only_the_inputs_and_per_position_values_are_kept_for_the_backward():
    hidden, weight, targets = inputs(torch.float32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear_token_log_probs(hidden, weight, targets, 1.0, 2)
    # hidden (15, 4), the weight, and (15,) targets, logsumexps and entropies: no (15, 11) logits.
    assert all(t.shape[-1] != 11 or t is weight for t in saved)
    assert sum(t.numel() for t in saved if t is not weight) == 15 * 4 + 3 * 15


def test_bad_arguments_are_refused():
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="temperature"):
        linear_token_log_probs(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_token_log_probs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="disagree"):
        linear_token_log_probs(hidden, weight, targets[:, :2])
