"""The decode batch's KV cache: the rows of several requests in one transformers ``DynamicCache``,
merged when a request joins and cut when one leaves (serving/decode.py).

Rows are right-aligned: every row's newest cached column is the cache's last, so one decode step
appends one column for all of them. A request whose sequences are shorter than the batch's is
left-padded with zero keys and values, which its attention mask hides, the way a left-padded
prompt's pads are hidden; its RoPE positions were applied when its keys were computed, so the
padding shifts nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _check_layers(cache: DynamicCache) -> None:
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        raise ValueError(
            f"the rollout server merges full-attention caches only; this model's cache has {sorted(kinds)} "
            "layers (sliding windows): serve a model without them"
        )


def cache_length(cache: DynamicCache | None) -> int:
    """How many columns ``cache`` holds (0 for none)."""
    return 0 if cache is None else cache.get_seq_length()


def _left_pad(t: Tensor, width: int) -> Tensor:
    """(B, H, L, D) -> (B, H, width, D), zeros on the left."""
    missing = width - t.shape[-2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], missing, t.shape[-1]), t], dim=-2)


def merge(batch: DynamicCache | None, joining: DynamicCache) -> DynamicCache:
    """The batch's rows then ``joining``'s, the shorter left-padded to the longer; ``batch`` is
    replaced, not changed in place (None: ``joining`` is the batch)."""
    _check_layers(joining)
    if batch is None or cache_length(batch) == 0:
        return joining
    width = max(cache_length(batch), cache_length(joining))
    for mine, theirs in zip(batch.layers, joining.layers, strict=True):
        mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0)
        mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0)
    return batch


def keep(cache: DynamicCache, rows: Tensor, width: int) -> DynamicCache | None:
    """Only ``rows`` (long indices) of ``cache``, and only its last ``width`` columns: after a
    request leaves, the columns only it reached are dropped. None when no row is left."""
    if rows.numel() == 0:
        return None
    for layer in cache.layers:
        layer.keys = layer.keys[rows, :, -width:, :] if width else layer.keys[rows, :, :0, :]
        layer.values = layer.values[rows, :, -width:, :] if width else layer.values[rows, :, :0, :]
    return cache


def left_pad_mask(masks: list[Tensor], width: int) -> Tensor:
    """The masks ``(N_i, L_i)`` of each request's rows, left-padded with zeros to ``width`` and
    stacked: ``(sum N_i, width)``."""
    return torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in masks], dim=0)
