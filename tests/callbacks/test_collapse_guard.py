"""CollapseGuard: the rule on values written by hand, an exact snapshot, and fits whose reward
collapses (scripted) or drops (sampled), resumed through the CLI after a rollback."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.loggers import Logger

from forge_lightning.callbacks import CollapseGuard
from forge_lightning.callbacks.collapse_guard import (
    ROLLBACKS,
    CollapseRule,
    CollapseWatch,
    Snapshot,
    cpu_copy,
)
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.run.folder import LOG_NAME

ROOT = Path(__file__).resolve().parents[2]
COLLAPSE_AT = 4  # the optimizer step whose rewards the scripted reward collapses


def verdicts(watch: CollapseWatch, values: list[float]) -> list[str]:
    return [watch.observe(step, value) for step, value in enumerate(values, start=1)]


def test_a_drop_below_the_best_is_a_collapse_after_the_patience():
    watch = CollapseWatch(CollapseRule("max", drop=0.3), patience=2)
    seen = verdicts(watch, [0.2, 0.5, 0.4, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1])
    # 0.1 is more than 0.3 below the best 0.5; a healthy 0.3 in between starts the count again.
    assert seen == ["best", "best", "healthy", "bad", "healthy", "bad", "collapse", "bad", "collapse"]
    assert (watch.best, watch.best_step) == (0.5, 2)


@pytest.mark.parametrize(
    ("rule", "values", "expected"),
    [
        (CollapseRule("min", drop=1.0), [3.0, 2.0, 2.5, 3.01], ["best", "best", "healthy", "collapse"]),
        (CollapseRule("max", min_value=0.1), [0.5, 0.2, 0.05], ["best", "healthy", "collapse"]),
        (CollapseRule("max", max_value=60.0), [10.0, 64.0], ["best", "collapse"]),
        (CollapseRule("max", drop=10.0), [1.0, math.nan], ["best", "collapse"]),
        (CollapseRule("max", drop=10.0), [math.inf], ["collapse"]),
    ],
)
def test_each_rule_alone_makes_a_collapse(rule, values, expected):
    assert verdicts(CollapseWatch(rule, patience=1), values) == expected


def test_the_watch_survives_a_checkpoint():
    watch = CollapseWatch(CollapseRule("max", drop=0.3), patience=2)
    verdicts(watch, [0.5, 0.1])
    buffer = io.BytesIO()
    torch.save(watch.state_dict(), buffer)  # as a Lightning checkpoint holds it
    buffer.seek(0)
    resumed = CollapseWatch(CollapseRule("max", drop=0.3), patience=2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.observe(3, 0.1) == "collapse"


def test_a_snapshot_restores_weights_and_optimizer_state_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].bias.requires_grad_(False)  # frozen: not in the snapshot, and never changed
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(2)
    snapshot = Snapshot.take(2, 0.5, model, [optimizer])
    weights, state = cpu_copy(model.state_dict()), cpu_copy(optimizer.state_dict())
    assert "0.bias" not in snapshot.weights
    train(3)
    optimizer.param_groups[0]["lr"] = 0.05  # what the schedule set since
    snapshot.restore(model, [optimizer])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    restored = optimizer.state_dict()
    for index, moments in state["state"].items():
        for key, value in moments.items():
            assert torch.equal(restored["state"][index][key], value), (index, key)
    assert optimizer.param_groups[0]["lr"] == 0.05  # the current rate stays
    train(2)  # training on leaves the snapshot as it was: a second rollback restores the same
    snapshot.restore(model, [optimizer])
    assert all(torch.equal(t, weights[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({}, "collapse_guard needs a rule"),
        ({"drop": -0.1}, r"collapse_guard.drop must be None or >= 0"),
        ({"drop": 0.1, "mode": "up"}, "collapse_guard.mode must be 'max' or 'min'"),
        ({"drop": 0.1, "patience": 0}, "collapse_guard.patience must be an integer >= 1"),
        ({"drop": 0.1, "max_rollbacks": -1}, "collapse_guard.max_rollbacks must be an integer >= 0"),
        ({"drop": 0.1, "lr_scale": 0.0}, r"collapse_guard.lr_scale must be in \(0, 1\]"),
        ({"drop": 0.1, "kl_beta_scale": 0.5}, "collapse_guard.kl_beta_scale must be >= 1"),
        ({"min_value": 2.0, "max_value": 1.0}, "collapse_guard.min_value"),
    ],
)
def test_a_bad_setting_is_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        CollapseGuard(**kwargs)


def scripted(prompts: list[str], completions: list[str], trainer_state, **kwargs) -> list[float]:
    """Count 'a' characters (a tiny model's varied reward), but -2 for every completion of
    optimizer step COLLAPSE_AT: a scripted collapse of train/reward."""
    if trainer_state.global_step == COLLAPSE_AT - 1:  # the steps taken before this one
        return [-2.0] * len(completions)
    return [sum(ch == "a" for ch in c) / 8 for c in completions]


def collapsed_validation(prompts: list[str], completions: list[str], trainer_state, **kwargs) -> list[float]:
    """Count 'a' characters, but -2 for every completion scored after optimizer step COLLAPSE_AT
    (its validation, and the training batch of the step after it)."""
    if trainer_state.global_step == COLLAPSE_AT:
        return [-2.0] * len(completions)
    return [sum(ch == "a" for ch in c) / 8 for c in completions]


class RecordingLogger(Logger):
    """Every metric sent to a logger, with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class WeightSpy(pl.Callback):
    """Each optimizer step's trainable weights, optimizer state and logged metrics, as this
    callback's turn after the batch sees them; and the weights each batch starts from."""

    def __init__(self) -> None:
        self.starts: dict[int, dict[str, torch.Tensor]] = {}  # by the steps taken before the batch
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.moments: dict[int, dict] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self.starts[trainer.global_step] = trainable(pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        step = trainer.global_step
        self.weights[step] = trainable(pl_module)
        self.moments[step] = cpu_copy(trainer.optimizers[0].state_dict()["state"])
        self.metrics[step] = dict(pl_module.last_step.metrics)


def trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def guarded_fit(module, trainer, loader, root: Path, guard: CollapseGuard, reward=scripted, **kwargs):
    """Six steps of one prompt each under ``guard``, with a spy before it and one after it;
    ``kwargs``: the Trainer's (``val_check_interval``, ``logger``, ...)."""
    pl.seed_everything(0)
    before, after = WeightSpy(), WeightSpy()
    grpo = module(reward=reward, gradient_accumulation_steps=1, lr_schedule="constant")
    fit = trainer(root, max_steps=6, callbacks=[before, guard, after], **kwargs)
    val = loader([{"prompt": "v"}]) if "val_check_interval" in kwargs else None
    fit.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(6)]), val)
    return grpo, before, after


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.integration
def test_a_scripted_collapse_rolls_back_once_to_the_best_weights_and_trains_on_slower(
    tmp_path, module, trainer, loader
):
    guard, logger = (
        CollapseGuard("train/reward", drop=1.0, lr_scale=0.5, kl_beta_scale=2.0),
        RecordingLogger(),
    )
    with pytest.warns(UserWarning, match=rf"^CollapseGuard: train/reward = -2 at step {COLLAPSE_AT} "):
        grpo, before, after = guarded_fit(module, trainer, loader, tmp_path, guard, logger=logger)
    rewards = {step: before.metrics[step]["train/reward"] for step in range(1, COLLAPSE_AT)}
    best = max(rewards, key=lambda step: (rewards[step], -step))  # the first of the best
    (event,) = guard.events
    assert (event["step"], event["restored_step"], event["rollbacks"]) == (COLLAPSE_AT, best, 1)
    assert (event["lr_scale"], event["kl_beta_scale"]) == (0.5, 2.0)
    # After the rollback the weights and AdamW's state are those of the best step, bitwise, and
    # the collapsed step's update is gone; every other step is as it trained.
    assert same(after.weights[COLLAPSE_AT], before.weights[best])
    assert not same(after.weights[COLLAPSE_AT], before.weights[COLLAPSE_AT])
    for index, moments in before.moments[best].items():
        assert all(torch.equal(after.moments[COLLAPSE_AT][index][k], v) for k, v in moments.items())
    assert all(same(after.weights[s], before.weights[s]) for s in before.weights if s != COLLAPSE_AT)
    # The run goes on from there, at half the learning rate and twice the KL weight.
    lrs = [before.metrics[step]["train/lr"] for step in range(1, 7)]
    assert lrs == pytest.approx([1e-3] * COLLAPSE_AT + [5e-4] * (6 - COLLAPSE_AT))
    assert grpo.settings.loss.kl_beta == grpo.step.loss_passes.loss.kl_beta == pytest.approx(0.02)
    assert grpo.hparams.kl_beta == 0.01 and grpo.hparams.learning_rate == 1e-3  # the settings as given
    assert same(trainable(grpo), after.weights[6])
    # The event: in training_log.jsonl and, as guard/rollbacks, to the loggers at its step.
    logged = [json.loads(line) for line in (tmp_path / LOG_NAME).read_text().splitlines()]
    assert logged == [event]
    assert [(step, m) for step, m in logger.logged if ROLLBACKS in m] == [(COLLAPSE_AT, {ROLLBACKS: 1.0})]


