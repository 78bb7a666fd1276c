"""Agent rollouts on a tiny random model: each episode one completion whose sampled tokens alone are
trained, failures counted, the agent's return value the score (or refused beside a reward), the
settings an agent cannot go with refused by name, and a one-step fit of the example agent."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from helpers.agents import chat_tokenizer, runner, serve
from helpers.models import make_model

from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.examples import calculator_agent
from forge_lightning.rewards.environment import EnvironmentReward
from forge_lightning.rewards.library import CompositeReward, component_names
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.settings.assembly import reads_agent_score
from forge_lightning.settings.checks import validate_hparams

ROOT = Path(__file__).resolve().parents[3]
PARAMS = SamplingParams(max_new_tokens=200)
USAGE: dict[str, list[int]] = {}  # row prompt -> the completion tokens the endpoint reported


async def two_calls(client, row):
    """Asks, sends back a tool result, asks again; raises on the prompt 'boom' after its first call."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
    if row["prompt"] == "boom":
        raise RuntimeError("the agent's own bug")
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": "x", "content": "RESULT"}]
    second = await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
    USAGE.setdefault(row["prompt"], []).append(first.usage.completion_tokens + second.usage.completion_tokens)
    return float(len(row["prompt"]))


def test_only_the_tokens_the_policy_sampled_are_trained():
    run, tok, model = runner(two_calls)
    USAGE.clear()
    rollout = run(model, ["hi"], PARAMS, group_size=2)
    assert tok.decode(rollout.prompt_ids[0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for row in range(2):
        real = rollout.completion_mask[row].bool()
        sampled = real & rollout.model_mask[row].bool()
        inserted = tok.decode(rollout.completion_ids[row][real & ~sampled])
        # The tool turn the agent sent, between the two replies, is read but not trained.
        assert inserted.endswith("<|im_start|>tool\nRESULT<|im_end|>\n<|im_start|>assistant\n")
        assert torch.equal(rollout.loss_mask()[row], sampled)
    assert sorted(rollout.model_mask.sum(dim=1).tolist()) == sorted(USAGE["hi"])
    assert rollout.tool_stats["turns"].tolist() == [2, 2]
    assert rollout.tool_stats["agent_calls_dropped"].tolist() == [0, 0]
    assert EnvironmentReward()(["hi"] * 2, rollout.completions, environments=rollout.environments).scores == [
        2.0,
        2.0,
    ]


def test_a_failing_agent_is_counted_scored_zero_and_not_trained(caplog):
    run, tok, model = runner(two_calls)
    with caplog.at_level("WARNING"):
        rollout = run(model, ["hi", "boom"], PARAMS, group_size=2)
    assert rollout.tool_stats["agent_errors"].tolist() == [0, 0, 1, 1]
    assert rollout.completion_mask[2:].sum() == 0  # nothing of a failed episode is trained
    scores = EnvironmentReward()(["x"] * 4, rollout.completions, environments=rollout.environments).scores
    assert scores == [2.0, 2.0, 0.0, 0.0]
    assert '2 of 4 failed (first: raised RuntimeError("the agent\'s own bug"))' in caplog.text


async def stalls(client, row):
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    if row["prompt"] == "stall":
        await asyncio.sleep(60)
    return 1.0


def test_an_episode_past_the_agent_timeout_is_cancelled_and_counted():
    run, _, model = runner(stalls)
    run.timeout = 0.5
    start = time.perf_counter()
    rollout = run(model, ["go", "stall"], PARAMS, group_size=2)
    assert time.perf_counter() - start < 30
    assert rollout.tool_stats["agent_errors"].tolist() == [0, 0, 1, 1]
    assert "the episode took longer than agent_timeout=0.5s" in rollout.environments[2].error


async def returns(client, row):
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    return row["value"]


@pytest.mark.parametrize(
    ("value", "scored_by_agent", "message"),
    [(None, True, "the agent returned None"), (1.0, False, "two scores for one episode")],
)
def test_a_score_from_both_the_agent_and_the_reward_or_neither_is_refused(value, scored_by_agent, message):
    run, _, model = runner(returns, scored_by_agent)
    with pytest.raises(ValueError, match=message):
        run(model, ["x"], PARAMS, group_size=2, rows={"value": [value]})


def test_the_agents_return_value_is_the_score_where_the_reward_reads_it(module):
    assert isinstance(module(agent="forge_lightning.examples.calculator_agent.agent", reward=None).reward,
                      EnvironmentReward)  # fmt: skip

    def other(prompts, responses):
        return [0.0] * len(responses)

    assert reads_agent_score(None) and reads_agent_score(EnvironmentReward()) and not reads_agent_score(other)
    assert reads_agent_score(CompositeReward([(EnvironmentReward(), 1.0), (other, 1.0)]))


def test_an_agents_score_is_logged_under_the_agents_name(module):
    grpo = module(agent="forge_lightning.examples.calculator_agent.agent", reward=None)
    assert component_names(grpo.reward) == ["agent"]  # train/rewards/agent, not .../EnvironmentReward
    assert (
        "rewards/agent" in grpo.train_metrics.means
        and "rewards/EnvironmentReward" not in grpo.train_metrics.means
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"rollout_mode": "async"}, r"rollout_mode='async' \(on its local:1 server\) cannot take agent"),
        ({"generation_backend": "vllm"}, "endpoint samples with the policy's HF generate"),
        ({"calculator": "plain"}, "an agent runs its own tools"),
        ({"tools": ["forge_lightning.examples.calculator_agent.calculate"]}, "an agent runs its own tools"),
        ({"agent": "forge_lightning.examples.calculator_agent.calculate"}, "must name an async def agent"),
        ({"agent": "forge_lightning.examples.no_such.agent"}, "cannot import it"),
    ],
)
def test_what_an_agent_cannot_go_with_is_refused_by_name(setting, message):
    with pytest.raises(ValueError, match=message):
        validate_hparams({"agent": "forge_lightning.examples.calculator_agent.agent", **setting})


def test_the_example_agent_calculates_answers_and_scores_its_episode():
    tok = chat_tokenizer()
    replies = [
        '<tool_call>{"name": "calculate", "arguments": {"expression": "41 + 29"}}</tool_call>',
        '<tool_call>{"name": "answer", "arguments": {"value": "70"}}</tool_call>',
    ]

    async def solve(client):
        return await calculator_agent.agent(client, {"prompt": "41 + 29?", "reference": "70"})

    score, log, prompts = serve(tok, replies, solve)
    assert score == 1.0
    assert "<|im_start|>tool\n70<|im_end|>" in tok.decode(prompts[1])  # the calculator's result
    assert [len(c.calls) for c in log.chains] == [2]


@pytest.mark.integration
def test_a_fit_runs_the_example_agent_for_one_step(tmp_path, tiny_overrides):
    folder, out = tmp_path / "model", tmp_path / "run"
    tok = chat_tokenizer()
    make_model(len(tok), eos_token_id=1, pad_token_id=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    args = ["fit", "--config", str(ROOT / "configs" / "smoke.yaml"), *tiny_overrides(folder, out)]
    args += ["--model.agent=forge_lightning.examples.calculator_agent.agent", "--trainer.max_steps=1"]
    args += ["--checkpoint=null"]
    build_cli(args)
    (record,) = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["turns"] >= 1
    assert "rewards/agent" in record and "rewards/EnvironmentReward" not in record
    assert (out / "final" / "config.json").is_file()
