"""Fits whose rollouts are sampled by rollout servers the trainer starts (``rollout_servers``):
``['local:1']`` in sync mode trains what the in-process engine trains, and the servers stop with
the fit however it ends."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer
from helpers.rewards import varied
from lightning.pytorch.callbacks import ModelCheckpoint

from forge_lightning.callbacks import RewardLogger
from forge_lightning.serving.client import NoServerLeft
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.wire import SECRET_ENV

pytestmark = pytest.mark.integration

PROMPTS = [{"prompt": p} for p in ("aa b", "c", "ab ab", "d a", "5 + 3 =", "xyz")]


@pytest.fixture
def fit_log(module, trainer, loader):
    """``fit_log(root, **settings)``: a seeded 3-step fit of the tiny module with a reward that
    differs within most groups and a KL pull (so the loss moves off zero after the first step),
    and its training_log.jsonl records."""

    def fit(root: Path, **settings) -> list[dict]:
        pl.seed_everything(3)
        grpo = module(reward=varied, kl_beta=0.1, gradient_accumulation_steps=1, **settings)
        fitted = trainer(root, max_steps=3, callbacks=[RewardLogger(logging_steps=1)])
        fitted.fit(grpo, loader(PROMPTS, batch_size=2))
        return [json.loads(line) for line in (root / "training_log.jsonl").read_text().splitlines()]

    return fit


def test_one_local_server_in_sync_mode_trains_what_the_in_process_engine_trains(tmp_path, fit_log):
    here = fit_log(tmp_path / "here")
    served = fit_log(tmp_path / "served", rollout_servers=["local:1"])
    assert [r["step"] for r in served] == [1, 2, 3]
    assert all(r["reward_std"] > 0 for r in here) and here[2]["kl"] > 0  # rewards vary, the policy moved
    for mine, theirs in zip(here, served):
        for key in ("reward", "reward_std", "completion_length", "num_tokens"):
            assert theirs[key] == mine[key], key
        for key in ("loss", "kl", "grad_norm"):
            assert abs(theirs[key] - mine[key]) <= 1e-6, key
        assert theirs["server_failures"] == 0 and "server_failures" not in mine
    # The server's output went to the run folder; it is stopped with the fit.
    assert (tmp_path / "served" / "servers" / "server-1.log").is_file()


def test_with_every_server_dead_the_fit_stops_naming_them_and_saves_last_ckpt(
    tmp_path, monkeypatch, module, trainer, loader
):
    monkeypatch.setenv(SECRET_ENV, "fit-secret")
    tokenizer = make_tokenizer()
    server = RolloutServer(make_model(len(tokenizer), seed=2), tokenizer, "fit-secret")
    address = server.start().removeprefix("http://")
    grpo = module(reward=varied, gradient_accumulation_steps=1, rollout_servers=[address])

    class StopServer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            server.stop()

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0)
    fitted = trainer(tmp_path, max_steps=3, callbacks=[StopServer(), checkpoints], enable_checkpointing=True)
    with pytest.warns(UserWarning, match=f"rollout server {address} is marked dead"):
        with pytest.raises(NoServerLeft, match=f"no rollout server is left \\(all of {address} stopped"):
            fitted.fit(grpo, loader(PROMPTS, batch_size=2))
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 1


@pytest.fixture
def in_process_server(monkeypatch):
    """A RolloutServer in this process behind a secret the trainer gets; its host:port."""
    monkeypatch.setenv(SECRET_ENV, "async-secret")
    tokenizer = make_tokenizer()
    server = RolloutServer(make_model(len(tokenizer), seed=2), tokenizer, "async-secret")
    yield server.start().removeprefix("http://")
    server.stop()


def test_async_modes_own_server_trains_what_a_server_listed_as_host_port_trains(
    tmp_path, fit_log, in_process_server
):
    """Async mode with no servers listed starts its one local:1 server (the in-process rollout
    worker's place): the same training log as a run on a server the user started."""
    async_settings = dict(rollout_mode="async", max_staleness=1, rollout_worker_threads=1)
    own = fit_log(tmp_path / "own", **async_settings)
    served = fit_log(tmp_path / "served", rollout_servers=[in_process_server], **async_settings)
    assert [r["staleness"] for r in served] == [0.0, 1.0, 1.0] and [r["step"] for r in served] == [1, 2, 3]
    assert (tmp_path / "own" / "servers" / "server-1.log").is_file()
    for mine, theirs in zip(own, served):
        for key in ("reward", "reward_std", "num_tokens", "staleness", "regenerated"):
            assert theirs[key] == mine[key], key
        for key in ("loss", "kl", "grad_norm"):
            assert abs(theirs[key] - mine[key]) <= 1e-6, key


def test_partial_rollouts_on_a_server_train_every_batch_at_most_max_staleness_behind(
    tmp_path, fit_log, in_process_server
):
    logged = fit_log(
        tmp_path,
        rollout_mode="async",
        max_staleness=1,
        rollout_servers=[in_process_server],
        partial_rollouts=True,
    )
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all(r["staleness_max"] <= 1 and r["regenerated"] == 0 for r in logged)
    assert all(r["server_failures"] == 0 and r["num_tokens"] > 0 for r in logged)
