"""The rollout server over HTTP, in this process (serving/server.py, serving/weights.py): the door,
/info, /health, /generate, weight updates over a real gloo group and from a folder, and a stop's grace."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.serving import SECRET, call

from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.serving import weights
from forge_lightning.serving.server import RolloutServer, secret_from
from forge_lightning.serving.wire import (
    SECRET_ENV,
    GenerateAnswer,
    GenerateCall,
    GroupCall,
    Info,
    UpdateCall,
    differences,
    fingerprint,
)
from forge_lightning.testing.tiny import tiny_policy


@pytest.fixture
def served():
    policy = tiny_policy(seed=0, max_position_embeddings=256)
    server = RolloutServer(policy.model, policy.tokenizer, SECRET)
    url = server.start()
    yield policy, server, url
    server.stop()


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_every_endpoint_is_behind_the_door(served):
    _, _, url = served
    for path, body in (("/health", None), ("/info", None), ("/generate", {}), ("/weights/update", {})):
        for secret in (None, "wrong"):
            status, answer = call(url, path, body, secret=secret)
            assert status == 401 and "Authorization: Bearer" in answer["error"]


def test_the_server_refuses_to_start_without_its_secret():
    with pytest.raises(
        ValueError, match=f"{SECRET_ENV} is not set: set it to the secret the trainer is given"
    ):
        secret_from({})
    assert secret_from({SECRET_ENV: "x"}) == "x"


def test_info_health_and_generate(served):
    policy, _, url = served
    status, body = call(url, "/info")
    info = Info.from_json(body)
    assert status == 200 and info.version == 0 and info.engine == "hf"
    assert differences(info.fingerprint, fingerprint(policy.model, policy.tokenizer)) == []
    assert [p.name for p in info.parameters] == [name for name, _ in policy.model.named_parameters()]
    assert call(url, "/health") == (200, {"version": 0, "active": 0, "queued": 0})

    request = GenerateCall("g", [[5, 6, 7], [8]], 2, SamplingParams(5), logprobs=True, seed=4)
    status, body = call(url, "/generate", request.to_json())
    answer = GenerateAnswer.from_json(body)
    assert status == 200 and answer.request_id == "g" and len(answer.completions) == 4
    assert [len(v) for v in answer.versions] == [len(c) for c in answer.completions]

    status, body = call(url, "/generate", {**request.to_json(), "prompts": [[10**6]]})
    assert status == 400 and "outside the vocabulary" in body["error"]


def test_a_weight_update_over_a_gloo_group(served):
    policy, server, url = served
    trainer = tiny_policy(seed=9, max_position_embeddings=256).model
    assert not same_weights(trainer, policy.model)
    info = Info.from_json(call(url, "/info")[1])
    store = weights.open_store("127.0.0.1", 0, master=True, timeout_s=20)
    answers = {}

    def post(path, body):  # the server answers once the trainer's end has done its part
        answers[path] = call(url, path, body)

    joining = threading.Thread(
        target=post, args=("/weights/group", GroupCall("127.0.0.1", store.port, "s0", 20).to_json())
    )
    joining.start()
    group = weights.open_group("127.0.0.1", store.port, "s0", weights.TRAINER_RANK, 20, store=store)
    joining.join()
    updating = threading.Thread(target=post, args=("/weights/update", UpdateCall(1).to_json()))
    updating.start()
    weights.WeightSender(group, info.parameters).send(trainer.named_parameters())
    updating.join()

    assert answers == {"/weights/group": (200, {}), "/weights/update": (200, {"version": 1})}
    assert same_weights(trainer, policy.model)
    assert call(url, "/health")[1]["version"] == 1


def test_a_weight_update_from_a_folder(served, tmp_path):
    policy, _, url = served
    trainer = tiny_policy(seed=9, max_position_embeddings=256).model
    weights.write_folder(trainer.named_parameters(), tmp_path / "v3")
    assert call(url, "/weights/update", UpdateCall(3, "disk", str(tmp_path / "v3")).to_json()) == (
        200,
        {"version": 3},
    )
    assert same_weights(trainer, policy.model)
    status, body = call(url, "/weights/update", UpdateCall(4, "disk", str(tmp_path / "none")).to_json())
    assert status == 500 and "index.json not found" in body["error"]
    status, body = call(url, "/weights/update", UpdateCall(4).to_json())
    assert status == 400 and "POST /weights/group before" in body["error"]


def test_a_stop_waits_grace_s_not_30_on_an_event_loop_that_cannot_clean_up():
    # forge-lightning serve stopping on a signal (cli/serve.py): the server's event loop held for
    # 8 s (as by a handler that blocks it), so that its cleanup cannot run; the stop goes on after
    # grace_s. (A request merely under way does not need this: aiohttp's own shutdown_timeout of
    # 1 s cancels it; with a fixed 30 s wait this stop took the loop's 8 s and more.)
    policy = tiny_policy(seed=0, max_position_embeddings=256)
    server = RolloutServer(policy.model, policy.tokenizer, SECRET)
    server.start()
    server._events.call_soon_threadsafe(time.sleep, 8)
    started = time.monotonic()
    server.stop(grace_s=1.0)
    assert time.monotonic() - started < 6
