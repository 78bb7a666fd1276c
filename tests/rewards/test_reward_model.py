"""RewardModel: a sequence classifier with one label as a reward, on tiny models built here."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rewards.library import CompositeReward, RewardModel


def classifier(tok, num_labels: int = 1, seed: int = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, num_labels=num_labels,
    )  # fmt: skip
    return LlamaForSequenceClassification(config)


def target_classifier(tok, target: str = "a") -> LlamaForSequenceClassification:
    """Scores 1 when a text's last token is ``target``, else 0: the layers add nothing to the
    residual stream, ``target``'s embedding alone has a first component, which the head reads."""
    model = classifier(tok)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = model.model.embed_tokens.weight
        embedding[:, 0] = 0.0
        i = tok.convert_tokens_to_ids(target)
        embedding[i] = 0.0
        embedding[i, 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[0, 0] = 32**-0.5  # RMSNorm makes the one-hot sqrt(hidden_size) long
    return model


def by_hand(model, tok, text: str, special: bool = True) -> float:
    ids = tok(text, add_special_tokens=special, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


@pytest.fixture
def rm_dir(tmp_path) -> Path:
    tok = make_tokenizer()
    folder = tmp_path / "rm"
    classifier(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


PROMPTS = ["2 + 3 =", "what is 7?", "hi"]
RESPONSES = [" 5", "seven, it is 7", ""]


def test_scores_are_a_forward_of_the_classifier_on_prompt_then_completion(rm_dir):
    reward = RewardModel(str(rm_dir))
    got = reward(PROMPTS, RESPONSES).scores
    model, tok = reward.classifier, reward._tokenizer
    want = [by_hand(model, tok, p + r) for p, r in zip(PROMPTS, RESPONSES)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 4) for s in got)) == 3


def test_with_a_chat_template_the_policy_conversation_and_system_message_are_scored():
    from forge_lightning.rewards.library import PolicyContext

    tok = make_tokenizer(chat_template=True)
    model = classifier(tok)
    reward = RewardModel(model, tokenizer=tok)
    reward.use_policy_context(PolicyContext(torch.device("cpu"), system_prompt="be brief"))
    got = reward(PROMPTS, RESPONSES).scores
    texts = [
        tok.apply_chat_template(
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": p},
                {"role": "assistant", "content": r},
            ],
            tokenize=False,
        )
        for p, r in zip(PROMPTS, RESPONSES)
    ]
    assert texts[0].startswith("<system>be brief\n<user>2 + 3 =\n<assistant> 5")
    assert got == pytest.approx([by_hand(model, tok, t, special=False) for t in texts], abs=1e-5)
    plain = RewardModel(model, tokenizer=tok, use_chat_template=False)(PROMPTS, RESPONSES).scores
    assert plain != pytest.approx(got)


def test_batches_and_truncation_score_as_one_text_at_a_time(rm_dir):
    prompts = [f"{'long ' * i}question {i}" for i in range(7)]
    responses = [f"answer{'!' * i}" for i in range(7)]
    one = RewardModel(str(rm_dir), batch_size=1)(prompts, responses).scores
    batched = RewardModel(str(rm_dir), batch_size=3)(prompts, responses).scores
    assert batched == pytest.approx(one, abs=1e-5)

    short = RewardModel(str(rm_dir), batch_size=4, max_length=20)
    tok = short._tokenizer
    ids = [tok(p + r)["input_ids"] for p, r in zip(prompts, responses)]
    longer = sum(len(row) > 20 for row in ids)
    assert 0 < longer < 7
    with pytest.warns(UserWarning, match=rf"RewardModel: {longer} of 7 texts were longer than max_length=20"):
        cut = short(prompts, responses).scores
    with torch.no_grad():
        want = [float(short.classifier(input_ids=torch.tensor([row[-20:]])).logits[0, 0]) for row in ids]
    assert cut == pytest.approx(want, abs=1e-5)


def test_a_final_eos_is_scored_though_the_pad_token_is_the_eos(rm_dir):
    # transformers' pooling takes the last token that is not the pad id: with pad == EOS it
    # would read the token before a real final EOS.
    reward = RewardModel(str(rm_dir))
    tok = reward._tokenizer
    text = "ab" + tok.eos_token
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids[0, -1] == tok.pad_token_id
    with torch.no_grad():
        hidden = reward.classifier.base_model(input_ids=ids).last_hidden_state[:, -1]
        at_eos = float(reward.classifier.score(hidden)[0, 0])
    assert reward(["a"], ["b" + tok.eos_token]).scores == pytest.approx([at_eos], abs=1e-5)
    assert at_eos != pytest.approx(by_hand(reward.classifier, tok, text), abs=1e-5)


