"""Lightning checkpoints written whole or not at all, and the RNG states a resume restores."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from forge_lightning.run.fileio import SpaceCheck, write_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary sibling, syncs it, then renames it into place.

    A process killed mid-save leaves the previous file at that path untouched (and at worst a
    stray ``.tmp`` file, removed when the run next starts), so ``last.ckpt`` is always loadable.
    The checkpoint goes straight to that sibling: not through an in-memory copy nor ``$TMPDIR``
    (Lightning's own save passes through both). A failed write names the file and says when the
    disk is full; a warning comes first (once) when less space is left than the previous one took.
    """

    def __init__(self) -> None:
        super().__init__()
        self._space = SpaceCheck("Lightning checkpoint")

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        self._space.before(Path(path))
        write_atomically(path, lambda tmp: torch.save(checkpoint, tmp))
        self._space.after(Path(path))


def rng_states() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states, as types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` captured."""
    random.setstate(_as_tuples(states["python"]))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuples(value: Any) -> Any:
    # random.setstate needs tuples; a round trip through a checkpoint may hand back lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def refuse_unstored_objects(checkpoint_path: Any, kwargs: dict[str, Any]) -> None:
    """Refuse to stand the default model or reward in for one the checkpoint could not store (an
    object): ``load_from_checkpoint`` must be given ``model=``/``tokenizer=``/``reward=``."""
    saved = torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=True)
    stored = saved.get("hyper_parameters", {})
    missing = [name for name in ("model", "reward") if name not in stored and name not in kwargs]
    if missing:
        raise ValueError(
            f"{checkpoint_path} was trained with a {' and a '.join(missing)} given as an object, which "
            f"a checkpoint cannot store: pass {', '.join(f'{m}=' for m in missing)}"
            f"{' (and tokenizer=)' if 'model' in missing else ''} to load_from_checkpoint"
        )
