"""GRPOLightningModule on a tiny Llama built in the test: the step, the optimizer cadence, learning."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.callbacks import ReferenceModel
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.engines.base import Completions, EngineCapabilities, GenerationRequest
from forge_lightning.rollout.sampler import encode_prompts
from forge_lightning.rollout.types import completion_mask


@pytest.mark.integration
def test_training_updates_policy_but_not_reference_and_counts_optimizer_steps(
    tmp_path, module, trainer, loader
):
    grpo = module(gradient_accumulation_steps=2)
    before = {k: v.clone() for k, v in grpo.model.state_dict().items()}
    seen_reference: list[torch.nn.Module] = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen_reference.append(pl_module.reference.model)

    fit = trainer(tmp_path, callbacks=[Spy()])
    fit.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(4)]))

    assert fit.global_step == 2  # 4 batches, accumulation 2
    assert any(not torch.equal(before[k], v) for k, v in grpo.model.state_dict().items())
    reference = seen_reference[-1]
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert all(not p.requires_grad for p in reference.parameters())
    assert (tmp_path / "reference" / "config.json").is_file()


@pytest.mark.integration
def test_last_batch_of_epoch_steps_even_when_accumulation_is_incomplete(tmp_path, module, trainer, loader):
    fit = trainer(tmp_path)
    fit.fit(module(gradient_accumulation_steps=4), loader([{"prompt": f"q{i}"} for i in range(5)]))
    assert fit.global_step == 2  # steps after batch 4 and after the last (5th) batch


@pytest.mark.integration
def test_mean_reward_rises_on_a_learnable_task(tmp_path, module, trainer, loader):
    pl.seed_everything(0)
    rewards: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            rewards.append(pl_module.last_step.metrics["train/reward"])

    grpo = module(
        group_size=8, learning_rate=3e-2, gradient_accumulation_steps=1, kl_beta=0.0, temperature=1.0
    )
    fit = trainer(tmp_path, callbacks=[Record()])
    fit.fit(grpo, loader([{"prompt": "x"}] * 60, batch_size=2))
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.2
    assert end >= 0.8, rewards


@pytest.mark.integration
def test_embedded_in_bare_trainer_with_extra_batch_keys(tmp_path, module, trainer, loader):
    received: dict[str, list[Any]] = {}

    def keyed_reward(prompts, responses, difficulty, **kwargs):
        received["difficulty"] = difficulty
        received["other"] = sorted(kwargs)
        return [1.0 if d == "hard" else 0.0 for d in difficulty]

    records = [{"prompt": "p1", "difficulty": "hard"}, {"prompt": "p2", "difficulty": "easy"}]
    fit = trainer(tmp_path, max_steps=1)
    fit.fit(module(reward=keyed_reward, gradient_accumulation_steps=1), loader(records, batch_size=2))
    assert received["difficulty"] == ["hard"] * 4 + ["easy"] * 4
    # no references (the batch had no "reference" key); the per-completion facts and TRL's
    # log_metric and trainer_state reach **kwargs
    assert received["other"] == [
        "completion_ids",
        "completion_lengths",
        "log_metric",
        "trainer_state",
        "truncated",
    ]
    assert fit.global_step == 1


@pytest.mark.integration
def test_kl_without_reference_callback_is_a_clear_error(tmp_path, module, trainer, loader):
    grpo = module()
    grpo.configure_callbacks = lambda: []
    with pytest.raises(RuntimeError, match="ReferenceModel"):
        trainer(tmp_path).fit(grpo, loader([{"prompt": "q"}]))


def test_no_reference_when_no_loss_term_needs_it(module):
    def references(grpo) -> int:
        return sum(isinstance(c, ReferenceModel) for c in grpo.configure_callbacks())

    assert references(module(kl_beta=0.0)) == 0
    assert references(module(kl_beta=0.0, loss_type="forge")) == 1


def test_the_engine_and_the_episode_runner_keep_their_old_names_with_a_warning(module):
    grpo, engine = module(), object()

    def episodes(*args, **kwargs):
        raise AssertionError("not sampled here")

    with pytest.warns(DeprecationWarning, match="generator is now engine"):
        grpo.generator = engine
    with pytest.warns(DeprecationWarning, match="sampler is now episodes"):
        grpo.sampler = episodes
    assert grpo.engine is engine and grpo.rollout_source.engine is engine
    assert grpo.episodes is episodes and grpo.rollout_source.runner is episodes
    with pytest.warns(DeprecationWarning):
        assert grpo.generator is engine and grpo.sampler is episodes


def test_model_object_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        GRPOLightningModule(model=make_model(10), tokenizer=None)


@pytest.mark.integration
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "forge"])
def test_micro_batches_give_the_unsplit_loss_and_gradient(step_gradients, loss_type):
    whole_loss, whole_grad = step_gradients(loss_type=loss_type, train_micro_batch_size=None)
    assert any(g.abs().sum() > 0 for g in whole_grad)
    # Group-aligned (shared prefix), not aligned (full forward), and packed by a token budget.
    for micro in (
        dict(train_micro_batch_size=4),
        dict(train_micro_batch_size=3),
        dict(train_micro_batch_tokens=20),
    ):
        loss, grad = step_gradients(loss_type=loss_type, **micro)
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-6)
        for a, b in zip(grad, whole_grad):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_the_trainers_reference_callback_is_used_with_its_own_folder(tmp_path, module, trainer, loader):
    grpo = module()
    own = ReferenceModel(output_dir=str(tmp_path / "elsewhere"))
    fit = trainer(tmp_path / "run", max_steps=1, callbacks=[own])
    fit.fit(grpo, loader([{"prompt": "q"}]))
    assert [cb for cb in fit.callbacks if isinstance(cb, ReferenceModel)] == [own]
    assert grpo.reference is own
    assert (tmp_path / "elsewhere" / "reference" / "config.json").is_file()
    assert not (tmp_path / "run" / "reference").exists()


def test_completion_mask_keeps_the_first_eos_even_though_pad_is_eos():
    eos = 1
    ids = torch.tensor([[5, 6, eos, eos, eos], [5, eos, 7, eos, 1], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, [eos]), expected)


def test_chat_template_is_used_when_the_tokenizer_has_one(module):
    plain, chat = make_tokenizer(), make_tokenizer(chat_template=True)
    grpo_chat = module(tokenizer=chat)
    assert grpo_chat.use_chat_template and not module(tokenizer=plain).use_chat_template
    ids, mask = encode_prompts(chat, ["hi"], use_chat_template=True, system_prompt="be brief")
    assert chat.decode(ids[0][mask[0] == 1]) == "<system>be brief\n<user>hi\n<assistant>"


def test_long_prompts_are_truncated_from_the_left_with_a_warning():
    tok = make_tokenizer()
    with pytest.warns(UserWarning, match="truncated"):
        ids, mask = encode_prompts(tok, ["abcdef", "xy"], use_chat_template=False, max_prompt_length=3)
    assert tok.decode(ids[0]) == "def"
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    with pytest.raises(ValueError, match="max_prompt_length"):
        encode_prompts(tok, ["abcdef"], use_chat_template=False, max_prompt_length=3, truncation="error")


@pytest.mark.integration
def test_metrics_reach_loggers_once_per_optimizer_step_at_that_step(tmp_path, module, loader):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from forge_lightning.reporting.profiler import PHASES, PhaseProfiler

    fit = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        profiler=PhaseProfiler(),
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    fit.fit(module(gradient_accumulation_steps=2), loader([{"prompt": f"q{i}"} for i in range(6)]))
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]  # 6 batches, accumulation 2
    assert {"train/reward", "train/kl", "train/loss", "perf/tokens_per_s"} <= set(rows[0])
    assert {f"perf/{phase}_s" for phase in PHASES} <= set(rows[0])
    # Lightning's own callbacks (ModelCheckpoint(monitor=...), EarlyStopping) read these.
    assert "train/reward" in fit.callback_metrics
    assert float(fit.callback_metrics["train/reward"]) == float(rows[-1]["train/reward"])


@pytest.mark.integration
def test_reward_loggers_logging_steps_is_the_cadence_of_every_logger(tmp_path, module, loader):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from forge_lightning.callbacks import RewardLogger

    def fit(callbacks, **kwargs):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=1,
            logger=CSVLogger(out),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=out,
            **kwargs,
        )
        trainer.fit(module(gradient_accumulation_steps=1), loader([{"prompt": f"q{i}"} for i in range(6)]))
        rows = list(csv.DictReader(open(next(out.rglob("metrics.csv")))))
        return out, [r for r in rows if r.get("train/reward")]

    class Steps(pl.Callback):  # each optimizer step's own metrics
        seen: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.seen.append(pl_module.last_step.metrics)

    # A RewardLogger's logging_steps wins over log_every_n_steps: its JSONL and the CSV agree, each
    # report the mean of two steps' means and the latest running total.
    out, rows = fit([RewardLogger(logging_steps=2), Steps()], log_every_n_steps=1)
    records = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records] == [2, 4, 6]
    for i, (row, record) in enumerate(zip(rows, records)):
        pair = Steps.seen[2 * i : 2 * i + 2]
        reward = sum(m["train/reward"] for m in pair) / 2
        assert float(row["train/reward"]) == pytest.approx(record["reward"]) == pytest.approx(reward)
        assert float(row["train/num_tokens"]) == record["num_tokens"] == pair[-1]["train/num_tokens"]
    # num_tokens counts every completion token trained on so far: it only grows.
    totals = [m["train/num_tokens"] for m in Steps.seen]
    assert totals[0] > 0 and all(later > earlier for earlier, later in zip(totals, totals[1:]))
    # Without one, log_every_n_steps counts optimizer steps (6 batches, 6 steps).
    _, rows = fit([], log_every_n_steps=3)
    assert [int(r["step"]) for r in rows] == [3, 6]


@pytest.mark.integration
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "forge"])
def test_accumulated_batches_give_the_gradient_of_one_batch_holding_them(step_gradients, loss_type):
    # Completions of lengths 1-6 (FixedCompletions): a short rollout's tokens must not weigh more.
    records = [{"prompt": "ab"}, {"prompt": "abc d"}, {"prompt": "xy"}, {"prompt": "q?"}]
    _, whole = step_gradients(records=records, batch_size=4, fixed=True, loss_type=loss_type)
    for batch_size, accumulation in ((2, 2), (1, 4)):
        _, split = step_gradients(
            records=records,
            batch_size=batch_size,
            fixed=True,
            loss_type=loss_type,
            gradient_accumulation_steps=accumulation,
        )
        assert any(g.abs().sum() > 0 for g in whole)
        for a, b in zip(split, whole):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


@pytest.mark.integration
def test_step_reports_entropy_and_each_reward_components_spread(tmp_path, module, trainer, loader):
    from forge_lightning.rewards.library import CompositeReward

    def long(prompts, responses):
        return [float(len(r)) for r in responses]

    def constant(prompts, responses):
        return [1.0] * len(responses)

    grpo = module(reward=CompositeReward([(long, 1.0), (constant, 1.0)]), gradient_accumulation_steps=1)
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    metrics, lengths = grpo.last_step.metrics, grpo.last_step.completion_lengths
    # A random policy over a ~80-token vocabulary: high entropy, at most log(V) nats.
    assert 0.5 < metrics["train/entropy"] <= math.log(len(grpo.tokenizer)) + 1e-6
    assert metrics["train/rewards/constant_std"] == 0.0
    texts = [c for _, c, _ in grpo.last_step.samples]
    expected = torch.tensor([float(len(t)) for t in texts]).std().item()
    assert metrics["train/rewards/long_std"] == pytest.approx(expected, rel=1e-5)
    assert lengths.shape == (4,) and metrics["train/num_tokens"] == lengths.sum().item()


class CutOff:
    """Every completion runs to max_new_tokens without an EOS."""

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = request.prompt_ids.shape[0] * request.group_size
        return Completions(4 + torch.arange(rows * request.params.max_new_tokens).view(rows, -1) % 20)

    def sync_weights(self, model) -> None:
        pass


@pytest.mark.integration
@pytest.mark.parametrize("masked", [True, False])
def test_masked_truncated_completions_carry_no_gradient(tmp_path, module, trainer, loader, masked):
    def varied(prompts, responses):
        return [float(i) for i in range(len(responses))]

    grpo = module(
        reward=varied, mask_truncated_completions=masked, gradient_accumulation_steps=1, max_grad_norm=None
    )
    grpo.engine = CutOff()
    grads: list[torch.Tensor] = []

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.extend(p.grad for p in pl_module.model.parameters() if p.grad is not None)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, max_steps=1, callbacks=[Grads()]).fit(grpo, loader([{"prompt": "q"}]))
    metrics = grpo.last_step.metrics
    assert metrics["train/truncated_fraction"] == 1.0
    assert (
        metrics["train/completion_length_truncated"] == 8.0
        and "train/completion_length_finished" not in metrics
    )
    warned = any("keep weight" in str(w.message) for w in caught)
    assert warned == masked
    assert metrics["train/num_tokens"] == (0.0 if masked else 4 * 8)
    assert all(g.abs().sum() == 0 for g in grads) == masked
