"""Fits with async rollouts on a rollout server and what the in-process worker refuses: top-p,
stop strings and LoRA, whose stale batch trains with the server's log-probs as the sampler's
(``behav_logp``), those of the cut distribution it sampled from; and use_engine_logprobs, whose
fresh batch trains with them as the old policy's."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer
from helpers.rewards import varied

from forge_lightning.callbacks import RewardLogger
from forge_lightning.models.lora import LoraSettings, has_adapter
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.wire import SECRET_ENV

pytestmark = pytest.mark.integration

PROMPTS = [{"prompt": p} for p in ("aa b", "c", "ab ab", "d a", "5 + 3 =", "xyz")]
STOP = ["a", "e", "o", " ", ".", "1", "x", "T"]  # single characters: some rows stop at one


@pytest.fixture
def address(monkeypatch):
    """One in-process rollout server (another model's weights until the first push); its host:port."""
    monkeypatch.setenv(SECRET_ENV, "fit-secret")
    tokenizer = make_tokenizer()
    server = RolloutServer(make_model(len(tokenizer), seed=2), tokenizer, "fit-secret")
    yield server.start().removeprefix("http://")
    server.stop()


def test_async_on_a_server_trains_top_p_stop_strings_and_lora_on_the_servers_logprobs(
    tmp_path, address, module, trainer, loader
):
    pl.seed_everything(3)
    grpo = module(
        reward=varied,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
        rollout_mode="async",
        max_staleness=1,
        rollout_servers=[address],
        top_p=0.9,
        stop=STOP,
        peft=LoraSettings(r=4, alpha=8, dropout=0.0),
    )
    collected, trained = record(grpo)
    fitted = trainer(tmp_path, max_steps=2, callbacks=[RewardLogger(logging_steps=1)])
    fitted.fit(grpo, loader(PROMPTS, batch_size=2))
    logged = [json.loads(line) for line in (tmp_path / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and [r["staleness"] for r in logged] == [0.0, 1.0]
    assert all(math.isfinite(r["loss"]) for r in logged) and has_adapter(grpo.model)
    [(first, trainers_logp), (second, _)] = trained
    assert first.behav_logp is None  # lag 0: the synchronous loss
    torch.testing.assert_close(second.behav_logp.cpu(), collected[1].behav_logp, rtol=0, atol=0)
    # At lag 0 the server held the trainer's weights: its log-prob of each token is the top-p cut
    # distribution's, above the whole distribution's that the trainer computes.
    mask = first.completion_mask.bool()
    lift = collected[0].behav_logp[mask] - trainers_logp.cpu()[mask]
    assert (lift > 1e-3).all() and (lift < -math.log(0.9) + 1e-4).all()
    # The server cut rows at the stop strings: each row ends where it said, some at a string.
    for rollout, finished in zip((first, second), collected):
        assert rollout.completion_mask.sum(dim=1).tolist() == finished.ends.tolist()
    texts = first.completions + second.completions
    assert any(text.endswith(tuple(STOP)) for text in texts)


def test_with_use_engine_logprobs_a_fresh_batch_trains_on_the_servers_logprobs_as_the_old_policys(
    tmp_path, address, module, trainer, loader
):
    pl.seed_everything(3)
    grpo = module(
        reward=varied,
        kl_beta=0.0,
        gradient_accumulation_steps=1,
        rollout_mode="async",
        max_staleness=1,
        rollout_servers=[address],
        use_engine_logprobs=True,
    )
    collected, trained = record(grpo)
    trainer(tmp_path, max_steps=2).fit(grpo, loader(PROMPTS, batch_size=2))
    [(fresh, trainers_logp), (stale, _)] = trained
    # Lag 0: the server held the trained weights, so its scores stand in for the old policy's (the
    # whole distribution's at the loss's temperature: the trainer's own, to float error).
    torch.testing.assert_close(fresh.old_logp.cpu(), collected[0].behav_logp, rtol=0, atol=0)
    mask = fresh.completion_mask.bool()
    torch.testing.assert_close(fresh.old_logp[mask], trainers_logp[mask], rtol=1e-4, atol=1e-4)
    assert fresh.behav_logp is None
    # Lag 1: the old policy is the trainer's weights now (the decoupled loss), the server's the sampler's.
    assert stale.old_logp is None
    torch.testing.assert_close(stale.behav_logp.cpu(), collected[1].behav_logp, rtol=0, atol=0)


def record(grpo):
    """The server's answers as the source collects them, and each trained rollout with the
    policy's own log-probs of it before its step."""
    collected, trained = [], []
    collect, rollouts = grpo.engine.collect, grpo.rollout_source.rollouts

    def collecting(ticket):
        collected.append(collect(ticket))
        return collected[-1]

    def training(batch, loop, model):
        for item in rollouts(batch, loop, model):
            trained.append((item.rollout, grpo.scorer.log_probs_no_grad(model, item.rollout)))
            yield item

    grpo.engine.collect, grpo.rollout_source.rollouts = collecting, training
    return collected, trained
