"""Two trainer ranks holding an FSDP2-sharded tiny policy push it to one rollout server (started
in rank 0's process): at connect, and after a change of every shard, the server must hold the
full tensors. Rank 0 writes ``OUT/result.json`` ({"connect": bool, "step": bool, "version": int}).

    FORGE_LIGHTNING_SERVE_SECRET=... PYTHONPATH=tests python -m torch.distributed.run --standalone \
        --nproc_per_node=2 tests/helpers/fsdp_push.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from forge_lightning.models.sharding import shard_policy
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig
from forge_lightning.serving.server import RolloutServer
from helpers.models import make_model, make_tokenizer


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: every rank calls it)."""
    return {name: param.full_tensor().clone() for name, param in model.named_parameters()}


def holds(served: torch.nn.Module, full: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(param, full[name]) for name, param in served.named_parameters())


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    shard_policy(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    address_file = out / "address"
    server = served = None
    if rank == 0:
        served = make_model(len(tokenizer), seed=9)  # other weights until the first push
        server = RolloutServer(served, tokenizer, os.environ["FORGE_LIGHTNING_SERVE_SECRET"])
        address_file.write_text(server.start().removeprefix("http://"))
    while not address_file.exists():
        time.sleep(0.05)
    engine = RemoteEngine(Placement([address_file.read_text()], ServeConfig({})), tokenizer)
    engine.connect(model)
    full = full_tensors(model)
    result = {"connect": rank == 0 and holds(served, full)}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # every rank's shard changes, as an optimizer step's would
    engine.sync_weights(model)
    full = full_tensors(model)
    if rank == 0:
        result.update(step=holds(served, full), version=server.loop.version)
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    engine.close()
    if server is not None:
        server.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
