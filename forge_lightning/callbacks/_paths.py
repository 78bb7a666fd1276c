from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl


def output_dir(trainer: pl.Trainer, configured: str | None) -> Path:
    """The run's output folder: the callback's own setting, else ``trainer.default_root_dir``."""
    return Path(configured if configured is not None else trainer.default_root_dir)
