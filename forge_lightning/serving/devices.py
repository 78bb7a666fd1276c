"""Where the rollout servers the trainer starts sample: the checks of ``rollout_device`` (a CPU or
CUDA device, or a comma-separated list of them dealt round-robin to the servers, serving/placement.py)
and ``rollout_memory_fraction`` (each server's share of a GPU it shares with the trainer), and the
list's parsing. None of them needs a GPU; a server started on a GPU this machine lacks says so
itself (``forge-lightning serve --device``)."""

from __future__ import annotations

from typing import Any

import torch


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
                f"rollout_device={device!r}: a rollout server samples on 'cpu' or 'cuda', not {kind!r}"
            )
    if memory_fraction is None:
        return
    if not isinstance(memory_fraction, int | float) or not 0 < memory_fraction < 1:
        raise ValueError(
            f"rollout_memory_fraction={memory_fraction!r} must be in (0, 1): the share of the GPU's "
            "memory a rollout server may take"
        )
    if kind != "cuda":
        raise ValueError(
            f"rollout_memory_fraction={memory_fraction} caps a CUDA rollout server's memory, but "
            f"rollout_device={device!r} samples on the CPU"
        )


def server_device(device: str | None) -> str:
    """The device a server samples on: the one it is given, else cuda where there is one, else the CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


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
