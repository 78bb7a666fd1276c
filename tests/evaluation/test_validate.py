"""`forge-lightning validate`: a checkpoint folder (full or LoRA adapter) on the validation split."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from forge_lightning.callbacks import HFCheckpoint, RewardLogger
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.models.lora import LoraSettings
from forge_lightning.module import GRPOLightningModule

pytestmark = pytest.mark.integration  # every test here builds a Trainer or starts a process

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
VAL_KEYS = {
    "val/accuracy",
    "val/reward",
    "val/rewards/GSM8KAnswerReward",
    "val/completion_length",
    "val/truncated_fraction",
}


@pytest.fixture
def validate(tiny_overrides) -> Callable[[Path, Path], dict[str, float]]:
    """``validate(model, out)``: `forge-lightning validate` with smoke.yaml on ``model``; its metrics."""

    def run(model: Path, out: Path) -> dict[str, float]:
        cli = build_cli(
            ["validate", "--config", str(SMOKE), *tiny_overrides(model, out), "--trainer.limit_val_batches=1"]
        )
        return {k: float(v) for k, v in cli.trainer.callback_metrics.items()}

    return run


def test_validate_reports_accuracy_reward_and_length(validate, tiny_model_dir, tmp_path, capsys):
    metrics = validate(tiny_model_dir, tmp_path / "val")
    assert VAL_KEYS <= metrics.keys()
    # smoke.yaml's reward is GSM8K's answer check, the default accuracy too: on the same greedy
    # completions and references the two agree.
    assert metrics["val/accuracy"] == metrics["val/rewards/GSM8KAnswerReward"]
    assert 1.0 <= metrics["val/completion_length"] <= 6.0  # smoke.yaml's length cut to 6 by the overrides
    assert "val/accuracy" in capsys.readouterr().out  # Lightning's results table


def test_validate_writes_every_answer_beside_the_metrics(validate, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "val"
    metrics = validate(tiny_model_dir, out)
    (answers,) = (out / "validation").iterdir()  # named for the model spec's last two path parts
    assert answers.name == f"validate-{tiny_model_dir.parent.name}-{tiny_model_dir.name}.jsonl"
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(rows) == 16  # smoke.yaml validates on 16 dev problems, one batch
    assert set(rows[0]) == {
        "prompt",
        "completion",
        "reference",
        "reward",
        "correct",
        "completion_length",
        "truncated",
    }
    assert sum(r["correct"] for r in rows) / len(rows) == pytest.approx(metrics["val/accuracy"])
    assert sum(r["truncated"] for r in rows) / len(rows) == pytest.approx(metrics["val/truncated_fraction"])
    assert sum(r["completion_length"] for r in rows) / len(rows) == pytest.approx(
        metrics["val/completion_length"]
    )
    assert all(r["prompt"].rstrip().endswith("Solution:") for r in rows)
    assert f"validation of {tiny_model_dir} | accuracy" in capsys.readouterr().out


def test_each_validate_keeps_its_own_answers_named_for_the_checkpoints_step(
    module, trainer, loader, tiny_model_dir, tmp_path, capsys
):
    records = [{"prompt": "q", "reference": "1"}] * 2
    grpo = module(gradient_accumulation_steps=1, kl_beta=0.0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    trainer(tmp_path, max_steps=2, callbacks=[ckpt], enable_checkpointing=True).fit(grpo, loader(records))
    last = tmp_path / "checkpoints" / "last.ckpt"
    for _ in range(2):  # the same checkpoint twice: two files
        trainer(tmp_path, callbacks=[RewardLogger()]).validate(grpo, loader(records), ckpt_path=last)
    baseline = GRPOLightningModule(model=str(tiny_model_dir), group_size=2, max_new_tokens=4)
    trainer(tmp_path, callbacks=[RewardLogger()]).validate(baseline, loader(records))
    assert sorted(p.name for p in (tmp_path / "validation").iterdir()) == [
        f"validate-{tiny_model_dir.parent.name}-{tiny_model_dir.name}.jsonl",  # no step known
        "validate-step-2-last-2.jsonl",
        "validate-step-2-last.jsonl",
    ]
    assert f"validation of {last} at step 2 | accuracy" in capsys.readouterr().out


def val_metrics(trainer: Any, root: Path, grpo: GRPOLightningModule, data: Any) -> dict[str, float]:
    """Run ``Trainer.validate`` on ``data`` with the ``trainer(root, **kwargs)`` factory; the metrics."""
    (results,) = trainer(root).validate(grpo, data)
    return {k: float(v) for k, v in results.items()}


@pytest.mark.parametrize("score", [1.0, 0.0])
def test_val_accuracy_is_the_mean_of_the_accuracy_setting(score, module, trainer, loader, tmp_path):
    def constant(prompts: list[str], responses: list[str]) -> list[float]:
        return [score] * len(responses)

    records = [{"prompt": f"q{i}", "reference": str(i)} for i in range(3)]
    metrics = val_metrics(trainer, tmp_path, module(accuracy=constant), loader(records, batch_size=2))
    assert metrics["val/accuracy"] == score


def test_accuracy_sees_each_prompts_reference_and_greedy_completion(module, trainer, loader, tmp_path):
    seen: list[tuple[list[str], list[str]]] = []

    def is_yes(prompts: list[str], responses: list[str], references: list[str]) -> list[float]:
        seen.append((list(prompts), list(references)))
        assert len(responses) == len(prompts)  # one greedy completion per prompt, not a group
        return [float(ref == "yes") for ref in references]

    records = [
        {"prompt": p, "reference": r} for p, r in [("a", "yes"), ("b", "no"), ("c", "yes"), ("d", "no")]
    ]
    metrics = val_metrics(trainer, tmp_path, module(accuracy=is_yes), loader(records, batch_size=2))
    assert metrics["val/accuracy"] == 0.5
    assert [pair for prompts, refs in seen for pair in zip(prompts, refs)] == [
        (r["prompt"], r["reference"]) for r in records
    ]


def test_no_val_accuracy_without_references(module, trainer, loader, tmp_path):
    def never_called(prompts: list[str], responses: list[str]) -> list[float]:
        raise AssertionError("accuracy scored a batch with no references")

    metrics = val_metrics(trainer, tmp_path, module(accuracy=never_called), loader([{"prompt": "q"}]))
    assert "val/accuracy" not in metrics and "val/reward" in metrics


def test_validate_with_validation_switched_off_is_an_error_saying_what_to_pass(
    tiny_overrides, tiny_model_dir, tmp_path
):
    with pytest.raises(SystemExit, match="--trainer.limit_val_batches 1.0"):
        build_cli(["validate", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path)])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_validate_evaluates_a_checkpoint_folder_written_by_hf_checkpoint(
    kind, validate, trainer, loader, tiny_model_dir, tmp_path
):
    if kind == "lora":
        pytest.importorskip("peft")
    grpo = GRPOLightningModule(
        model=str(tiny_model_dir),
        group_size=2,
        max_new_tokens=4,
        gradient_accumulation_steps=1,
        peft=LoraSettings(r=4, alpha=8) if kind == "lora" else None,
    )
    trainer(tmp_path, max_steps=1, callbacks=[HFCheckpoint(save_steps=0)]).fit(
        grpo, loader([{"prompt": "1 + 1 = ?", "reference": "2"}])
    )
    folder = tmp_path / "final"
    assert (folder / ("adapter_config.json" if kind == "lora" else "model.safetensors")).is_file()

    metrics = validate(folder, tmp_path / "val")
    assert VAL_KEYS <= metrics.keys()


class RecordingLogger(Logger):
    """A logger that keeps each ``log_metrics`` call as (step, metric names)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, set[str]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, set(metrics)))

    def val_steps(self) -> list[int | None]:
        return [step for step, names in self.calls if "val/accuracy" in names]


