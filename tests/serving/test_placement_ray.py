"""``rollout_servers: [ray:N]`` on a local Ray instance (skipped where Ray is not installed): the
server is a Ray actor running ``forge-lightning serve``, the trainer's engine samples on it as on
any server, and closing the engine stops the actor's server."""

from __future__ import annotations

import pytest
import torch

from forge_lightning.models.loading import load_model
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.types import left_pad
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.integration


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_server_placed_as_a_ray_actor_samples_what_the_in_process_engine_samples(
    local_ray, tiny_model_dir, tmp_path
):
    model, tokenizer = load_model(str(tiny_model_dir), "float32", None)
    config = ServeConfig({"model": str(tiny_model_dir)})
    placement = Placement(["ray:1"], config, spec=str(tiny_model_dir), folder=tmp_path)
    engine = RemoteEngine(placement, tokenizer)
    try:
        engine.connect(model)
        (server,) = engine.servers
        assert server.name.startswith("ray:1 (") and len(placement.actors) == 1
        ids, mask = left_pad([tokenizer(p)["input_ids"] for p in ["ab", "c d"]], tokenizer.pad_token_id)
        request = GenerationRequest(ids, mask, 2, SamplingParams(max_new_tokens=5))
        torch.manual_seed(2)
        expected = HFGenerate(tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(model, request)
        torch.manual_seed(2)
        assert torch.equal(engine.generate(model, request).ids, expected.ids)
    finally:
        engine.close()
    assert placement.actors == [] and not engine.running
