"""Dynamic sampling: only informative groups are trained on, rounds are counted, steps are exact."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import forge_lightning.training.loss_passes as backward_module
from forge_lightning.training.dynamic_sampling import SamplingRounds


def flat_or_live(prompts, responses, kind):
    """0 for every completion of a "flat" prompt (an uninformative group), 0/1 alternating otherwise."""
    return [0.0 if k == "flat" else float(i % 2) for i, k in enumerate(kind)]


def test_rounds_step_at_the_target_at_the_round_limit_or_at_the_epochs_end():
    rounds = SamplingRounds(max_rounds=3)
    rounds.add(informative=1, dropped=1)
    assert not rounds.should_step(target=2, last_batch=False)
    rounds.add(informative=2, dropped=0)
    assert rounds.should_step(target=2, last_batch=False)  # 3 >= 2: the surplus stays in this step
    assert rounds.pop() == {"sampling_rounds": 2.0, "groups_dropped": 1.0, "empty_steps": 0.0}
    rounds.add(0, 2)
    assert rounds.should_step(target=2, last_batch=True)
    assert rounds.pop()["empty_steps"] == 1.0
    for _ in range(3):
        rounds.add(0, 2)
    with pytest.warns(UserWarning, match="0 informative group"):
        assert rounds.should_step(target=2, last_batch=False)


@pytest.mark.integration
def test_only_informative_groups_are_trained_and_rounds_are_counted(
    tmp_path, module, trainer, loader, monkeypatch
):
    trained_rows: list[int] = []
    original = backward_module.grpo_loss

    def spy(logp, old_logp, ref_logp, advantages, mask, settings, behav_logp=None):
        trained_rows.append(advantages.numel())
        return original(logp, old_logp, ref_logp, advantages, mask, settings, behav_logp)

    monkeypatch.setattr(backward_module, "grpo_loss", spy)
    kinds = ["flat", "flat", "flat", "live", "live", "live", "live", "flat", "live", "live"]
    records = [{"prompt": f"q{i}", "kind": k} for i, k in enumerate(kinds)]
    steps: list[dict[str, float]] = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if pl_module.last_step.metrics:
                steps.append(pl_module.last_step.metrics)

    grpo = module(reward=flat_or_live, dynamic_sampling=True, gradient_accumulation_steps=1)
    trainer(tmp_path, max_steps=2, callbacks=[Steps()]).fit(grpo, loader(records, batch_size=2))
    # Rounds of 2 prompts: [flat flat] [flat live] [live live] -> step 1, [live flat] [live live] -> 2
    assert [s["train/sampling_rounds"] for s in steps] == [3.0, 2.0]
    assert [s["train/groups_dropped"] for s in steps] == [3.0, 1.0]
    assert trained_rows == [4, 8, 4, 8]  # G = 4 rows per informative group; none for the flat round
    assert [s["train/empty_steps"] for s in steps] == [0.0, 0.0]
    assert steps[0]["train/frac_zero_std_groups"] == pytest.approx(0.5)  # of what was sampled


@pytest.mark.integration
def test_a_step_without_any_informative_group_changes_nothing_but_counts(tmp_path, module, trainer, loader):
    grpo = module(reward=flat_or_live, dynamic_sampling=True, max_sampling_rounds=2, weight_decay=0.1)
    grpo.configure_model()
    before = {k: v.clone() for k, v in grpo.model.state_dict().items()}
    fit = trainer(tmp_path, max_steps=1)
    with pytest.warns(UserWarning, match="stepping with what there is"):
        fit.fit(grpo, loader([{"prompt": f"q{i}", "kind": "flat"} for i in range(6)], batch_size=2))
    assert fit.global_step == 1 and grpo.last_step.metrics["train/empty_steps"] == 1.0
    for key, value in grpo.model.state_dict().items():  # no update, no weight decay either
        assert torch.equal(value, before[key])


@pytest.mark.integration
def test_dynamic_sampling_needs_max_steps(tmp_path, module, trainer, loader):
    grpo = module(reward=flat_or_live, dynamic_sampling=True)
    with pytest.raises(ValueError, match="max_steps"):
        trainer(tmp_path).fit(grpo, loader([{"prompt": "q", "kind": "live"}]))


@pytest.mark.integration
def test_a_skipped_step_ends_its_rounds_too(tmp_path, module, trainer, loader):
    grpo = module(reward=flat_or_live, dynamic_sampling=True, gradient_accumulation_steps=1, kl_beta=0.0)
    grpo.configure_model()
    calls = {"n": 0}

    def poison_first(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 1 else grad

    next(grpo.model.parameters()).register_hook(poison_first)
    steps: list[dict[str, float]] = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if pl_module.last_step.metrics:
                steps.append(pl_module.last_step.metrics)

    fit = trainer(tmp_path, max_steps=1, callbacks=[Steps()])
    with pytest.warns(UserWarning, match="non-finite"):
        fit.fit(grpo, loader([{"prompt": f"q{i}", "kind": "live"} for i in range(4)], batch_size=2))
    assert [s["train/skipped_steps"] for s in steps] == [1.0, 0.0]
    assert [s["train/sampling_rounds"] for s in steps] == [
        1.0,
        1.0,
    ]  # not 2: the skipped step's round is gone
