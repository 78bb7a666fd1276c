"""Each algorithm lever in a real step of the tiny module: its optimizer step's gradient is the
same whether the rollouts come in one batch, in accumulated batches or in micro-batches (and,
in tests/training/test_distributed.py, over two DDP ranks), and the lever changes that gradient.
The formulas themselves are checked by hand in tests/grpo/test_levers.py."""

from __future__ import annotations

import pytest
import torch

RECORDS = [{"prompt": "ab"}, {"prompt": "abc d"}, {"prompt": "xy"}, {"prompt": "q?"}]
# Each lever's settings, and whether its first step's gradient differs from plain grpo's. With one
# pass per rollout every ratio is 1: sapo's gradient is then grpo's, and dual-clip never bites
# (tests/grpo/test_levers.py checks both away from ratio 1).
LEVERS = {
    "rloo": (dict(advantage_estimator="rloo"), True),
    "cispo": (dict(loss_type="cispo"), True),
    "sapo": (dict(loss_type="sapo"), False),
    "clip_ratio_c": (dict(clip_ratio_c=3.0), False),
    "entropy_coef": (dict(entropy_coef=0.1), True),
    "kl_in_reward": (dict(kl_in_reward=True), True),
}


def assert_same(grads, expected, rtol: float = 1e-6, atol: float = 1e-12) -> None:
    assert any(g.abs().sum() > 0 for g in expected)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def differ(grads, others) -> bool:
    """Whether two steps' gradients differ by more than a forward's rounding (sapo's gate at
    ratio 1 gives grpo's gradient to about 1e-8)."""
    return any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, others))


@pytest.mark.integration
@pytest.mark.parametrize("lever", LEVERS)
def test_accumulated_batches_give_the_gradient_of_one_batch_holding_them(step_gradients, lever):
    settings, changes = LEVERS[lever]
    _, whole = step_gradients(records=RECORDS, batch_size=4, fixed=True, **settings)
    _, plain = step_gradients(records=RECORDS, batch_size=4, fixed=True)
    assert differ(whole, plain) == changes
    for batch_size, accumulation in ((2, 2), (1, 4)):
        _, split = step_gradients(
            records=RECORDS,
            batch_size=batch_size,
            fixed=True,
            gradient_accumulation_steps=accumulation,
            **settings,
        )
        assert_same(split, whole)


MICRO_LEVERS = {
    "reinforce_pp": dict(advantage_estimator="reinforce_pp", advantage_scale="none"),
    "entropy_coef": dict(entropy_coef=0.1),
    "kl_in_reward": dict(kl_in_reward=True),
}


@pytest.mark.integration
@pytest.mark.parametrize("lever", MICRO_LEVERS)
def test_micro_batches_give_the_unsplit_gradient(step_gradients, lever):
    # reinforce_pp's std is over the whole batch, so accumulated batches (sampled one after the
    # other) are not one batch to it; micro-batches and ranks (test_distributed.py) are.
    settings = MICRO_LEVERS[lever]
    _, whole = step_gradients(records=RECORDS, batch_size=4, fixed=True, **settings)
    _, plain = step_gradients(records=RECORDS, batch_size=4, fixed=True)
    assert differ(whole, plain)
    for micro in (4, 3):  # group-aligned (shared prefix) and not aligned (full forward)
        _, split = step_gradients(
            records=RECORDS, batch_size=4, fixed=True, train_micro_batch_size=micro, **settings
        )
        # the shared-prefix and the full forward round differently: test_module.py's tolerance
        assert_same(split, whole, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_kl_in_reward_forwards_the_reference_once_per_rollout(step_gradients, monkeypatch):
    from forge_lightning.rollout.logprobs import LogProbScorer

    calls = []
    original = LogProbScorer.log_probs_no_grad

    def counted(self, model, rollout):
        calls.append(model)
        return original(self, model, rollout)

    monkeypatch.setattr(LogProbScorer, "log_probs_no_grad", counted)
    step_gradients(records=RECORDS, batch_size=4, fixed=True, kl_in_reward=True)
    # the reference's and the sampling policy's, each once, for the reward and the loss alike
    assert len(calls) == 2 and calls[0] is not calls[1]
