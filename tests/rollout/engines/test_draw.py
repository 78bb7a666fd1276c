"""The samplers' draw: one uniform a row found in the row's cumulative sums, the distribution
torch.multinomial draws from, and generate's torch.multinomial within inverse_cdf_sampling."""

from __future__ import annotations

import threading

import pytest
import torch

from forge_lightning.rollout.engines.draw import draw, inverse_cdf_sampling


def test_draws_follow_each_rows_probabilities_and_never_a_token_without_any():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [1.0, 1.0, 0.0, 2.0, 0.0]])
    n = 40_000
    picked = draw(probs.repeat(n, 1), torch.Generator().manual_seed(0)).view(n, 3)
    for row in range(3):
        freq = torch.bincount(picked[:, row], minlength=5).float() / n
        torch.testing.assert_close(freq, probs[row] / probs[row].sum(), atol=0.01, rtol=0)
        assert (freq[probs[row] == 0] == 0).all()


def test_a_uniform_times_the_sum_rounded_up_to_the_sum_still_lands_on_a_token_with_probability():
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]], dtype=torch.float32)
    top = torch.tensor([[1.0]], dtype=torch.float64)  # u * total == total: past every cdf
    original = torch.rand
    try:
        torch.rand = lambda *a, **k: top  # type: ignore[assignment]
        assert draw(probs).item() == 1
    finally:
        torch.rand = original


def test_one_seed_gives_one_draw_and_a_1d_row_gives_one_index():
    probs = torch.softmax(torch.randn(4, 100), dim=-1)
    first = draw(probs, torch.Generator().manual_seed(3))
    assert first.shape == (4, 1) and first.dtype == torch.int64
    assert torch.equal(first, draw(probs, torch.Generator().manual_seed(3)))
    assert draw(probs[0], torch.Generator().manual_seed(3)).shape == (1,)


@pytest.mark.parametrize("bad", [[0.5, float("nan")], [0.5, float("inf")], [0.0, 0.0], [0.5, -0.1]])
def test_probabilities_no_distribution_holds_are_refused_as_multinomial_refuses_them(bad):
    with pytest.raises(RuntimeError, match="inf.*nan.*element < 0"):
        draw(torch.tensor([bad]))


def test_within_the_context_multinomial_of_one_sample_draws_by_the_inverse_cdf_and_after_it_as_before():
    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    original = torch.multinomial
    with inverse_cdf_sampling():
        got = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1))
        many = torch.multinomial(probs, 4, generator=torch.Generator().manual_seed(1))  # torch's own
    assert torch.equal(got, draw(probs, torch.Generator().manual_seed(1)))
    assert torch.equal(many, original(probs, 4, generator=torch.Generator().manual_seed(1)))
    assert torch.multinomial is original


def test_contexts_open_in_two_threads_restore_multinomial_only_when_the_last_closes():
    original = torch.multinomial
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with inverse_cdf_sampling():
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(5)
    with inverse_cdf_sampling():
        pass
    assert torch.multinomial is not original  # the other thread's context is still open
    release.set()
    thread.join(5)
    assert torch.multinomial is original
