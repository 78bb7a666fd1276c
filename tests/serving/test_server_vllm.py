"""The rollout server with vLLM sampling (serving/vllm_loop.py, ``serve --engine vllm``), on CPU
through the fake engine the vLLM backend's tests use (tests/helpers/fake_vllm.py): no vLLM, no GPU.

What is checked: the request reaches vLLM as the in-process engine would send it (prompts
unpadded, the same seeds from the trainer's ``rng_state``, the state after handed back); the answer
carries vLLM's tokens, log-probs and the server's version per token; pushed weights reach vLLM's
model; ``min_version`` and weight updates keep the decode loop's rules.
"""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
from helpers.fake_vllm import EOS, TOKEN_LOGP, FakeLLM, fake_vllm_module
from helpers.serving import SECRET, call, run_until

from forge_lightning.cli.serve import main as serve_main
from forge_lightning.cli.serve import model_settings, sampler
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.vllm import VLLMGenerate
from forge_lightning.serving import weights
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.vllm_loop import VLLMLoop
from forge_lightning.serving.wire import (
    GenerateAnswer,
    GenerateCall,
    Info,
    encode_rng_state,
    fingerprint,
)
from forge_lightning.testing.tiny import tiny_model, tiny_policy

TOKEN = 65  # what the fake engine writes


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module())


@pytest.fixture
def served():
    """A tiny policy, its vLLM loop over the fake engine (``engines`` holds it once built)."""
    policy = tiny_policy(seed=0, max_position_embeddings=256)
    engines: list[FakeLLM] = []

    def factory(model, tokenizer, gpu_memory_utilization):
        engines.append(FakeLLM(TOKEN))
        return engines[-1]

    loop = VLLMLoop(policy.model, policy.tokenizer, engine_factory=factory)
    return policy, loop, engines


def test_the_server_answers_with_vllms_tokens_logprobs_and_its_version(served):
    policy, loop, engines = served
    server = RolloutServer(policy.model, policy.tokenizer, SECRET, loop=loop)
    url = server.start()
    try:
        info = Info.from_json(call(url, "/info")[1])
        assert info.engine == "vllm" and info.fingerprint == fingerprint(policy.model, policy.tokenizer)
        request = GenerateCall("v", [[5, 6, 7], [8]], 3, SamplingParams(3), logprobs=True, seed=4)
        status, body = call(url, "/generate", request.to_json())
    finally:
        server.stop()
    answer = GenerateAnswer.from_json(body)
    assert status == 200 and answer.request_id == "v"
    # Completion j of a prompt: j+1 tokens then EOS, cut at max_new_tokens (3).
    group = [[TOKEN, EOS], [TOKEN, TOKEN, EOS], [TOKEN] * 3]
    assert answer.completions == group + group
    assert answer.logp == [[TOKEN_LOGP] * len(row) for row in group + group]
    assert answer.versions == [[0] * len(row) for row in group + group]
    assert answer.truncated == [False, False, True] * 2
    prompts, params = engines[0].requests[0]
    assert prompts == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}]  # unpadded
    assert [p.n for p in params] == [3, 3] and params[0].logprobs == 0


def test_with_the_trainers_rng_state_vllm_gets_the_in_process_engines_seeds(served):
    policy, loop, engines = served
    torch.manual_seed(11)
    state = torch.get_rng_state()
    params = SamplingParams(4, temperature=0.7, top_k=5)
    future = loop.submit(GenerateCall("s", [[5, 6], [7, 8, 9]], 2, params, rng_state=encode_rng_state(state)))
    run_until(loop, future)

    local: list[FakeLLM] = []
    in_process = VLLMGenerate(
        policy.tokenizer, [EOS], engine_factory=lambda *_: local.append(FakeLLM(TOKEN)) or local[-1]
    )
    torch.set_rng_state(state)
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    in_process.generate(policy.model, GenerationRequest(ids, (ids != 0).long(), 2, params))

    served_params, local_params = engines[0].requests[0][1], local[0].requests[0][1]
    assert [vars(p) for p in served_params] == [vars(p) for p in local_params]
    assert future.result().rng_state == encode_rng_state(torch.get_rng_state())
    # A seed instead: the same seed, the same vLLM seeds; the server's own generator untouched.
    before = torch.get_rng_state()
    for name in ("a", "b"):
        run_until(loop, loop.submit(GenerateCall(name, [[5]], 2, params, seed=3)))
    assert engines[0].requests[1][1][0].seed == engines[0].requests[2][1][0].seed
    assert torch.equal(torch.get_rng_state(), before)


def test_pushed_weights_reach_vllm_and_later_requests_carry_their_version(served, tmp_path):
    policy, loop, engines = served
    early = loop.submit(GenerateCall("early", [[5]], 1, SamplingParams(2)))
    waiting = loop.submit(GenerateCall("later", [[5]], 1, SamplingParams(2), min_version=1))
    run_until(loop, early)
    assert not waiting.done()  # it asked for version 1
    (engine,) = engines
    assert len(engine.model.loads) == 1  # the engine was built with the model's own weights

    trainer = tiny_model(seed=9, max_position_embeddings=256)
    weights.write_folder(trainer.named_parameters(), tmp_path / "v1")
    update = loop.update(1, lambda model: weights.load_folder(model, tmp_path / "v1"))
    run_until(loop, waiting)

    assert update.result() == 1 and waiting.result().versions == [[1, 1]]
    loaded = engine.model.loads[-1]
    assert set(loaded) == {name for name, _ in trainer.named_parameters()}
    assert all(torch.equal(loaded[name], p) for name, p in trainer.named_parameters())
    assert engine.prefix_cache_resets == 2  # the cache of the old weights is dropped
    assert [event for _, event, _ in loop.record] == ["admit", "finish", "update", "admit", "finish"]


def test_a_request_vllm_refuses_fails_alone(served):
    _, loop, _ = served
    with pytest.raises(ValueError, match="outside the vocabulary"):
        loop.submit(GenerateCall("x", [[10**6]], 1, SamplingParams(2)))
    bad = loop.submit(GenerateCall("bad", [[5]], 1, SamplingParams(2, extra={"no_such_field": 1})))
    good = loop.submit(GenerateCall("good", [[5]], 1, SamplingParams(2)))
    run_until(loop, bad, good)
    with pytest.raises(ValueError):
        bad.result()
    assert good.result().completions == [[TOKEN, EOS]]
    assert loop.health() == {"version": 0, "active": 0, "queued": 0}


def test_serve_takes_engine_vllm_with_the_configs_memory_share(tmp_path, monkeypatch, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  model: random:x\n  vllm_gpu_memory_utilization: 0.55\n")
    settings = model_settings([str(config)], [])
    policy = tiny_policy(seed=0, max_position_embeddings=256)
    args = argparse.Namespace(engine="vllm", device=None)
    loop = sampler(args, policy.model, policy.tokenizer, settings)
    assert isinstance(loop, VLLMLoop) and loop.sampler.gpu_memory_utilization == 0.55
    assert loop.name == "vllm"

    monkeypatch.setenv("FORGE_LIGHTNING_SERVE_SECRET", SECRET)
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--config", str(config), "--port", "0", "--engine", "vllm", "--device", "cuda:1"])
    assert exit_.value.code == 2
    assert "set CUDA_VISIBLE_DEVICES, not --device" in capsys.readouterr().err
