"""The optimizer side: learning-rate schedules, the non-finite guard, the fused-kernel choice, the
one-pass scale-and-clip and the parameter finiteness check."""

import math

import pytest
import torch

from forge_lightning.run.fit import FitShape
from forge_lightning.training.optim import (
    NonFiniteGuard,
    adamw_with_schedule,
    all_finite,
    can_fuse_adamw,
    gradient_norm,
    normalise_and_clip,
    require_finite_parameters,
    rescale_schedule,
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


def test_linear_warms_up_then_falls_in_a_straight_line_to_zero():
    lr = rates("linear")
    assert lr[:3] == [0.0, pytest.approx(5e-4), pytest.approx(1e-3)]
    assert lr[3:] == [pytest.approx(1e-3 * (10 - s) / 8) for s in range(3, 10)]


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule"):
        rates("polynomial")


def restored(total: int, schedule: str = "cosine", from_total: int = 4, steps: int = 4):
    """A schedule of ``total`` steps given the state of one of ``from_total`` after ``steps``."""
    param = torch.nn.Parameter(torch.zeros(3))
    settings = dict(learning_rate=1e-3, weight_decay=0.0, warmup_steps=0)
    optimizer, scheduler = adamw_with_schedule([param], **settings, total_steps=from_total)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    states = optimizer.state_dict(), scheduler.state_dict()
    optimizer, scheduler = adamw_with_schedule([param], **settings, total_steps=total, schedule=schedule)
    optimizer.load_state_dict(states[0])
    scheduler.load_state_dict(states[1])
    return optimizer, scheduler


def test_a_longer_run_resumed_from_a_finished_cosine_continues_on_the_longer_cosine():
    optimizer, scheduler = restored(total=8)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # where the old one ended
    with pytest.warns(
        UserWarning, match=r"(?s)sized for this run's 8 steps.*at step 4.*0\.0005.*instead of 0\b"
    ):
        assert rescale_schedule(scheduler, 1e-3, total_steps=8)
    half = 1e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 8))
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == pytest.approx(half)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 8)))


def test_a_resume_of_the_same_length_leaves_the_schedule_alone(recwarn):
    optimizer, scheduler = restored(total=8, from_total=8, steps=3)
    before = optimizer.param_groups[0]["lr"]
    assert not rescale_schedule(scheduler, 1e-3, total_steps=8)
    assert optimizer.param_groups[0]["lr"] == before and not recwarn.list


def test_a_finished_cosine_resumed_as_constant_continues_at_the_peak():
    optimizer, scheduler = restored(total=8, schedule="constant")
    with pytest.warns(UserWarning, match="at step 4"):
        rescale_schedule(scheduler, 1e-3, total_steps=8)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


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
    fit = FitShape(max_steps=max_steps, stepping_batches=lambda: batches, max_epochs=epochs)
    assert total_optimizer_steps(fit, accumulation, mu) == expected


def test_total_optimizer_steps_needs_an_end():
    fit = FitShape(max_steps=-1, stepping_batches=lambda: float("inf"), max_epochs=1)
    with pytest.raises(ValueError, match="max_steps"):
        total_optimizer_steps(fit, 1, 1)


def with_gradients(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    return params


def scaled_then_clipped(grads: list[torch.Tensor], scale: float, max_norm: float | None):
    """The path before the one-pass version: scale in place, take the norm, then Lightning's
    ``clip_gradients`` (``clip_grad_norm_``, which takes the norm again)."""
    params = with_gradients(*grads)
    for p in params:
        p.grad.mul_(scale)
    norm = gradient_norm(params)
    if max_norm is not None and torch.isfinite(norm):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


@pytest.mark.parametrize("max_norm", [None, 0.1, 1e6])  # no clipping, clipping, a norm under the limit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_scale_and_clip_gives_the_gradients_of_scaling_then_clipping(max_norm, dtype):
    torch.manual_seed(0)
    grads = [torch.randn(7, 5).to(dtype), torch.randn(11).to(dtype) * 3]
    params = with_gradients(*grads) + [torch.nn.Parameter(torch.zeros(2))]  # one without a gradient
    scale = torch.tensor(1 / 37)
    norm = normalise_and_clip(params, scale, max_norm)
    want_norm, want = scaled_then_clipped(grads, scale.item(), max_norm)
    tolerance = dict(rtol=1e-5, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(norm, want_norm.float(), **tolerance)
    for got, expected in zip(params, want):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad, expected, **tolerance)
    assert params[-1].grad is None
    if max_norm == 0.1:  # the clip binds: the result has the limit as its norm
        rel = 1e-5 if dtype == torch.float32 else 1e-2
        assert gradient_norm(params).float().item() == pytest.approx(0.1, rel=rel)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_is_reported_and_left_untouched_so_the_guard_skips(bad):
    grads = [torch.ones(4), torch.tensor([1.0, bad])]
    params = with_gradients(*grads)
    norm = normalise_and_clip(params, torch.tensor(0.5), 1.0)
    want_norm, _ = scaled_then_clipped(grads, 0.5, 1.0)
    assert not torch.isfinite(norm) and not torch.isfinite(want_norm)
    with pytest.warns(UserWarning, match="skipped"):
        assert NonFiniteGuard(limit=3).allows(norm) is False
    for got, grad in zip(params, grads):
        torch.testing.assert_close(got.grad, grad, equal_nan=True)


def test_clipping_under_a_grad_scaler_is_in_unscaled_units():
    """16-mixed: Lightning unscales the gradients inside ``optimizer.step()``, after the clip; the
    norm logged and the clip applied are those of the true gradient."""
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = (params[0] * torch.tensor([3.0, 0.0])).sum() + 4.0 * params[1].sum()  # gradient norm 5
    scaler.scale(loss).backward()
    assert gradient_norm(params).item() == pytest.approx(5.0 * 2**10)
    norm = normalise_and_clip(params, torch.tensor(1.0), 1.0, loss_scale=scaler.get_scale())
    assert norm.item() == pytest.approx(5.0)
    scaler.unscale_(optimizer)
    assert gradient_norm(params).item() == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_finiteness_check_flags_exactly_the_tensors_isfinite_flags(dtype):
    tensors = [torch.zeros(5, 3, dtype=dtype) for _ in range(6)] + [torch.zeros(0, dtype=dtype)]
    tensors[1][4, 2] = float("nan")
    tensors[2][0, 0] = float("inf")
    tensors[3][2, 1] = -float("inf")
    tensors[4].fill_(3e38)  # large but finite: no overflow
    want = torch.tensor([bool(torch.isfinite(t).all()) for t in tensors])
    assert all_finite(tensors).tolist() == want.tolist() == [True, False, False, False, True, True, True]


def test_non_finite_parameters_stop_with_their_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    require_finite_parameters(model, None, 1)  # one process: nothing to sum over ranks
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    with pytest.raises(RuntimeError, match=r"step 4 left parameters non-finite \(1.bias\)"):
        require_finite_parameters(model, None, 4)


@pytest.mark.integration
def test_a_fit_steps_on_the_gradient_clipped_to_max_grad_norm(step_gradients):
    loss, free = step_gradients(max_grad_norm=None)
    clipped_loss, clipped = step_gradients(max_grad_norm=1e-3)
    params = with_gradients(*free)
    norm = torch.nn.utils.clip_grad_norm_(params, 1e-3)
    assert norm > 1e-2 and clipped_loss == loss  # the clip binds; the same completions
    for got, want in zip(clipped, params):
        torch.testing.assert_close(got, want.grad, rtol=1e-10, atol=0)
