"""Fault injection: every bad input or bad number fails clearly, or is survived and counted.

(Resume after SIGKILL and a crash mid-save are in test_resume.py.)
"""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.data import PromptDataModule, load_gsm8k
from forge_lightning.models.loading import ModelLoadError, load_model
from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
)


def test_missing_dataset_path_fails_before_training(tmp_path):
    data = PromptDataModule(source="local", path=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError):
        data.setup("fit")


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"answer": "#### 3"}, "question"),
        ({"question": "", "answer": "#### 3"}, "question"),
        ({"question": "How many?", "answer": "three"}, "####"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, row, problem):
    path = tmp_path / "train.jsonl"
    good = {"question": "1+1?", "answer": "#### 2"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=problem) as err:
        load_gsm8k(path=tmp_path)
    assert "train.jsonl" in str(err.value) and "2" in str(err.value)


def test_empty_dataset_is_an_error(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ValueError):
        load_gsm8k(path=tmp_path)


@pytest.mark.integration
def test_reward_that_raises_names_reward_and_sample(tmp_path, module, trainer, loader):
    def fragile(prompts, responses, tag):
        if "bad" in tag:
            raise ZeroDivisionError("odd completion")
        return [0.0] * len(responses)

    records = [{"prompt": "q", "tag": "ok"}, {"prompt": "r", "tag": "bad"}]  # group 4: samples 4-7 fail
    with pytest.raises(RuntimeError, match="fragile") as err:
        trainer(tmp_path, max_steps=1).fit(module(reward=fragile), loader(records, batch_size=2))
    assert "sample 4" in str(err.value)


@pytest.mark.integration
def test_a_reward_that_calls_sys_exit_ends_the_fit_with_a_message_naming_it(
    tmp_path, module, trainer, loader
):
    def quitter(prompts, responses):
        raise SystemExit(3)

    with pytest.raises(SystemExit) as stop:
        trainer(tmp_path, max_steps=1).fit(module(reward=quitter), loader([{"prompt": "q"}]))
    assert isinstance(stop.value.code, str)  # exit status 1, the message printed
    assert stop.value.code.startswith("reward 'quitter' raised SystemExit(3) from its own code")


@pytest.mark.integration
def test_reward_errors_score_zero_and_are_counted_when_asked(tmp_path, module, trainer, loader):
    def flaky(prompts, responses, tag):
        if "bad" in tag:
            raise ValueError("cannot score")
        return [1.0] * len(responses)

    counted: list[dict[str, float]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            counted.append(pl_module.last_step.metrics)

    from forge_lightning.callbacks import RewardLogger

    records = [{"prompt": "q", "tag": "ok"}, {"prompt": "r", "tag": "bad"}]
    grpo = module(reward=flaky, on_reward_error="zero", gradient_accumulation_steps=1)
    callbacks = [Record(), RewardLogger(logging_steps=1)]
    with pytest.warns(UserWarning, match="raised on 4 of 8 samples, which score 0.0"):
        trainer(tmp_path, callbacks=callbacks).fit(grpo, loader(records, batch_size=2))
    assert counted[0]["train/reward_errors"] == 4.0
    assert counted[0]["train/reward"] == 0.5  # the failing half scored 0, the rest 1
    (line,) = (tmp_path / "training_log.jsonl").read_text().splitlines()
    assert json.loads(line)["reward_errors"] == 4.0  # the run's file says how many failed too


@pytest.mark.integration
@pytest.mark.parametrize("bad", [[1.0, 2.0], [None, 1.0, 1.0, 1.0], [float("nan")] * 4, [float("inf")] * 4])
def test_bad_reward_values_are_clear_errors(tmp_path, bad, module, trainer, loader):
    def broken(prompts, responses):
        return bad

    with pytest.raises(ValueError, match="broken"):
        trainer(tmp_path, max_steps=1).fit(module(reward=broken), loader([{"prompt": "q"}]))


def poison_gradients(grpo, bad_batches: int) -> None:
    """Make the first ``bad_batches`` backward passes produce NaN gradients."""
    seen = {"n": 0}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen["n"] += 1
        return grad * float("nan") if seen["n"] <= bad_batches else grad

    next(grpo.model.parameters()).register_hook(hook)


@pytest.mark.integration
def test_non_finite_gradient_skips_the_step_and_is_counted(tmp_path, module, trainer, loader, count_a):
    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0)
    grpo.configure_model()
    poison_gradients(grpo, bad_batches=2)
    before = {k: v.clone() for k, v in grpo.model.state_dict().items()}
    skipped: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            skipped.append(pl_module.last_step.metrics["train/skipped_steps"])

    fit = trainer(tmp_path, callbacks=[Record()])
    with pytest.warns(UserWarning, match="non-finite"):
        fit.fit(grpo, loader([{"prompt": "q"}] * 2))
    assert skipped == [1.0, 1.0]
    assert fit.global_step == 0  # no optimizer step happened
    for key, value in grpo.model.state_dict().items():
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, before[key])


