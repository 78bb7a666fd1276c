"""The progress bar a run shows unless its config names one: Rich's (or TQDM's), without the logger's
version number."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar


class _WithoutVersion:
    """A progress bar without the logger's version number (``v_num``), which says nothing about
    training; the reward and kl the module puts on the bar stay."""

    def get_metrics(self, trainer: Trainer, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        metrics.pop("v_num", None)
        return metrics


class _RichBar(_WithoutVersion, RichProgressBar):
    pass


class _TQDMBar(_WithoutVersion, TQDMProgressBar):
    pass


def default_progress_bar() -> ProgressBar:
    """Rich's progress bar (reward and kl beside it) when ``rich`` imports, else Lightning's TQDM one."""
    try:
        return _RichBar()
    except ModuleNotFoundError:
        return _TQDMBar()
