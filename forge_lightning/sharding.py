"""FSDP2 sharding of the policy, for Lightning's ``ModelParallelStrategy``.

That strategy hands the module a device mesh and leaves the parallelisation to ``configure_model``:
each transformer block (the classes a HF model lists in ``_no_split_modules``) becomes one
``fully_shard`` unit, and the whole model the root unit that holds the rest (embeddings, final
norm, head). Every rank then holds 1/N of the weights, gradients and optimizer state, and a unit
gathers its full weights for its own forward and frees them after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_policy(model: nn.Module, mesh: DeviceMesh) -> None:
    """Apply ``fully_shard`` over ``mesh`` to each transformer block of ``model``, then to ``model``."""
    from torch.distributed.fsdp import fully_shard  # public from torch 2.6

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block classes (_no_split_modules); "
            "it cannot be sharded block by block"
        )
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 unit (its forward gathers weights from every rank)."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no public FSDP2, so nothing here was sharded with it
        return False
    return isinstance(model, FSDPModule)