@pytest.mark.integration
def test_training_stops_after_too_many_bad_steps_in_a_row(tmp_path, module, trainer, loader, count_a):
    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0, max_consecutive_bad_steps=3)
    grpo.configure_model()
    poison_gradients(grpo, bad_batches=100)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="3 optimizer steps in a row"):
        trainer(tmp_path).fit(grpo, loader([{"prompt": "q"}] * 5))


@pytest.mark.integration
def test_immediate_eos_completions_train_without_dividing_by_zero(tmp_path, module, trainer, loader):
    grpo = module(reward=lambda prompts, responses: [float(len(r)) for r in responses])
    grpo.configure_model()
    eos = grpo.tokenizer.eos_token_id

    class AlwaysEOS:
        capabilities = EngineCapabilities()

        def generate(self, model, request: GenerationRequest) -> Completions:
            return Completions(torch.full((request.prompt_ids.shape[0] * request.group_size, 3), eos))

        def sync_weights(self, model) -> None:
            pass

    grpo.engine = AlwaysEOS()
    metrics: dict[str, Any] = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            metrics.update(pl_module.last_step.metrics)

    trainer(tmp_path, max_steps=1, callbacks=[Record()]).fit(grpo, loader([{"prompt": "q"}]))
    assert metrics["train/completion_length"] == 1.0  # just the EOS
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.integration
def test_prompt_longer_than_the_limit_errors_when_configured(tmp_path, module, trainer, loader):
    grpo = module(max_prompt_length=2, prompt_truncation="error")
    with pytest.raises(ValueError, match="max_prompt_length"):
        trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "a long prompt"}]))


def test_model_that_cannot_be_loaded_offline_says_what_to_do():
    with pytest.raises(ModelLoadError, match="embedded"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("./no/such/folder")


@pytest.mark.integration
def test_same_seed_gives_identical_losses_and_rewards(tmp_path, module, trainer, loader):
    def run() -> list[dict[str, float]]:
        pl.seed_everything(11)
        tok = make_tokenizer()
        grpo = module(model=make_model(len(tok), seed=4), tokenizer=tok, gradient_accumulation_steps=1)
        seen: list[dict[str, float]] = []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, *args):
                seen.append(pl_module.last_step.metrics)

        trainer(tmp_path, callbacks=[Record()]).fit(grpo, loader([{"prompt": "q"}] * 3))
        return [{k: m[f"train/{k}"] for k in ("loss", "reward", "kl", "grad_norm")} for m in seen]

    assert run() == run()


@pytest.mark.integration
def test_an_enormous_prompt_is_cut_to_the_models_context_by_default(tmp_path, module, trainer, loader):
    seen: list[int] = []

    def length(prompts, responses):
        seen.append(len(prompts[0]))
        return [0.0] * len(responses)

    grpo = module(reward=length, gradient_accumulation_steps=1)  # context 512, max_new_tokens 8
    grpo.configure_model()
    assert grpo.episodes.prompts.max_prompt_length == 512 - 8
    with pytest.warns(UserWarning, match="truncated from the left"):
        trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "a" * 200_000}]))
    assert seen  # the step ran
