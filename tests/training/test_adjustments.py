"""Adjustments: a learning-rate factor that the schedule keeps, and a KL weight that scales."""

from __future__ import annotations

import pytest
import torch

from forge_lightning.grpo import LossSettings
from forge_lightning.training.adjustments import Adjustments, scale_learning_rate
from forge_lightning.training.optim import adamw_with_schedule


def rates(schedule: str, scale_at: int | None, steps: int = 8) -> list[float]:
    """The learning rate of each of ``steps`` steps of a fresh AdamW and schedule, halved after
    step ``scale_at`` (None: never)."""
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer, scheduler = adamw_with_schedule(
        params, learning_rate=1e-2, weight_decay=0.0, warmup_steps=2, total_steps=steps, schedule=schedule
    )
    seen = []
    for step in range(steps):
        if step == scale_at:
            scale_learning_rate(scheduler, 0.5)
        seen.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr() == [seen[-1]]
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_a_scaled_learning_rate_keeps_the_schedules_shape_from_then_on(schedule):
    plain, scaled = rates(schedule, None), rates(schedule, 3)
    assert scaled[:3] == plain[:3]
    torch.testing.assert_close(scaled[3:], [r * 0.5 for r in plain[3:]], rtol=1e-12, atol=0.0)


def test_the_kl_weight_scales_and_zero_stays_zero():
    doubled = Adjustments().then(0.5, 2.0).then(0.5, 1.5)
    assert (doubled.lr_scale, doubled.kl_beta_scale) == (0.25, 3.0)
    assert doubled.loss(LossSettings(kl_beta=0.01)).kl_beta == pytest.approx(0.03)
    assert doubled.loss(LossSettings(kl_beta=0.0)).kl_beta == 0.0
    given = LossSettings(kl_beta=0.01)
    assert Adjustments().loss(given) is given


def test_a_checkpoint_without_adjustments_gives_none():
    assert Adjustments.from_state(None) == Adjustments()
    state = Adjustments(0.5, 2.0).state_dict()
    assert Adjustments.from_state(state) == Adjustments(0.5, 2.0)
