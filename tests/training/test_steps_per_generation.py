"""steps_per_generation: one generation split into several optimizer steps (training/plan.py)."""

from __future__ import annotations

import json
import math
import re

import lightning.pytorch as pl
import pytest
import torch
from helpers.engines import FixedCompletions
from helpers.gradients import exact_settings, other_reference
from helpers.models import make_model
from helpers.rewards import varied
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from forge_lightning.callbacks import HFCheckpoint, RewardLogger
from forge_lightning.grpo import group_advantages, grpo_loss
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.engines.base import EngineCapabilities
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.training.plan import Pass, generation_shares, take_share

RECORDS = [{"prompt": "ab"}, {"prompt": "abc d"}, {"prompt": "bb a"}, {"prompt": "cab"}]


class StepSpy(pl.Callback):
    """Each optimizer step's gradients and the weights they were taken at."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []
        self.weights: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.clone() for p in pl_module.model.parameters()])
        self.weights.append([p.detach().clone() for p in pl_module.model.parameters()])


def fit_generation(tmp_path, trainer, loader, records, batch_size, max_steps, **settings):
    """A seeded run of the tiny float64 module on FixedCompletions; its StepSpy and module."""
    pl.seed_everything(1)
    grpo = GRPOLightningModule(**exact_settings(learning_rate=5e-2, **settings))
    grpo.engine = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
    spy = StepSpy()
    fit = trainer(tmp_path, max_steps=max_steps, callbacks=[other_reference(), spy])
    fit.fit(grpo, loader(records, batch_size=batch_size))
    return spy, grpo, fit


@pytest.mark.integration
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "forge"])
def test_two_steps_of_one_generation_equal_two_hand_built_steps_on_its_halves(
    tmp_path, trainer, loader, loss_type
):
    spy, _, fit = fit_generation(
        tmp_path, trainer, loader, RECORDS[:2], 2, 2, loss_type=loss_type, steps_per_generation=2
    )
    assert fit.global_step == 2 and len(spy.grads) == 2

    # By hand: the same generation sampled from the initial weights, its old-policy log-probs
    # fixed there, then each half's loss at the weights its step saw.
    pl.seed_everything(1)
    hand = GRPOLightningModule(**exact_settings(learning_rate=5e-2, loss_type=loss_type))
    hand.engine = FixedCompletions(len(hand.tokenizer), hand.tokenizer.eos_token_id)
    hand.configure_model()
    prompts = [r["prompt"] for r in RECORDS[:2]]
    rollout = hand.episodes(hand.model, prompts, hand.sampling, 4)
    rewards = torch.tensor(varied([], rollout.completions))
    advantages = group_advantages(rewards, 4)
    scorer = LogProbScorer(temperature=hand.scorer.temperature)
    reference = make_model(len(hand.tokenizer), seed=5).double()
    old_logp = scorer.log_probs_no_grad(hand.model, rollout)
    ref_logp = scorer.log_probs_no_grad(reference, rollout)
    for step in range(2):
        with torch.no_grad():
            for param, weight in zip(hand.model.parameters(), spy.weights[step]):
                param.copy_(weight)
        share, adv, old, ref = take_share(
            Pass(slice(step, step + 1), True), rollout, advantages, old_logp, ref_logp
        )
        (whole,) = scorer.micro_batches(share, hand.model)
        logp, _ = scorer.log_probs_and_entropy(hand.model, share, whole)
        loss, _ = grpo_loss(logp, old, ref, adv, share.loss_mask(), hand.loss_settings)
        expected = torch.autograd.grad(loss, list(hand.model.parameters()), allow_unused=True)
        assert any(g is not None and g.abs().sum() > 0 for g in expected)
        scale = max(float(g.abs().max()) for g in expected if g is not None)
        for got, want in zip(spy.grads[step], expected):
            want = torch.zeros_like(got) if want is None else want
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale)  # float32 rewards
    # The second step's weights are the first step's result: its half is trained off-policy.
    assert any(not torch.equal(a, b) for a, b in zip(spy.weights[0], spy.weights[1]))


@pytest.mark.integration
def test_accumulation_inside_a_generation_steps_as_accumulation_over_batches(tmp_path, trainer, loader):
    # S = 2 steps of 2 shares each: the first step's gradient is that of an ordinary accumulated
    # step over the generation's first two prompts (both on the initial weights).
    within, _, fit = fit_generation(
        tmp_path / "a", trainer, loader, RECORDS, 4, 2, steps_per_generation=2, gradient_accumulation_steps=2
    )
    assert fit.global_step == 2
    over, _, _ = fit_generation(
        tmp_path / "b", trainer, loader, RECORDS[:2], 1, 1, gradient_accumulation_steps=2
    )
    for a, b in zip(within.grads[0], over.grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


@pytest.mark.integration
def test_num_iterations_repeats_the_generations_steps_with_one_old_policy_forward(
    tmp_path, trainer, loader, monkeypatch
):
    forwards = []
    original = LogProbScorer.log_probs_no_grad

    def counted(self, model, rollout):
        forwards.append(rollout.completion_ids.shape[0])
        return original(self, model, rollout)

    monkeypatch.setattr(LogProbScorer, "log_probs_no_grad", counted)
    spy, grpo, fit = fit_generation(
        tmp_path, trainer, loader, RECORDS[:2], 2, 4, steps_per_generation=2, num_iterations=2, kl_beta=0.0
    )
    assert fit.global_step == 4 and len(spy.grads) == 4
    assert forwards == [8]  # the old policy's log-probs: the whole generation, once
    assert grpo.lr_schedulers().last_epoch == 4


def test_generation_shares_split_by_whole_groups_in_order():
    assert generation_shares(4, 2, 1) == [Pass(slice(0, 2), True), Pass(slice(2, 4), True)]
    assert [p.step_after for p in generation_shares(4, 2, 2)] == [False, True, False, True]
    assert [(p.groups.start, p.groups.stop) for p in generation_shares(5, 2, 1)] == [(0, 3), (3, 5)]
    with pytest.raises(
        ValueError, match=r"data.prompts_per_step \(the training DataLoader's batch_size\) to at least 4"
    ):
        generation_shares(3, 2, 2)


class NoGeneration:
    """An engine that fails if asked: a refusal meant to come before any generation came after one."""

    capabilities = EngineCapabilities()

    def generate(self, model, request):
        raise AssertionError("generated before the refusal")

    def sync_weights(self, model) -> None:
        pass


@pytest.mark.integration
@pytest.mark.parametrize(
    ("data", "steps", "said"),
    [
        ({"prompts_per_step": 3, "max_samples": 8}, 4, r"data.prompts_per_step=3 .* at least 4"),
        # 6 prompts in batches of 4: the epoch's last batch holds 2, fewer than the 4 shares
        ({"prompts_per_step": 4, "max_samples": 6}, 4, r"last batch holds 2 .*data.max_samples"),
    ],
)
def test_data_whose_batches_cannot_be_split_is_refused_before_any_generation(
    tmp_path, module, trainer, data, steps, said
):
    from forge_lightning.data import PromptDataModule

    grpo = module(steps_per_generation=2, gradient_accumulation_steps=2)
    grpo.engine = NoGeneration()
    datamodule = PromptDataModule(source="mock", val_max_samples=1, **data)
    with pytest.raises(ValueError, match=said):
        trainer(tmp_path, max_steps=steps, limit_val_batches=0).fit(grpo, datamodule=datamodule)


@pytest.mark.integration
def test_a_last_batch_the_run_never_reaches_is_not_refused(tmp_path, module, trainer):
    from forge_lightning.data import PromptDataModule

    grpo = module(steps_per_generation=2, gradient_accumulation_steps=2)
    grpo.engine = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
    datamodule = PromptDataModule(source="mock", prompts_per_step=4, max_samples=6, val_max_samples=1)
    fit = trainer(tmp_path, max_steps=2, limit_val_batches=0)
    fit.fit(grpo, datamodule=datamodule)  # one batch of 4: the last, of 2, is never trained
    assert fit.global_step == 2


@pytest.mark.integration
def test_the_default_hf_checkpoint_cadence_fits_the_generations_steps(tmp_path, module, trainer, loader):
    grpo = module(steps_per_generation=3, gradient_accumulation_steps=1)
    grpo.engine = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
    saver = HFCheckpoint(save_final=False)  # the save_steps the user never set
    fit = trainer(tmp_path, callbacks=[saver], max_steps=6)
    fit.fit(grpo, loader(RECORDS[:3] * 2, batch_size=3))  # refused before: 100 is no multiple of 3
    assert fit.global_step == 6
    assert saver.every(grpo) == 102  # every 100 steps, rounded up to the 3 each batch takes
    assert HFCheckpoint(save_steps=5).every(grpo) == 5  # one the user set is used as it is (or refused)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("kwargs", "callbacks", "named"),
    [
        ({"max_steps": 3}, [], "trainer.max_steps=3"),
        (
            {"max_steps": 4},
            [ModelCheckpoint(every_n_train_steps=3)],
            "ModelCheckpoint(every_n_train_steps=3)",
        ),
        ({"max_steps": 4}, [HFCheckpoint(save_steps=5)], "HFCheckpoint(save_steps=5)"),
    ],
)
def test_step_cadences_that_are_not_multiples_of_the_generations_steps_are_refused(
    tmp_path, module, trainer, loader, kwargs, callbacks, named
):
    grpo = module(steps_per_generation=2, gradient_accumulation_steps=1)
    checkpoints = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    fit = trainer(tmp_path, callbacks=callbacks, enable_checkpointing=checkpoints, **kwargs)
    with pytest.raises(ValueError, match="multiples of 2: " + re.escape(named)):
        fit.fit(grpo, loader(RECORDS, batch_size=2))


@pytest.mark.integration
def test_a_generation_logs_once_per_batch_and_sizes_the_schedule_in_steps(tmp_path, module, trainer, loader):
    grpo = module(steps_per_generation=2, gradient_accumulation_steps=1, warmup_steps=0)
    logger = RewardLogger(output_dir=str(tmp_path / "log"), logging_steps=1)
    fit = trainer(tmp_path, callbacks=[logger], max_epochs=1)
    fit.fit(grpo, loader(RECORDS, batch_size=2))
    assert fit.global_step == 4  # 2 batches x 2 steps
    lines = (tmp_path / "log" / "training_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    # The cosine schedule was sized for 4 steps: it ends at zero.
    assert grpo.lr_schedulers().get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


class Recorded(Logger):
    """A logger that keeps every ``(name, step, value)`` it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[tuple[str, int, float]] = []

    name, version = "recorded", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.points += [(key, step, float(value)) for key, value in metrics.items()]

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, value) for key, step, value in self.points if key == name]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("settings", "batch_size", "starts", "ends"),
    [
        ({"steps_per_generation": 2}, 2, [1, 3, 5], [2, 4, 6]),
        ({"steps_per_generation": 3}, 3, [1, 4], [3, 6]),
        ({"gradient_accumulation_steps": 2}, 1, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]),
        ({}, 1, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]),
    ],
)
def test_learning_rate_monitor_and_train_lr_show_the_rate_each_step_used(
    tmp_path, module, trainer, loader, settings, batch_size, starts, ends
):
    from lightning.pytorch.callbacks import LearningRateMonitor

    grpo = module(**{"gradient_accumulation_steps": 1, **settings}, lr_schedule="cosine", warmup_steps=0)
    grpo.engine = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
    used: list[float] = []  # the rate each optimizer step used, read as it steps

    class Rates(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.optimizers().optimizer.register_step_pre_hook(
                lambda optimizer, *_: used.append(optimizer.param_groups[0]["lr"])
            )

    logger = Recorded()
    fit = trainer(
        tmp_path, callbacks=[LearningRateMonitor(), Rates()], logger=logger, log_every_n_steps=1, max_steps=6
    )
    fit.fit(grpo, loader(RECORDS[:3] * 4, batch_size=batch_size))
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * n / 6)) for n in range(6)]
    assert used == pytest.approx(cosine)  # step n used cosine[n - 1]
    # One curve: at step n, each logs the rate optimizer step n used. The monitor reads it at a
    # batch's start (its first step), train/lr at the batch's end (its last step).
    monitor, train = dict(logger.series("lr-AdamW")), dict(logger.series("train/lr"))
    assert sorted(monitor) == starts and sorted(train) == ends
    assert monitor == {n: pytest.approx(used[n - 1]) for n in starts}
    assert train == {n: pytest.approx(used[n - 1]) for n in ends}
    assert all(monitor[n] == pytest.approx(train[n]) for n in set(monitor) & set(train))
