"""run/process_group.py: a process's default process group destroyed at its end, once."""

from __future__ import annotations

import torch
import torch.distributed as dist

from forge_lightning.run.process_group import release_process_group


def test_the_default_group_is_destroyed_once_and_nothing_is_done_without_one(tmp_path):
    assert release_process_group() is False  # none up: nothing to do
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        side = dist.new_group([0])
        summed = torch.ones(2)
        dist.all_reduce(summed, group=side)
        assert release_process_group() is True
        assert not dist.is_initialized()
        assert release_process_group() is False
    finally:  # no group left up for the worker's next test, whatever failed
        if dist.is_initialized():
            dist.destroy_process_group()