@pytest.mark.integration
def test_a_validation_metric_rolls_back_to_the_weights_it_scored_best(tmp_path, module, trainer, loader):
    guard = CollapseGuard("val/reward", drop=1.0)
    with pytest.warns(UserWarning, match=rf"^CollapseGuard: val/reward = -2 at step {COLLAPSE_AT} "):
        _, before, _ = guarded_fit(
            module, trainer, loader, tmp_path, guard, reward=collapsed_validation, val_check_interval=1
        )
    (event,) = guard.events
    best = event["restored_step"]
    assert event["step"] == COLLAPSE_AT and best < COLLAPSE_AT and event["best"] == event["restored_value"]
    # Validated after step `best`, rolled back after step COLLAPSE_AT's validation: the next
    # batch starts from the weights of step `best`.
    assert same(before.starts[COLLAPSE_AT], before.weights[best])
    assert not same(before.starts[COLLAPSE_AT], before.weights[COLLAPSE_AT])


@pytest.mark.integration
def test_the_same_run_rolls_back_at_the_same_steps(tmp_path, module, trainer, loader, count_a):
    # Sampled, not scripted: train/reward of a tiny model counting 'a's (a few hundredths) drops
    # more than 0.02 below its best twice in six steps; where, the sampled completions decide.
    runs = []
    for name in ("first", "second"):
        guard = CollapseGuard("train/reward", drop=0.02, max_rollbacks=2)
        with pytest.warns(UserWarning, match="^CollapseGuard: "):
            grpo, _, after = guarded_fit(module, trainer, loader, tmp_path / name, guard, reward=count_a)
        runs.append((guard.events, after.weights[6]))
    (events, weights), (again, again_weights) = runs
    assert len(events) == 2 and events[0]["restored_step"] < events[0]["step"] < events[1]["step"]
    assert events == again and same(weights, again_weights)


