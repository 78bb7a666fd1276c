"""Stateful environments under ``sandbox: process``: each episode's environment lives in one
sandbox worker's process for the whole episode (sandbox/pool.py's sticky episodes), through the
real tool loop: its calls see its own state in one process, never the trainer's; a hung call is
killed at its timeout and only its episode ends; its score reaches the reward."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import sticky
from helpers.engines import TurnEngine
from helpers.models import ScriptedLlama
from helpers.sandbox import skip_unless_sandbox_isolates
from helpers.tools import GREEDY, call, chat_tokenizer, sampler, tiny

from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rewards.environment import EnvironmentReward
from forge_lightning.rollout.tools import FunctionTools
from forge_lightning.sandbox.pool import Sandbox, SandboxLimits

DONE = {"role": "assistant", "content": "Done."}
pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def isolating_machine():
    """Skipped, with the probe's reason, where the machine cannot isolate workers (helpers/sandbox.py)."""
    skip_unless_sandbox_isolates()


@pytest.fixture
def pool():
    sandbox = Sandbox(workers=2, limits=SandboxLimits(memory_mb=256, cpu_seconds=5))
    sandbox.prepare({"environment_factory": sticky.Tally})
    yield sandbox
    sandbox.close()


def results(rollout, row: int) -> list:
    """Row ``row``'s tool results, each read back from its JSON where it is one (else its text)."""
    out = []
    for entry in rollout.tool_calls[row]:
        try:
            out.append(json.loads(entry["result"]))
        except json.JSONDecodeError:
            out.append(entry["result"])
    return out


def test_each_episode_keeps_its_own_state_in_one_worker_process_and_scores_there(pool):
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [call("tally"), call("tally"), call("tally"), "done."])
    run = sampler(tok, None, engine, env=sticky.Tally, sandbox=pool)
    rollout = run(tiny(tok), ["Q", "R"], GREEDY, 2, rows={"references": ["3", "2"]})

    episodes = [results(rollout, row) for row in range(4)]
    for seen in episodes:
        assert [r["calls"] for r in seen] == [1, 2, 3]  # its own state, kept from call to call
        assert len({(r["pid"], r["namespace"]) for r in seen}) == 1  # one process for the episode
        assert seen[0]["namespace"] != sticky.pid_namespace()  # never the trainer's
    assert len({(seen[0]["pid"], seen[0]["namespace"]) for seen in episodes}) == 4  # one each
    assert len({seen[0]["namespace"] for seen in episodes}) == 2  # the 4 episodes share 2 workers
    assert "Tally up to 3." in engine.inputs[0]  # reset ran there, its text joined the prompt

    envs = rollout.facts()["environments"]
    scored = score(EnvironmentReward(), ["Q"] * 4, rollout.completions, sandbox=pool, environments=envs)
    assert scored.total == [13.0, 13.0, 3.0, 3.0] and scored.num_errors == 0  # 3 calls, +10 on target


def test_a_hung_call_ends_its_episode_alone_and_the_next_episodes_work(pool):
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [call("stall"), call("tally"), "done."])
    run = sampler(tok, None, engine, env=sticky.Tally, sandbox=pool, timeout=1.0)
    # Q's environment hangs in stall (its target is 0), R's answers: one episode per worker.
    rollout = run(tiny(tok), ["Q", "R"], GREEDY, 1, rows={"references": ["0", "1"]})

    hung, fine = results(rollout, 0), results(rollout, 1)
    assert hung[0].startswith("error: stall")
    assert hung[1] == (
        "error: tally raised SandboxCallError: Tally.tally cannot run: its episode ended when a call "
        "ran past its 1s and was killed"
    )
    assert fine[0] == "fine" and fine[1]["calls"] == 1
    assert rollout.tool_stats["tool_errors"].tolist() == [2, 0]
    envs = rollout.facts()["environments"]
    with pytest.warns(UserWarning, match="raised on 1 of 2 samples"):
        scored = score(EnvironmentReward(), ["Q", "R"], rollout.completions, "zero", environments=envs)
    assert scored.total == [0.0, 11.0] and scored.num_errors == 1  # the ended episode's score is an error

    engine.turns = [call("tally"), "done."]
    again = run(tiny(tok), ["Q", "R"], GREEDY, 1, rows={"references": ["1", "1"]})
    assert [results(again, row)[0]["calls"] for row in range(2)] == [1, 1]
    assert len(pool.worker_pids()) == 2  # the worker that held the hung episode was kept


def test_a_worker_that_dies_fails_its_episodes_by_name_and_is_replaced(pool):
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [call("tally"), "done."])
    run = sampler(tok, None, engine, env=sticky.Tally, sandbox=pool)
    rollout = run(tiny(tok), ["Q"], GREEDY, 1, rows={"references": ["1"]})
    (env,) = rollout.facts()["environments"]
    os.killpg(env.episode.worker.process.pid, 9)  # as the kernel's OOM killer would

    with pytest.raises(Exception, match=r"Tally.get_reward: its sandbox worker died|is gone"):
        env.get_reward()
    with pytest.raises(Exception, match=r"Tally.tally: its episode ended: its sandbox worker is gone"):
        env.tally()
    again = run(tiny(tok), ["Q"], GREEDY, 1, rows={"references": ["1"]})
    assert results(again, 0)[0]["calls"] == 1


def test_a_fit_under_sandbox_process_scores_each_episode_by_its_environment(tmp_path, trainer, loader):
    tok = chat_tokenizer()
    tools = FunctionTools(tok, None, environment_factory=sticky.Tally)
    turn = {"role": "assistant", "content": call("count")}
    turns = [turn, {"role": "tool", "content": "1"}, turn, {"role": "tool", "content": "2"}]
    script = tools.render([*tools.conversation("Q", "Tally up to 2."), *turns, DONE], False)
    torch.manual_seed(0)
    model = ScriptedLlama(tiny(tok).config)
    model.script = tok(script.removesuffix("<|im_end|>\n"), add_special_tokens=False)["input_ids"]
    grpo = GRPOLightningModule(
        model=model,
        tokenizer=tok,
        environment_factory=sticky.Tally,
        sandbox="process",
        sandbox_workers=2,
        use_chat_template=True,
        group_size=2,
        max_new_tokens=200,
        kl_beta=0.0,
        learning_rate=1e-3,
    )
    assert isinstance(grpo.reward, EnvironmentReward)
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "Q", "reference": "2"}] * 2))

    metrics = grpo.last_step.metrics
    assert metrics["train/tool_calls/count"] == 2.0 and metrics["train/tool_errors"] == 0.0
    assert metrics["train/reward"] == 12.0  # two calls on each episode's own counter, +10 on target