def test_a_causal_lm_and_two_labels_are_refused(tmp_path):
    tok = make_tokenizer()
    lm = tmp_path / "lm"
    make_model(len(tok)).save_pretrained(lm)
    tok.save_pretrained(lm)
    with pytest.raises(ValueError, match=r"is a causal LM \(a policy\), not a sequence classifier"):
        RewardModel(str(lm))
    with pytest.raises(ValueError, match=r"no trained score head"):
        RewardModel(f"random:{lm}")
    with pytest.raises(ValueError, match=r"num_labels=2; a reward model gives one score"):
        RewardModel(classifier(tok, num_labels=2), tokenizer=tok)


def test_a_config_naming_a_causal_lm_as_a_reward_model_is_one_line_that_says_what_to_use(
    tmp_path, tiny_model_dir
):
    from forge_lightning.cli.forge_cli import build_cli

    lm = tmp_path / "lm"
    make_model(len(make_tokenizer())).save_pretrained(lm)  # a LlamaForCausalLM
    config = tmp_path / "reward_model.yaml"
    config.write_text(
        f"model:\n  reward:\n    class_path: forge_lightning.rewards.RewardModel\n"
        f"    init_args:\n      model: {lm}\n"
    )
    root = Path(__file__).resolve().parents[2]
    args = ["--config", str(root / "configs" / "smoke.yaml"), "--config", str(config)]
    args += [f"--model.model={tiny_model_dir}", f"--trainer.default_root_dir={tmp_path / 'out'}"]
    with pytest.raises(SystemExit) as exit_:
        build_cli(args, run=False)
    assert str(exit_.value.code) == (
        f"fit: RewardModel: '{lm}' is a causal LM (a policy), not a sequence classifier: give a model "
        "with a trained classification head and one label (AutoModelForSequenceClassification, "
        "num_labels=1), or have a causal LM judge each completion with JudgeReward(model=..., template=...)"
    )


def test_batch_normalisation_comes_after_the_whole_batch_even_when_retried_one_by_one(rm_dir):
    reward = RewardModel(str(rm_dir), normalize="batch")
    raw = RewardModel(str(rm_dir))(PROMPTS, RESPONSES).scores
    mean = sum(raw) / 3
    std = (sum((s - mean) ** 2 for s in raw) / 3) ** 0.5
    want = [(s - mean) / (std + 1e-6) for s in raw]
    assert score(reward, PROMPTS, RESPONSES).total == pytest.approx(want, abs=1e-4)

    calls = []

    def fails_on_the_batch(prompts, responses):
        calls.append(len(responses))
        if len(responses) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    both = CompositeReward([(reward, 1.0, "rm"), (fails_on_the_batch, 1.0, "flaky")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scored = score(both, PROMPTS, RESPONSES, on_error="zero")
    assert scored.components["rm"] == pytest.approx(want, abs=1e-4) and calls == [3, 1, 1, 1]


@pytest.mark.integration
def test_the_reward_model_is_no_part_of_the_trained_module_and_sits_on_its_device(
    rm_dir, trainer, loader, tmp_path
):
    tok = make_tokenizer()
    reward = RewardModel(str(rm_dir))
    grpo = GRPOLightningModule(
        model=make_model(len(tok)), tokenizer=tok, reward=reward, group_size=4, max_new_tokens=4, kl_beta=0.0
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "ab"}, {"prompt": "cd"}]))
    assert grpo.last_step.metrics["train/reward_std"] > 0  # the classifier scored the completions
    rm_params = {id(p) for p in reward.classifier.parameters()}
    trained = {id(p) for group in grpo.optimizers().optimizer.param_groups for p in group["params"]}
    assert not rm_params & trained
    assert all(not p.requires_grad and p.grad is None for p in reward.classifier.parameters())
    assert not any(key.startswith(("reward", "classifier", "score")) for key in grpo.state_dict())
    assert {p.device for p in reward.classifier.parameters()} == {grpo.device}
    assert not reward.classifier.training