def write_guard_config(path: Path) -> Path:
    guard = {"class_path": "forge_lightning.callbacks.CollapseGuard", "init_args": {"drop": 1.0}}
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [guard]}}))
    return path


@pytest.mark.integration
def test_a_run_resumed_after_a_rollback_trains_on_with_the_changed_settings(
    tiny_model_dir, tmp_path, tiny_overrides
):
    # smoke.yaml on the tiny model, its reward collapsing at step 4: the rollback comes before the
    # checkpoint of step 4 (Lightning runs ModelCheckpoint last), which the resume starts from.
    out = tmp_path / "run"
    args = ["fit", "--config", str(ROOT / "configs" / "smoke.yaml"), *tiny_overrides(tiny_model_dir, out)]
    args += ["--config", str(write_guard_config(tmp_path / "guard.yaml"))]
    args += ["--model.reward=test_collapse_guard.scripted", "--hf_checkpoint=null", "--trainer.logger=false"]
    with pytest.warns(UserWarning, match=f"^CollapseGuard: train/reward = -2 at step {COLLAPSE_AT} "):
        first = build_cli([*args, f"--trainer.max_steps={COLLAPSE_AT}"])
    assert first.model.adjustments.lr_scale == 0.5
    resumed = build_cli([*args, "--trainer.max_steps=6", "--ckpt_path=last"])  # the resume check accepts it
    assert (resumed.model.adjustments.lr_scale, resumed.model.adjustments.kl_beta_scale) == (0.5, 2.0)
    assert resumed.model.settings.loss.kl_beta == pytest.approx(0.02)  # kl_beta 0.01, doubled
    assert resumed.model.hparams.learning_rate == 3e-5 and resumed.model.hparams.kl_beta == 0.01
    (guard,) = [c for c in resumed.trainer.callbacks if isinstance(c, CollapseGuard)]
    assert guard.rollbacks == 1 and [e["step"] for e in guard.events] == [COLLAPSE_AT]
    lines = [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]
    (event,) = [line for line in lines if line.get("event") == "rollback"]
    assert event == guard.events[0]
    reports = [line for line in lines if "event" not in line]
    assert [r["step"] for r in reports] == [1, 2, 3, 4, 5, 6]  # no step repeated
    lrs = [r["lr"] for r in reports]
    assert lrs == pytest.approx([3e-5] * COLLAPSE_AT + [1.5e-5] * (6 - COLLAPSE_AT))
