"""The throughput bench's step timing: the module's rollout source that also keeps each rollout it
hands over (:class:`RecordingRollouts`), and the callback that times each training step, takes its
peak memory and runs the reference measurements right after it (:class:`StepTimer`)."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from forge_lightning.bench.peak_rss import PeakPhaseProfiler, PeakRss
from forge_lightning.bench.references import plain_generate_seconds, straightforward_update_seconds
from forge_lightning.module import GRPOLightningModule
from forge_lightning.reporting.profiler import PHASES, synchronize
from forge_lightning.rollout.sources import RolloutSource, TrainingBatch, TrainingLoop
from forge_lightning.rollout.types import Rollout

log = logging.getLogger("forge_lightning.bench")  # the bench's own log, as throughput.py writes it


class RecordingRollouts:
    """The module's own rollout source (sync or async), also keeping each rollout it gives the
    module to train (so the references can replay it)."""

    def __init__(self, source: RolloutSource) -> None:
        self.source = source
        self.kept: list[Rollout] = []

    def rollouts(self, batch: TrainingBatch, loop: TrainingLoop, model: Any) -> Iterator[TrainingBatch]:
        for item in self.source.rollouts(batch, loop, model):
            self.kept.append(item.rollout)
            yield item

    def __getattr__(self, name: str) -> Any:  # every other call is the source's
        if name == "source":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.source, name)


class StepTimer(pl.Callback):
    """Times every training step, takes its peak memory, and runs the references after it.

    The references of a timed step are measured right after that step, so on a shared machine
    both sides of each ratio see about the same load. The memory peak is taken inside the steps
    only: the references' own (larger) allocations do not count toward ``peak_rss_mb``.
    """

    def __init__(self, args: argparse.Namespace, with_references: bool) -> None:
        self.args = args
        self.with_references = with_references  # the references after each timed step
        self.steps: list[dict[str, float]] = []
        self.references: list[dict[str, float]] = []
        self.peak_rss_mb = 0.0
        self.peak_gpu_mb: float | None = None
        self._peak_rss = PeakRss()
        self._start = 0.0
        self.phase_peaks: dict[str, float] = {}  # --phase-memory: each phase's peak, timed steps

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._peak_rss.reset()
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        synchronize()
        seconds = time.perf_counter() - self._start
        profiler = trainer.profiler
        if isinstance(profiler, PeakPhaseProfiler):  # the phases reset the high-water mark
            self.peak_rss_mb = max(self.peak_rss_mb, *profiler.peaks.values(), 0.0)
            if any(s["trained"] for s in self.steps):  # the warm-up's peaks are left out
                for phase, peak in profiler.peaks.items():
                    self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0.0), peak)
            profiler.peaks = {}
        else:
            self.peak_rss_mb = max(self.peak_rss_mb, self._peak_rss.peak())
        if pl_module.device.type == "cuda":
            gpu = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
            self.peak_gpu_mb = max(self.peak_gpu_mb or 0.0, gpu)
        records = pl_module.batch_records  # none while an async run fills its pipeline
        phases = {phase: records[-1].phases.get(phase, 0.0) if records else 0.0 for phase in PHASES}
        self.steps.append({"seconds": seconds, "trained": len(records), **phases})
        kept = pl_module.rollout_source.kept
        tokens = int(kept[-1].completion_mask.sum()) if records else 0
        log.info(
            "step %d: %.2f s, %d completion tokens, peak RSS %.0f MB, %s",
            *(len(self.steps) - 1, seconds, tokens, self.peak_rss_mb, rounded(phases)),
        )
        trained = [s for s in self.steps if s["trained"]]
        timed = len(trained) > 1 and records  # the first step that trains is the warm-up
        if timed and self.with_references:
            self.references.append(measure_references(pl_module, kept[-1], self.args))


def measure_references(
    module: GRPOLightningModule, rollout: Rollout, args: argparse.Namespace
) -> dict[str, float]:
    """Seconds of plain generate, and of the straightforward training step, on one rollout."""
    generate = plain_generate_seconds(module.model, module.tokenizer, rollout, args.temperature)
    reference = module.reference.model if module.needs_reference else None
    train = straightforward_update_seconds(module.model, reference, rollout, args)
    log.info("references: generate %.2f s, straightforward %.2f s", generate, generate + train)
    return {"generate": generate, "straightforward": generate + train}


def rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}
