"""The disk fallback of the weight push: a server whose weight group cannot be opened gets each
version through a safetensors folder instead, with a warning naming it, and holds the trainer's
weights after it as it would after a push over its group."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_model

from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig
from forge_lightning.serving.pusher import WeightPusher
from forge_lightning.serving.server import RolloutServer
from forge_lightning.serving.wire import SECRET_ENV

SECRET = "disk-secret"


async def no_group(self, server):
    raise RuntimeError("the store at 10.0.0.1:29500 could not be reached\nmore lines")


def test_a_server_without_a_group_gets_its_weights_from_a_folder(
    monkeypatch, tmp_path, tokenizer, tiny_model
):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setattr(WeightPusher, "_open", no_group)
    served = make_model(len(tokenizer), seed=9)  # other weights until the first push
    server = RolloutServer(served, tokenizer, SECRET)
    address = server.start().removeprefix("http://")
    placement = Placement([address], ServeConfig({}))
    placement.folder = tmp_path / "servers"
    engine = RemoteEngine(placement, tokenizer)
    try:
        warned = rf"rollout server .*{address}.*no weight group \(the store at .*reached\)"
        with pytest.warns(UserWarning, match=warned):
            engine.connect(tiny_model)
        for name, tensor in tiny_model.named_parameters():
            assert torch.equal(dict(served.named_parameters())[name], tensor), name
        with torch.no_grad():
            tiny_model.lm_head.weight.add_(1.0)  # a step
        engine.sync_weights(tiny_model)
        assert torch.equal(served.lm_head.weight, tiny_model.lm_head.weight)
        assert server.loop.version == 1
        # One folder on disk at a time: the newest version's.
        assert [p.name for p in (tmp_path / "servers" / "weights").iterdir()] == ["v1"]
    finally:
        engine.close()
        server.stop()
