"""The client against the real server (serving/server.py's RolloutServer, in this process): with one
server in sync mode the completions are the in-process engine's, from the trainer's own generator,
and the trainer's generator goes on where the in-process engine's would have."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_model

from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.types import completion_mask, left_pad
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.wire import SECRET_ENV

SECRET = "exact-secret"


@pytest.fixture
def remote(monkeypatch, tokenizer, tiny_model):
    """A RemoteEngine connected to one RolloutServer whose own weights are another model's (the
    push at connect replaces them with ``tiny_model``'s)."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    server = RolloutServer(make_model(len(tokenizer), seed=9), tokenizer, SECRET)
    address = server.start().removeprefix("http://")
    engine = RemoteEngine(Placement([address], ServeConfig({})), tokenizer)
    engine.connect(tiny_model)
    yield engine
    engine.close()
    server.stop()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=7, temperature=0.9),
        SamplingParams(max_new_tokens=7, top_k=5, stop=("a",)),
    ],
)
def test_one_server_samples_what_the_in_process_engine_samples(remote, tokenizer, tiny_model, params):
    ids, mask = left_pad([tokenizer(p)["input_ids"] for p in ["ab", "cde f", "g"]], tokenizer.pad_token_id)
    request = GenerationRequest(ids, mask, 3, params, logprobs=True)
    here = HFGenerate(tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    torch.manual_seed(4)
    expected, state_after = here.generate(tiny_model, request), torch.get_rng_state()
    torch.manual_seed(4)
    got = remote.generate(tiny_model, request)
    assert torch.equal(torch.get_rng_state(), state_after)
    assert torch.equal(got.ids, expected.ids)
    # Every sampled token's log-prob (the padding after a row's end is the caller's to mask).
    sampled = completion_mask(expected.ids, [tokenizer.eos_token_id]).bool()
    if params.stop:
        assert torch.equal(got.ends, expected.ends)
        sampled = torch.arange(expected.ids.shape[1]) < expected.ends[:, None]
    assert torch.allclose(got.logp[sampled], expected.logp[sampled], atol=1e-6)
