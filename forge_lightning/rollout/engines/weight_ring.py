"""Where the rollout worker samples, and the ring of weight versions it reads there.

The worker samples on the CPU unless ``rollout_device`` names a CUDA GPU: another one
(``"cuda:1"``) or the trainer's own (``"cuda"``), where ``rollout_memory_fraction`` caps the
worker's share of that GPU's memory. The ring lives on the worker's device: shared-memory CPU
tensors, or CUDA tensors the worker opens by IPC handle, so that the trainer's GPU weights reach
the worker device to device, never through the CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel


def check_rollout_device(device: str | None, memory_fraction: float | None) -> None:
    """Refuse, naming the setting, a ``rollout_device`` that is no CPU or CUDA device string, and a
    ``rollout_memory_fraction`` outside (0, 1) or without a CUDA device. Needs no GPU."""
    kind = "cpu"
    if device is not None:
        if not isinstance(device, str):
            raise ValueError(f"rollout_device must be a device string such as 'cuda:1', got {device!r}")
        try:
            kind = torch.device(device).type
        except RuntimeError as err:
            raise ValueError(f"rollout_device={device!r} is not a device torch understands: {err}") from None
        if kind not in ("cpu", "cuda"):
            raise ValueError(
                f"rollout_device={device!r}: the rollout worker samples on 'cpu' or 'cuda', not {kind!r}"
            )
    if memory_fraction is None:
        return
    if not isinstance(memory_fraction, int | float) or not 0 < memory_fraction < 1:
        raise ValueError(
            f"rollout_memory_fraction={memory_fraction!r} must be in (0, 1): the share of the GPU's "
            "memory the rollout worker may take"
        )
    if kind != "cuda":
        raise ValueError(
            f"rollout_memory_fraction={memory_fraction} caps a CUDA rollout worker's memory, but "
            f"rollout_device={device!r} samples on the CPU"
        )


def devices_of(text: Any) -> list[Any]:
    """The devices a comma-separated list names (``"cuda:0, cuda:1"``: ``["cuda:0", "cuda:1"]``),
    dealt round-robin to the rollout servers a trainer starts (serving/placement.py); none for
    None. Anything but a string comes back as it is, for the device check to refuse by name."""
    if text is None:
        return []
    return [part.strip() for part in text.split(",")] if isinstance(text, str) else [text]


def check_server_devices(device: Any, memory_fraction: float | None) -> None:
    """Refuse by name what cannot place the servers the trainer starts: a device in ``device``'s
    list that is no CPU or CUDA device, and a GPU memory share without CUDA devices to take it on."""
    devices = devices_of(device)
    if memory_fraction is not None and not devices:
        raise ValueError(
            f"rollout_memory_fraction={memory_fraction} caps each started server's share of its GPU: "
            "set rollout_device to their CUDA devices (cuda, or cuda:0,cuda:1)"
        )
    for one in devices:
        check_rollout_device(one, memory_fraction)


def resolved_rollout_device(device: str | None, trainer_device: torch.device) -> torch.device:
    """The device the worker samples on: the CPU for None; for ``"cuda"`` without an index, the
    trainer's GPU (the current one when the trainer is on the CPU). Raises, naming the setting and
    the GPU count, when this machine lacks the GPU asked for."""
    check_rollout_device(device, None)
    if device is None or torch.device(device).type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"rollout_device={device!r} asks for a CUDA GPU, but torch.cuda.is_available() is False here "
            f"(torch.cuda.device_count() is {torch.cuda.device_count()})"
        )
    index = torch.device(device).index
    if index is None:
        own = trainer_device.type == "cuda" and trainer_device.index is not None
        index = trainer_device.index if own else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"rollout_device={device!r} asks for GPU {index}, but torch.cuda.device_count() is {count}"
        )
    return torch.device("cuda", index)


class WeightRing:
    """Version-tagged copies of a model's parameters on ``device`` (default the CPU), ``slots`` of them.

    On the CPU the copies are in shared memory; on a GPU they are CUDA tensors that the worker
    process opens by IPC handle when the ring is handed to it, so this process must keep the ring
    alive while the worker runs. Version ``v`` lives in slot ``v % slots``. A slot's tag (CPU
    shared memory) is -1 while it is written and ``v`` once it holds version ``v`` whole; a reader
    checks the tag before and after copying, so it never takes a half-written copy for a whole one.
    CUDA copies run behind the host, so the writer waits for its device before it tags a slot, and
    the reader before it checks the tag again. With a staleness of k, the worker reads versions
    at most k behind the newest written, so k + 1 slots (and at least 2, a double buffer) keep
    every version it may still read.
    """

    def __init__(self, model: PreTrainedModel, slots: int, device: torch.device | None = None) -> None:
        if slots < 2:
            raise ValueError(f"a weight ring needs at least 2 slots, got {slots}")
        self.slots = slots
        self.device = torch.device("cpu") if device is None else torch.device(device)
        # name -> (dtype, offset, shape); one flat buffer per dtype and slot.
        self.layout: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        sizes: dict[str, int] = {}
        for name, param in model.named_parameters():
            dtype = str(param.dtype).removeprefix("torch.")
            self.layout[name] = (dtype, sizes.get(dtype, 0), tuple(param.shape))
            sizes[dtype] = sizes.get(dtype, 0) + param.numel()
        self.buffers = [
            {dtype: self._buffer(n, getattr(torch, dtype)) for dtype, n in sizes.items()}
            for _ in range(slots)
        ]
        self.tags = torch.full((slots,), -1, dtype=torch.long).share_memory_()

    def _buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        if self.device.type == "cpu":
            return torch.empty(numel, dtype=dtype).share_memory_()
        return torch.empty(numel, dtype=dtype, device=self.device)  # shared by IPC handle

    def _views(self, slot: int) -> dict[str, Tensor]:
        buffers = self.buffers[slot]
        return {
            name: buffers[dtype][offset : offset + math.prod(shape)].view(shape)
            for name, (dtype, offset, shape) in self.layout.items()
        }

    def _settle(self) -> None:
        """Wait until the copies queued on the ring's GPU are done (a cross-GPU copy makes the
        destination's stream wait for it, so this one device suffices)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def write(self, model: PreTrainedModel, version: int) -> None:
        """Copy ``model``'s parameters in as ``version`` (from any device)."""
        slot = version % self.slots
        self.tags[slot] = -1
        views = self._views(slot)
        for name, param in model.named_parameters():
            views[name].copy_(param.detach())
        self._settle()
        self.tags[slot] = version

    @torch.no_grad()
    def read_into(self, model: PreTrainedModel, version: int) -> None:
        """Copy ``version`` into ``model``'s parameters; raise when the ring no longer (or does not
        yet) hold it whole."""
        slot = version % self.slots
        found = int(self.tags[slot])
        if found != version:
            raise RuntimeError(f"weights version {version} is not in the ring (slot {slot} holds {found})")
        views, params = self._views(slot), dict(model.named_parameters())
        if set(params) != set(views):
            raise RuntimeError(
                f"the worker's model has other parameters than the trainer's: "
                f"{sorted(set(params) ^ set(views))[:5]}"
            )
        for name, param in params.items():
            param.copy_(views[name])
        self._settle()
        if int(self.tags[slot]) != version:
            raise RuntimeError(f"weights version {version} was overwritten while the worker read it")
