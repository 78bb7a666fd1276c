"""Async rollouts with tools on a rollout server (serving/remote_episodes.py): the tool loop runs on
the trainer's side, each round a request to the server, and the calculator's answers are this
process's; the batch trains with the server's log-probs of the policy's tokens (0 on the tool's),
and a stale batch carries the oldest version that sampled it, and trains in the step after."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
from helpers.models import make_tokenizer, scripted

from forge_lightning.callbacks import RewardLogger
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.wire import SECRET_ENV

pytestmark = pytest.mark.integration

SCRIPT = "Q:<<2*3=7>> ok"  # the model writes a wrong product; the calculator puts 6 in its place


@pytest.fixture
def address(monkeypatch):
    """One in-process rollout server holding a scripted model; its host:port."""
    monkeypatch.setenv(SECRET_ENV, "tools-secret")
    tokenizer = make_tokenizer()
    server = RolloutServer(scripted(tokenizer, SCRIPT, seed=2), tokenizer, "tools-secret")
    yield server.start().removeprefix("http://")
    server.stop()


def test_the_calculator_answers_on_the_trainers_side_of_an_async_run_on_a_server(
    tmp_path, address, module, trainer, loader
):
    pl.seed_everything(3)
    tok = make_tokenizer()
    grpo = module(
        model=scripted(tok, SCRIPT),
        tokenizer=tok,
        reward=lambda completions, **_: [float("=6>>" in c) for c in completions],
        calculator="annotation",
        rollout_mode="async",
        max_staleness=1,
        rollout_servers=[address],
        group_size=2,
        max_new_tokens=16,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
    )
    collected = []
    collect = grpo.engine.collect
    grpo.engine.collect = lambda ticket: collected.append(collect(ticket)) or collected[-1]
    fitted = trainer(tmp_path, max_steps=2, callbacks=[RewardLogger(logging_steps=1)])
    fitted.fit(grpo, loader([{"prompt": "Q:"}] * 3))
    logged = [json.loads(line) for line in (tmp_path / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and [r["staleness"] for r in logged] == [0.0, 1.0]
    assert [r["tool_calls"] for r in logged] == [1.0, 1.0] and [r["reward"] for r in logged] == [1.0, 1.0]
    assert [f.version for f in collected] == [0, 0]  # both handed before the first step
    for finished in collected:
        rollout = finished.rollout
        assert rollout.completions == ["<<2*3=6>> ok"] * 2  # this process's calculator answered
        mask = rollout.loss_mask()
        tool = rollout.completion_mask.bool() & ~mask
        assert tool.sum() == 2 * 3  # "6>>", read but not trained on
        # The server's log-prob of each sampled token (the script's: about 0), 0 on the tool's.
        assert finished.behav_logp.shape == rollout.completion_ids.shape
        assert (finished.behav_logp[tool] == 0).all() and (finished.behav_logp[mask] > -1e-3).all()
    assert not grpo.engine.running  # the fit's end closed the servers' connection and the loop
