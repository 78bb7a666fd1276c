"""The first difference between two runs of one config: every value of their training logs and
every weight they saved (``forge-lightning check-resume`` compares a resumed run with a straight one).

Logged values agree when equal, floats to a relative tolerance (``rtol``); weights and optimizer
states must be equal bit for bit: a resume restores them, it does not recompute them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from forge_lightning.run.folder import LOG_NAME

# What a Lightning checkpoint holds of the training state itself (the rest is bookkeeping, some
# of it, such as timings of callbacks, different in every run).
CHECKPOINT_STATE = ("state_dict", "optimizer_states")


@dataclass(frozen=True)
class Difference:
    """Where two runs part: ``where`` (the file), ``key`` (the value in it), each run's value."""

    where: str
    key: str
    straight: Any
    resumed: Any

    def __str__(self) -> str:
        return f"{self.where}, {self.key}: straight {_show(self.straight)}, resumed {_show(self.resumed)}"


def first_difference(
    straight: Path, resumed: Path, rtol: float = 1e-6, ignore: tuple[str, ...] = ()
) -> Difference | None:
    """The first difference between run folders ``straight`` and ``resumed``: in the training
    log (record by record, key by key, ``ignore`` aside: wall-clock timings), then in every
    ``.safetensors`` file the straight run saved, then in ``checkpoints/last.ckpt``; None if none."""
    return (
        _log_difference(straight, resumed, rtol, ignore)
        or _safetensors_difference(straight, resumed)
        or _checkpoint_difference(straight, resumed)
    )


def _log_difference(straight: Path, resumed: Path, rtol: float, ignore: tuple[str, ...]) -> Difference | None:
    want, got = _records(straight / LOG_NAME), _records(resumed / LOG_NAME)
    steps = [r.get("step") for r in want], [r.get("step") for r in got]
    if steps[0] != steps[1]:
        return Difference(LOG_NAME, "steps logged", steps[0], steps[1])
    for a, b in zip(want, got):
        for key in dict.fromkeys([*a, *b]):
            if key in ignore:
                continue
            want_value, got_value = a.get(key, _MISSING), b.get(key, _MISSING)
            if not _agree(want_value, got_value, rtol):
                return Difference(f"{LOG_NAME} step {a.get('step')}", key, want_value, got_value)
    return None


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _agree(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, int):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
    return a == b


def _safetensors_difference(straight: Path, resumed: Path) -> Difference | None:
    for path in sorted(straight.rglob("*.safetensors")):
        name = path.relative_to(straight)
        if any(part.startswith(".") for part in name.parts):  # a write's temporary sibling
            continue
        other = resumed / name
        if not other.is_file():
            return Difference(str(name), "the file", _WRITTEN, _MISSING)
        difference = _tensor_difference(str(name), load_file(path), load_file(other))
        if difference is not None:
            return difference
    return None


def _checkpoint_difference(straight: Path, resumed: Path) -> Difference | None:
    name = Path("checkpoints") / "last.ckpt"
    if not (straight / name).is_file():
        return None
    if not (resumed / name).is_file():
        return Difference(str(name), "the file", _WRITTEN, _MISSING)
    return _tensor_difference(str(name), _training_state(straight / name), _training_state(resumed / name))


def _training_state(path: Path) -> dict[str, Any]:
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return {key: saved.get(key) for key in CHECKPOINT_STATE}


def _tensor_difference(where: str, want: Any, got: Any) -> Difference | None:
    """The first leaf of nested dicts and lists (a state dict, an optimizer state) that differs:
    tensors must be equal in dtype, shape and every element."""
    mine, theirs = dict(_leaves(want)), dict(_leaves(got))
    for key in dict.fromkeys([*mine, *theirs]):
        a, b = mine.get(key, _MISSING), theirs.get(key, _MISSING)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                return Difference(where, key, a, b)
            if not torch.equal(a, b):
                return _first_element(where, key, a, b)
        elif not _agree(a, b, 0.0):
            return Difference(where, key, a, b)
    return None


def _first_element(where: str, key: str, a: torch.Tensor, b: torch.Tensor) -> Difference:
    """The difference of two unequal tensors of one shape, named by their first element apart."""
    index = int((a != b).flatten().nonzero()[0])
    at = [int(i) for i in torch.unravel_index(torch.tensor(index), a.shape)] if a.dim() else []
    return Difference(where, f"{key}{at}", a.flatten()[index].item(), b.flatten()[index].item())


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            yield from _leaves(inner, f"{prefix}[{i}]")
    else:
        yield prefix, value


class _Marker:
    """A value one run has and the other lacks, as the report names it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_MISSING, _WRITTEN = _Marker("missing"), _Marker("written")


def _show(value: Any) -> str:
    """A value as the report prints it: a tensor by its shape and a few numbers, not in full."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        head = ", ".join(f"{v:.8g}" for v in flat[:4].tolist())
        return f"tensor{tuple(value.shape)} {value.dtype} [{head}{', ...' if flat.numel() > 4 else ''}]"
    return repr(value)