def test_the_sanity_check_validation_reaches_no_logger(module, trainer, loader, tmp_path):
    # Lightning logs nothing of its sanity check; a val/* point at step 0 would be read as the
    # untrained model's accuracy.
    records = [{"prompt": f"q{i}", "reference": "1"} for i in range(2)]
    logger = RecordingLogger()
    fit = trainer(tmp_path, max_steps=2, logger=logger, num_sanity_val_steps=1, val_check_interval=2)
    fit.fit(module(gradient_accumulation_steps=1), loader(records), loader(records))
    assert logger.val_steps() == [2]


def test_validate_returns_the_metrics_alone_and_logs_them_at_the_checkpoints_step(
    module, trainer, loader, tmp_path
):
    records = [{"prompt": "q", "reference": "1"}] * 2
    grpo = module(gradient_accumulation_steps=1, kl_beta=0.0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    trainer(tmp_path, max_steps=2, callbacks=[ckpt], enable_checkpointing=True).fit(grpo, loader(records))
    logger = RecordingLogger()
    last = tmp_path / "checkpoints" / "last.ckpt"
    (results,) = trainer(tmp_path, logger=logger).validate(grpo, loader(records), ckpt_path=last)
    assert "step" not in results and "val/accuracy" in results
    assert logger.val_steps() == [2]
