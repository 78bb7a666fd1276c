"""Lightning checkpoints written whole or not at all."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from forge_lightning.config import check_resume, trainer_settings
from forge_lightning.fileio import SpaceCheck, write_atomically
from forge_lightning.reward_model import check_reward_models, reward_model_fingerprints
from forge_lightning.rewards import reward_parts

if TYPE_CHECKING:
    from forge_lightning.reporting import StepReporter
    from forge_lightning.rollout_sources import SyncRollouts


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


def save_run_state(
    checkpoint: dict[str, Any], trainer: Any, reporter: StepReporter, rollouts: SyncRollouts, reward: Any
) -> None:
    """What the module adds to a Lightning checkpoint (``on_save_checkpoint``). Lightning does not
    keep the RNG states; without them a resumed run would sample other completions than the
    uninterrupted one from the same step on. Reward models are kept as their folders' fingerprints."""
    checkpoint["forge_rng_states"] = rng_states()
    reward_models = reward_model_fingerprints(reward_parts(reward))
    if reward_models:
        checkpoint["forge_reward_models"] = reward_models
    checkpoint["forge_trainer_settings"] = trainer_settings(trainer)
    checkpoint["forge_tokens_trained"] = reporter.tokens_trained
    state = rollouts.state_dict()  # async: the batches in flight
    if state is not None:
        checkpoint["forge_async"] = state


def load_run_state(
    checkpoint: dict[str, Any],
    resumed: Any,
    hparams: Any,
    reporter: StepReporter,
    rollouts: SyncRollouts,
    reward: Any,
) -> None:
    """Restore what :func:`save_run_state` added (``on_load_checkpoint``); ``resumed``: the trainer
    of a fit that resumes from ``checkpoint`` (its settings checked against the checkpoint's, and
    the run's state restored), None outside fit."""
    if resumed is not None:
        check_resume(checkpoint, hparams, trainer_settings(resumed))
        check_reward_models(checkpoint.get("forge_reward_models", []), reward_parts(reward))
        reporter.tokens_trained = float(checkpoint.get("forge_tokens_trained", 0.0))
        if "forge_async" in checkpoint:
            rollouts.load_state_dict(checkpoint["forge_async"])
    if "forge_rng_states" in checkpoint:
        set_rng_states(checkpoint["forge_rng_states"])
