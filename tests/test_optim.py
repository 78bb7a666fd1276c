"""The optimizer side: learning-rate schedules, the non-finite guard, the fused-kernel choice."""

from types import SimpleNamespace

import pytest
import torch

from forge_lightning.optim import (
    NonFiniteGuard,
    adamw_with_schedule,
    can_fuse_adamw,
    gradient_norm,
    total_optimizer_steps,
)


def rates(schedule, warmup=2, total=10):
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer, scheduler = adamw_with_schedule(
        [param],
        learning_rate=1e-3,
        weight_decay=0.0,
        warmup_steps=warmup,
        total_steps=total,
        schedule=schedule,
    )
    seen = []
    for _ in range(total):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return seen


def test_cosine_warms_up_then_decays_towards_zero():
    lr = rates("cosine")
    assert lr[0] == 0.0 and lr[1] == pytest.approx(5e-4)
    assert lr[2] == pytest.approx(1e-3)
    assert all(a > b for a, b in zip(lr[2:], lr[3:]))
    assert lr[-1] < 0.05e-3


def test_constant_holds_the_peak_after_warmup():
    lr = rates("constant")
    assert lr[:2] == [0.0, pytest.approx(5e-4)]
    assert lr[2:] == [pytest.approx(1e-3)] * 8


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule"):
        rates("linear")


def test_guard_skips_non_finite_steps_and_stops_at_the_limit():
    guard = NonFiniteGuard(limit=2)
    assert guard.allows(torch.tensor(1.0))
    with pytest.warns(UserWarning, match="skipped"):
        assert not guard.allows(torch.tensor(float("nan")))
    assert guard.allows(torch.tensor(3.0))  # a finite step resets the count
    with pytest.warns(UserWarning):
        assert not guard.allows(torch.tensor(float("inf")))
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="2 optimizer steps in a row"):
        guard.allows(torch.tensor(float("nan")))


def test_gradient_norm_covers_every_gradient():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    assert gradient_norm([a, b]) == 0
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert gradient_norm([a, b]).item() == pytest.approx(5.0)


def test_fused_adamw_only_on_plain_full_precision_parameters():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert can_fuse_adamw(params, precision="32-true", sharded=False)
    assert not can_fuse_adamw(params, precision="bf16-mixed", sharded=False)
    assert not can_fuse_adamw(params, precision="32-true", sharded=True)


@pytest.mark.parametrize(
    ("max_steps", "batches", "epochs", "accumulation", "mu", "expected"),
    [
        (7, 100, 1, 4, 1, 7),  # max_steps wins
        (-1, 10, 1, 4, 1, 3),  # ceil(10 / 4): the last partial window steps too
        (-1, 20, 2, 4, 1, 6),  # 10 batches an epoch -> 3 steps, twice
        (-1, 10, 1, 1, 2, 20),  # mu passes, one step each
    ],
)
def test_total_optimizer_steps(max_steps, batches, epochs, accumulation, mu, expected):
    trainer = SimpleNamespace(max_steps=max_steps, estimated_stepping_batches=batches, max_epochs=epochs)
    assert total_optimizer_steps(trainer, accumulation, mu) == expected


def test_total_optimizer_steps_needs_an_end():
    trainer = SimpleNamespace(max_steps=-1, estimated_stepping_batches=float("inf"), max_epochs=1)
    with pytest.raises(ValueError, match="max_steps"):
        total_optimizer_steps(trainer, 1, 1)
