"""What a resume may change of a reward stored by spec: a served reward's URL (warned), not a
judge's template or parser (refused by name); and the YAML route of both served rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from forge_lightning.rewards import CompositeReward, JudgeReward, RemoteReward, load_reward, read_score
from forge_lightning.rewards.resume_changes import reward_on_resume
from forge_lightning.run.resume import check_resume_settings
from forge_lightning.run.specs import to_spec
from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME

ROOT = Path(__file__).resolve().parents[2]


def says_yes(reply: str) -> float:
    """Another parser: 1 for any reply."""
    return 1.0


def hparams(reward) -> dict:
    return {"reward": to_spec(reward), "group_size": 4}


def resumed(saved: dict, current: dict) -> None:
    """A resume's checks of the module's settings, as training/run_state.py makes them."""
    check_resume_settings(reward_on_resume(saved, current), current, changeable=CHANGEABLE_ON_RESUME)


def test_a_moved_server_is_accepted_with_a_warning():
    saved = hparams(RemoteReward("http://10.0.0.1:8000/score"))
    current = hparams(RemoteReward("http://10.0.0.2:9000/score", timeout=5.0))
    with pytest.raises(ValueError, match="model.reward"):  # the whole-setting comparison alone refuses it
        check_resume_settings(saved, current, changeable=CHANGEABLE_ON_RESUME)
    with pytest.warns(UserWarning) as warned:
        resumed(saved, current)
    messages = [str(w.message) for w in warned]
    assert any(
        "RemoteReward's url changed: 'http://10.0.0.1:8000/score' -> 'http://10.0.0.2:9000/score'" in m
        for m in messages
    )
    assert any("RemoteReward's timeout changed" in m for m in messages)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"template": "Is this right? {completion}"}, "template"),
        ({"parse": says_yes}, "parse"),
        ({"template": "{completion}?", "parse": says_yes}, "template, parse"),
    ],
)
def test_a_judge_whose_template_or_parser_changed_is_refused_by_name(change, named):
    judge = dict(url="http://10.0.0.1:8000/v1", template="Rate {completion}", parse=read_score)
    saved = hparams(JudgeReward(**judge))
    current = hparams(JudgeReward(**{**judge, **change, "url": "http://10.0.0.2:8000/v1"}))
    with pytest.raises(
        ValueError, match=rf"resuming with a JudgeReward whose {named} changed since the checkpoint"
    ):
        resumed(saved, current)


def test_inside_a_composite_reward_the_same_rules_hold():
    def composite(url: str, template: str) -> CompositeReward:
        judge = JudgeReward(url=url, template=template)
        return CompositeReward([(judge, 0.5, "judge"), (RemoteReward(url + "/score"), 0.5, "remote")])

    saved = hparams(composite("http://a:1/v1", "Rate {completion}"))
    with pytest.warns(UserWarning, match="url changed"):
        resumed(saved, hparams(composite("http://b:1/v1", "Rate {completion}")))
    with pytest.raises(ValueError, match="JudgeReward whose template changed"):
        resumed(saved, hparams(composite("http://a:1/v1", "Grade {completion}")))


def test_other_rewards_are_compared_whole_as_before():
    with pytest.raises(ValueError, match="model.reward"):
        resumed(
            {"reward": "forge_lightning.rewards.GSM8KAnswerReward"}, {"reward": "helpers.rewards.count_a"}
        )


@pytest.mark.parametrize(
    ("reward", "kind", "url"),
    [
        (
            {
                "class_path": "forge_lightning.rewards.RemoteReward",
                "init_args": {"url": "http://h:1/s", "retries": 1},
            },
            RemoteReward,
            "http://h:1/s",
        ),
        (
            {
                "class_path": "forge_lightning.rewards.JudgeReward",
                "init_args": {
                    "url": "http://h:2/v1",
                    "template": "Yes or no: {completion}",
                    "parse": "forge_lightning.rewards.judge.read_score",
                },
            },
            JudgeReward,
            "http://h:2/v1",
        ),
    ],
)
def test_the_command_line_takes_either_by_class_path(reward, kind, url, capsys):
    from forge_lightning.cli.forge_cli import build_cli

    smoke = ["fit", "--config", str(ROOT / "configs" / "smoke.yaml")]
    with pytest.raises(SystemExit) as exit_info:
        build_cli([*smoke, f"--model.reward={json.dumps(reward)}", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["reward"]
    built = load_reward(printed)  # as the module builds it from the parsed config
    assert isinstance(built, kind) and built.url == url
    assert to_spec(built)["init_args"]["url"] == url  # what a checkpoint stores


@pytest.mark.integration
def test_a_fit_resumes_with_its_judge_moved_and_refuses_another_template(
    serve, module, trainer, loader, tmp_path
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    async def chat(body, n):
        return {"choices": [{"message": {"content": str(len(body["messages"][0]["content"]) % 3)}}]}

    first, moved = serve(chat, "/v1/chat/completions"), serve(chat, "/v1/chat/completions")
    records = [{"prompt": "ab"}, {"prompt": "cd"}]
    saver = dict(enable_checkpointing=True, callbacks=[ModelCheckpoint(tmp_path / "ckpt", save_last=True)])
    last = tmp_path / "ckpt" / "last.ckpt"

    def fit(url: str, template: str = "Rate {completion}", steps: int = 2):
        judge = JudgeReward(url=url, template=template, timeout=5.0)
        grpo = module(reward=judge, kl_beta=0.0, gradient_accumulation_steps=1)
        trainer(tmp_path, max_steps=steps, max_epochs=3, **saver).fit(
            grpo, loader(records), ckpt_path=last if steps > 1 else None
        )
        return grpo

    fit(first.url, steps=1)
    with pytest.warns(UserWarning, match=rf"JudgeReward's url changed: '{first.url}' -> '{moved.url}'"):
        assert fit(moved.url).global_step == 2
    assert len(moved.requests) == 4  # the resumed step's group was judged by the moved server
    with pytest.raises(ValueError, match=r"JudgeReward whose template changed since the checkpoint"):
        fit(moved.url, template="Grade {completion}", steps=3)


@pytest.mark.integration
def test_the_command_line_resumes_with_the_servers_url_moved(serve, tiny_model_dir, tiny_overrides, tmp_path):
    from forge_lightning.cli.forge_cli import build_cli

    async def lengths(body, n):
        return [len(c) % 3 for c in body["completions"]]

    first, moved = serve(lengths), serve(lengths)
    config = tmp_path / "remote.yaml"  # the reward as a YAML names it
    reward = {"class_path": "forge_lightning.rewards.RemoteReward", "init_args": {"url": first.url}}
    config.write_text(yaml.safe_dump({"model": {"reward": reward}}))
    args = ["fit", "--config", str(ROOT / "configs" / "smoke.yaml"), "--config", str(config)]
    args += [*tiny_overrides(tiny_model_dir, tmp_path / "run"), "--checkpoint.every_n_train_steps=1"]
    build_cli([*args, "--trainer.max_steps=1"])
    with pytest.warns(UserWarning) as warned:
        cli = build_cli(
            [*args, "--ckpt_path=last", "--trainer.max_steps=2", f"--model.reward.init_args.url={moved.url}"]
        )
    said = [str(w.message) for w in warned if "url changed" in str(w.message)]  # once, not per check
    assert len(said) == 1 and said[0].startswith(
        f"resumed with the RemoteReward's url changed: '{first.url}'"
    )
    assert f"-> '{moved.url}'" in said[0]
    assert cli.trainer.global_step == 2 and len(first.requests) == len(moved.requests) == 1
