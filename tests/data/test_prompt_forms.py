"""The forms prompts come in: conversations through the chat template, any prompt dataset from the
CLI with extra fields, and clear errors for a datasets.Dataset given unbatched, a row without its
field and a hub dataset offline."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.models import make_tokenizer

from forge_lightning.cli.forge_cli import build_cli

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


def test_a_conversation_goes_through_the_chat_template_as_messages():

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


def test_a_hub_prompt_dataset_offline_is_a_clear_error():
    from forge_lightning.data import PromptDataModule

    data = PromptDataModule(source="hub", prompt_field="prompt", dataset="someone/prompts")
    with pytest.raises(RuntimeError, match="could not load the dataset 'someone/prompts'.*pass data.path"):
        data.setup()
