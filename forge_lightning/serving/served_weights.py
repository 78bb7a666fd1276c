"""What the trainer pushes to a rollout server: the tensors the server's model holds, under the
server's names, one at a time.

A server loads the plain HF model a run's config names, so whatever the trainer's policy is
wrapped in, the push walks the plain model's parameters:

* a plain HF model: its own parameters;
* a PEFT LoRA policy: the base model's parameters, each LoRA-wrapped weight merged as it comes
  (``W + scale * B @ A``, models/lora.py's ``merged_weights``), the adapter matrices left out and
  the model untouched;
* a policy sharded by FSDP2 (DTensor parameters, models/sharding.py): each parameter's full tensor,
  gathered one at a time.

Only one gathered or merged tensor is alive at a time, so the trainer never holds a second copy of
the model. :func:`served_shapes` lists the same names with their shapes without computing any
tensor (the fingerprint a trainer compares with a server's at connect).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from forge_lightning.models.lora import _checkpoint_name, has_adapter, merged_weights
from forge_lightning.models.sharding import is_sharded


def served_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of every weight the server's model holds, in its ``named_parameters()``
    order, one at a time.

    Under FSDP2 each parameter's full tensor is gathered (``full_tensor()``, an all-gather over
    the mesh): **every rank must walk this iterator to its end, in step**, and only global rank 0
    gets the tensors (the other ranks take part in each gather and get nothing), so the caller
    on rank 0 sends them and the others just exhaust it.
    """
    if is_sharded(model):
        yield from _gathered(model)
    elif has_adapter(model):
        yield from merged_weights(model)
    else:
        for name, param in model.named_parameters():
            yield name, param.detach()


def served_shapes(model: nn.Module) -> Iterator[tuple[str, torch.Size]]:
    """``(name, shape)`` of what :func:`served_tensors` yields, without gathering or merging
    anything (a DTensor's shape is its full one); on every rank."""
    if has_adapter(model):
        for name, param in model.get_base_model().named_parameters():
            plain = _checkpoint_name(name)  # None: an adapter's own matrix, or a weight's stale copy
            if plain is not None:
                yield plain, param.shape
        return
    for name, param in model.named_parameters():
        yield name, param.shape


def served_names(model: nn.Module) -> list[str]:
    """The names of what :func:`served_tensors` yields, in order."""
    return [name for name, _ in served_shapes(model)]


@torch.no_grad()
def _gathered(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Each parameter of a sharded ``model`` gathered whole, yielded on global rank 0 only."""
    from torch.distributed.tensor import DTensor

    first = torch.distributed.get_rank() == 0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if first:
            yield name, full
        del full  # freed before the next gather: one full tensor at a time
