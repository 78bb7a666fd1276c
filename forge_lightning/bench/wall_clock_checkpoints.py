"""Our side of the time-to-accuracy race (bench/time_to_accuracy.py): HF checkpoints at marks of
training wall-clock time, and the end of the fit at the budget.

Given to a fit as a callback of its own (HFCheckpoint saves by steps; the race needs the same
clock as TRL's side, bench/trl_time_reference.py)::

    forge-lightning fit ... --hf_checkpoint null --trainer.callbacks+='{"class_path":
        "forge_lightning.bench.wall_clock_checkpoints.WallClockCheckpoints",
        "init_args": {"output_dir": "runs/tta/ours", "every_s": 300, "budget_s": 1800}}'
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.callbacks.step_boundary import completed_step
from forge_lightning.run.fileio import append_jsonl

LOG_NAME = "checkpoints.jsonl"


class WallClockCheckpoints(Callback):
    """Saves the policy (HFCheckpoint's folder: model, tokenizer, card) to ``{output_dir}/{step}/``
    at every ``every_s`` seconds of training, and to ``{output_dir}/final/`` after the first step
    that ends at or past ``budget_s``, where it stops the fit. ``{output_dir}/checkpoints.jsonl``
    gets one line per folder: ``{"name", "folder", "step", "elapsed_s"}``.

    The clock starts at the first training batch (model load and set-up excluded, as TRL's side
    starts at its first step) and stops while a folder is written. Saves fall at optimizer-step
    boundaries only.

    Args:
        output_dir: where the folders and the log go.
        every_s: training seconds between checkpoints (> 0).
        budget_s: training seconds before the final checkpoint and the fit's end (> 0).
    """

    def __init__(self, output_dir: str, every_s: float, budget_s: float) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
        self.output_dir = Path(output_dir)
        self.every_s = every_s
        self.budget_s = budget_s
        self._writer = HFCheckpoint(output_dir=str(self.output_dir), save_steps=0)
        self._start: float | None = None
        self._paused = 0.0
        self._next_mark = every_s
        self._final_saved = False

    def elapsed(self) -> float:
        """Training seconds so far: since the first batch began, less the time spent saving."""
        return 0.0 if self._start is None else time.perf_counter() - self._start - self._paused

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if not completed_step(pl_module):
            return  # mid-step the weights are those of the previous step
        elapsed = self.elapsed()
        if elapsed >= self.budget_s:
            self._save(trainer, pl_module, "final", elapsed)
            trainer.should_stop = True
        elif elapsed >= self._next_mark:
            self._save(trainer, pl_module, str(trainer.global_step), elapsed)
            while self._next_mark <= elapsed:  # a step longer than every_s skips the marks it spans
                self._next_mark += self.every_s

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._final_saved:  # the fit ended (max_steps, max_time) before the budget
            self._save(trainer, pl_module, "final", self.elapsed())

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, elapsed: float) -> None:
        began = time.perf_counter()
        folder = self._writer.save(trainer, pl_module, name)
        if trainer.is_global_zero:
            line = {
                "name": name,
                "folder": str(folder),
                "step": trainer.global_step,
                "elapsed_s": round(elapsed, 3),
            }
            append_jsonl(self.output_dir / LOG_NAME, line)
        self._final_saved = name == "final"
        self._paused += time.perf_counter() - began


def read_checkpoints(folder: str | Path) -> list[dict[str, object]]:
    """The lines of a side's ``checkpoints.jsonl`` (ours or TRL's: the same format)."""
    path = Path(folder) / LOG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint log; the side's run above saved nothing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