@pytest.mark.integration
def test_a_changed_reward_model_folder_is_refused_on_resume(rm_dir, trainer, loader, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    tok = make_tokenizer()

    def module():
        return GRPOLightningModule(
            model=make_model(len(tok)), tokenizer=tok, reward=RewardModel(str(rm_dir)), group_size=2,
            max_new_tokens=3, kl_beta=0.0,
        )  # fmt: skip

    records = [{"prompt": "ab"}, {"prompt": "cd"}]
    saver = dict(enable_checkpointing=True, callbacks=[ModelCheckpoint(tmp_path / "ckpt", save_last=True)])
    trainer(tmp_path, max_steps=1, **saver).fit(module(), loader(records))
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert checkpoint["forge_reward_models"][0]["folder"] == str(rm_dir)
    assert not any("score" in key for key in checkpoint["state_dict"])  # only the policy's weights
    assert checkpoint["hyper_parameters"]["reward"]["init_args"]["model"] == str(rm_dir)  # its spec

    classifier(tok, seed=1).save_pretrained(rm_dir)  # another reward model in the same folder
    with pytest.raises(
        RuntimeError, match=rf"the reward model in {rm_dir} is not the one this run was trained"
    ):
        trainer(tmp_path, max_steps=2, **saver).fit(
            module(), loader(records), ckpt_path=tmp_path / "ckpt" / "last.ckpt"
        )


def _edit_json(path: Path, **changes) -> None:
    import json

    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


# Each edit of a reward model's folder that changes its scores, and the name a refusal gives it.
FOLDER_EDITS = {
    "a new chat template": (
        lambda d: (d / "chat_template.jinja").write_text(
            "{% for m in messages %}{{ m.content }}{% endfor %}"
        ),
        "chat template",
    ),
    "the chat template removed": (lambda d: (d / "chat_template.jinja").unlink(), "chat template"),
    "a template in tokenizer_config.json": (
        lambda d: _edit_json(d / "tokenizer_config.json", chat_template="{{ messages[0]['content'] }}"),
        "chat template",
    ),
    "the tokenizer's settings": (
        lambda d: _edit_json(d / "tokenizer_config.json", add_bos_token=True),
        "tokenizer",
    ),
    "the model's config": (lambda d: _edit_json(d / "config.json", rms_norm_eps=1e-2), "config"),
}


@pytest.mark.parametrize("edit", FOLDER_EDITS, ids=list(FOLDER_EDITS))
def test_a_reward_model_folder_whose_formatting_changed_is_refused_on_resume(tmp_path, edit):
    from forge_lightning.rewards.reward_model import check_reward_models, reward_model_fingerprints

    tok = make_tokenizer(chat_template=True)
    folder = tmp_path / "rm"
    classifier(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    saved = reward_model_fingerprints([RewardModel(str(folder))])
    check_reward_models(saved, [RewardModel(str(folder))])  # the same folder resumes

    change, what = FOLDER_EDITS[edit]
    change(folder)
    with pytest.raises(RuntimeError, match=rf"in {folder} is not the one .*its {what} changed"):
        check_reward_models(saved, [RewardModel(str(folder))])


def test_a_checkpoint_from_before_the_formatting_fingerprint_still_checks_the_weights(rm_dir):
    from forge_lightning.rewards.reward_model import check_reward_models, reward_model_fingerprints

    tok = make_tokenizer()
    older = [{"folder": str(rm_dir), "fingerprint": RewardModel(str(rm_dir)).fingerprint}]
    (rm_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    check_reward_models(older, [RewardModel(str(rm_dir))])  # what it did not record is not known
    classifier(tok, seed=1).save_pretrained(rm_dir)
    with pytest.raises(RuntimeError, match=r"its weights changed"):
        check_reward_models(older, [RewardModel(str(rm_dir))])
    assert reward_model_fingerprints([RewardModel(str(rm_dir))])[0]["files"]  # recorded now


@pytest.mark.integration
def test_a_config_names_it_beside_a_verifiable_reward_and_it_scores_a_batch(
    rm_dir, tiny_model_dir, tmp_path, tiny_overrides
):
    from forge_lightning.cli.forge_cli import build_cli

    config = tmp_path / "rm.yaml"
    config.write_text(
        f"""model:
  reward:
    class_path: forge_lightning.rewards.CompositeReward
    init_args:
      rewards_and_weights:
        - [{{class_path: forge_lightning.rewards.RewardModel,
             init_args: {{model: {rm_dir}, batch_size: 2}}}}, 0.5, preference]
        - [forge_lightning.rewards.GSM8KAnswerReward, 0.5, correct]
"""
    )
    root = Path(__file__).resolve().parents[2]
    args = ["--config", str(root / "configs" / "smoke.yaml"), "--config", str(config)]
    cli = build_cli([*args, *tiny_overrides(tiny_model_dir, tmp_path)], run=False)
    reward = cli.model.reward
    assert isinstance(reward, CompositeReward) and isinstance(reward.rewards[0], RewardModel)
    scored = score(reward, ["1 + 1 ="] * 3, [" 2", " 3", "two"], references=["2"] * 3)
    want = RewardModel(str(rm_dir))(["1 + 1 ="] * 3, [" 2", " 3", "two"]).scores
    assert scored.components["preference"] == pytest.approx(want, abs=1e-5)
    assert scored.components["correct"] == [1.0, 0.0, 0.0]


@pytest.mark.integration
def test_a_reward_model_that_likes_one_token_teaches_the_policy_to_write_it(trainer, loader, tmp_path):
    tok = make_tokenizer()
    reward = RewardModel(target_classifier(tok, "a"), tokenizer=tok)
    assert reward(["xy", "xy"], ["a", "b"]).scores == pytest.approx([1.0, 0.0], abs=1e-4)
    pl.seed_everything(0, verbose=False)
    grpo = GRPOLightningModule(
        model=make_model(len(tok)), tokenizer=tok, reward=reward, group_size=16, max_new_tokens=1,
        temperature=1.0, use_chat_template=False, learning_rate=1e-2, lr_schedule="constant",
        gradient_accumulation_steps=1, kl_beta=0.0,
    )  # fmt: skip
    rewards = []

    class Log(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            rewards.append(pl_module.last_step.metrics["train/reward"])

    records = [{"prompt": p} for p in ["xy", "qz", "mn", "rt"]] * 10
    trainer(tmp_path, max_steps=30, max_epochs=-1, callbacks=[Log()]).fit(grpo, loader(records, batch_size=4))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rewards) == 30 and first < 0.1 and last > 0.8, rewards


@pytest.mark.parametrize("spec", ["no/such/folder", "./no_such_folder", "/no/such/folder"])
def test_a_reward_model_folder_that_does_not_exist_is_named(spec):
    with pytest.raises(FileNotFoundError, match=rf"RewardModel: the folder '{spec}' does not exist"):
        RewardModel(spec)


def test_a_partly_existing_reward_model_path_is_a_missing_folder_not_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"the folder 'runs/rm' does not exist.*'runs' does"):
        RewardModel("runs/rm")


def _reward_setting_error(value: str, tmp_path: Path, tiny_model_dir: Path) -> str:
    from forge_lightning.cli.forge_cli import build_cli

    root = Path(__file__).resolve().parents[2]
    args = ["--config", str(root / "configs" / "smoke.yaml"), f"--model.reward={value}"]
    args += [f"--model.model={tiny_model_dir}", f"--trainer.default_root_dir={tmp_path / 'out'}"]
    with pytest.raises(SystemExit) as exit_:
        build_cli(args, run=False)
    return str(exit_.value.code)


def test_a_reward_model_folder_given_as_the_reward_points_at_reward_model(
    rm_dir, tmp_path, tiny_model_dir, capsys
):
    message = _reward_setting_error(str(rm_dir), tmp_path, tiny_model_dir)
    assert f"reward {str(rm_dir)!r} is a model folder or hub id, not a reward" in message
    assert "RewardModel(" in message and "class_path: forge_lightning.rewards.RewardModel" in message
    assert "Union" not in message + capsys.readouterr().err  # no parser dump
    lm = tmp_path / "lm"
    make_model(len(make_tokenizer())).save_pretrained(lm)
    message = _reward_setting_error(str(lm), tmp_path, tiny_model_dir)
    assert "is a causal LM (a policy), not a reward model" in message and "RewardModel" in message
    message = _reward_setting_error(
        "OpenAssistant/reward-model-deberta-v3-large-v2", tmp_path, tiny_model_dir
    )
    assert "is a model folder or hub id, not a reward" in message


def test_a_reward_model_path_given_as_a_reward_in_python_points_at_reward_model(rm_dir):
    tok = make_tokenizer()
    for reward in (str(rm_dir), [str(rm_dir), "forge_lightning.rewards.GSM8KAnswerReward"]):
        with pytest.raises(ValueError, match=r"is a model folder or hub id, not a reward.*RewardModel\("):
            GRPOLightningModule(model=make_model(len(tok)), tokenizer=tok, reward=reward)
