"""Console, JSONL and Lightning-logger reporting of the training metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from forge_lightning.callbacks._paths import output_dir
from forge_lightning.callbacks.hf_checkpoint import HFCheckpoint
from forge_lightning.callbacks.protocols import KeepsValidationSamples, ReportsSteps
from forge_lightning.evaluation.ranks import gathered_answers
from forge_lightning.run.fileio import append_jsonl, read_jsonl, write_atomically
from forge_lightning.settings.checks import check_setting

if TYPE_CHECKING:
    from forge_lightning.reporting.metrics import StepRecord

# The JSONL line carries these (plus one ``rewards/<name>`` per reward component); the Lightning
# logger gets every metric the module tracks.
JSONL_KEYS = (
    "loss",
    "reward",
    "reward_std",
    "kl",
    "clip_fraction",
    "completion_length",
    "truncated_fraction",
    "sampling_rounds",
    "groups_dropped",
    "groups_filtered",  # groups a loop hook dropped (a curriculum), where a callback may
    "entropy",
    "reward_errors",  # samples whose reward failed (scored 0 where the run says so)
    "num_tokens",
    "lr",
    "grad_norm",
)
# Logged with asynchronous rollouts only.
ASYNC_JSONL_KEYS = (
    "staleness",
    "staleness_max",
    "regenerated",
    "rollout_wait_s",
)
# Logged where the sampler's log-probs correct the loss (the rollout correction, async rollouts).
CORRECTION_JSONL_KEYS = ("sampler_kl", "correction_weight_mean", "correction_masked_fraction")
# Logged with tool-using rollouts only (rollout/tool_sampler.py).
TOOL_JSONL_KEYS = ("tool_calls", "tool_errors", "turns", "tool_token_fraction", "tool_threads_abandoned")
# Logged with rollout servers only (serving/): the servers found dead, summed over the ranks.
SERVER_JSONL_KEYS = ("server_failures",)
JSONL_KEYS += ASYNC_JSONL_KEYS + CORRECTION_JSONL_KEYS + TOOL_JSONL_KEYS + SERVER_JSONL_KEYS


class RewardLogger(Callback):
    """Every ``logging_steps`` optimizer steps: a console line, a JSONL record, a reward histogram
    and a table of sample completions.

    ``logging_steps`` is the run's one cadence (handed to the module at fit start,
    ``report_every``): the module sends its scalars to every Lightning logger at the same steps,
    with the same values (each mean's mean over the optimizer steps since the previous report,
    each count's total, and ``num_tokens``, a running total, as it stands).
    This callback adds what a logger's scalars do not:
    ``{output_dir}/training_log.jsonl``, one record per report with those values under their short
    names, and, for a TensorBoard or W&B logger, ``train/reward_hist`` and
    ``train/completion_length_hist`` (every reward and completion length since the previous
    report, rank zero's) and the samples table. On a resumed fit,
    records past the restored step are dropped first so the log never repeats or goes backwards.
    After each validation it writes rank zero's answers (prompt, completion, reference, reward,
    correct, length, truncated; with sampled validation, the prompt's ``samples``) to
    ``{output_dir}/validation/``: ``step-{global_step}.jsonl`` in a
    fit; for a ``validate``, ``validate-step-{step}-{model}.jsonl``, named for the checkpoint
    evaluated (its step and file name) or else the model spec (and no step), with ``-2``, ``-3``,
    ... added rather than overwrite an earlier one; and prints the accuracy. Under
    ``fast_dev_run`` it writes no file, as Lightning's ModelCheckpoint. When training ends it
    prints a summary: the reward at the first and last reports (and the means of the first and
    last two), and where the log, checkpoints and TensorBoard files are.

    Args:
        output_dir: run folder; ``trainer.default_root_dir`` when None.
        logging_steps: optimizer steps between reports.
        num_text_samples: prompt/completion/reward rows sent to TensorBoard as text each report.
    """

    def __init__(
        self, output_dir: str | None = None, logging_steps: int = 10, num_text_samples: int = 4
    ) -> None:
        check_setting("logging_steps", logging_steps)
        self.output_dir = output_dir
        self.logging_steps = logging_steps
        self.num_text_samples = num_text_samples
        self._last_step = -1
        self._rewards: list[torch.Tensor] = []
        self._lengths: list[torch.Tensor] = []

    def log_path(self, trainer: pl.Trainer) -> Path:
        return output_dir(trainer, self.output_dir) / "training_log.jsonl"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The data goes one way (as ReferenceModel's): the module reports at this cadence.
        if isinstance(pl_module, ReportsSteps):
            pl_module.report_every(self.logging_steps)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_fit_start: the restored global_step is only known once training state is loaded.
        self._last_step = trainer.global_step
        self._rewards, self._lengths = [], []
        path = self.log_path(trainer)
        if trainer.is_global_zero and not trainer.fast_dev_run:
            path.parent.mkdir(parents=True, exist_ok=True)
            if trainer.ckpt_path is not None and path.exists():
                _truncate_after(path, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        # The batch's records: one, or none (an async batch filling the pipeline), or several (an
        # async batch at an epoch's end, which trains every rollout still in flight).
        for record in pl_module.batch_records if isinstance(pl_module, ReportsSteps) else []:
            self._take(trainer, record)

    def _take(self, trainer: pl.Trainer, record: StepRecord) -> None:
        if record.rewards.numel():
            self._rewards.append(record.rewards)
            self._lengths.append(record.completion_lengths)
        step = record.step
        if step == self._last_step or not record.report:  # the module reports every logging_steps
            return
        self._last_step = step
        rewards, self._rewards = self._rewards, []
        lengths, self._lengths = self._lengths, []
        if not trainer.is_global_zero:
            return
        line: dict[str, Any] = {"step": step, "epoch": trainer.current_epoch}
        line.update(_short_names(record.report))
        if not trainer.fast_dev_run:
            append_jsonl(self.log_path(trainer), line)
        print(_console_line(line), flush=True)
        # What a scalar cannot show, for the loggers that can show it: the spread of the rewards
        # and completion lengths since the previous report, and what the completions look like.
        hists = (torch.cat(rewards).cpu(), torch.cat(lengths)) if rewards else None
        samples = record.samples[: self.num_text_samples]
        table = _sample_table(samples, record.sample_components[: len(samples)])
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                _tensorboard_views(logger, hists, table, step)
            elif isinstance(logger, WandbLogger):
                _wandb_views(logger, hists, table, step)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not isinstance(pl_module, KeepsValidationSamples):
            return
        samples = gathered_answers(pl_module.validation_samples)  # every rank's, on rank 0
        if not trainer.is_global_zero or not samples:
            return
        # Outside fit Lightning restores no global_step: the module knows the checkpoint's.
        step = pl_module.evaluated_step
        scored = [s["correct"] for s in samples if "correct" in s]
        result = (
            f"accuracy {sum(scored) / len(scored):.4f} on {len(scored)} problems" if scored else "answers"
        )
        what, path = _validation_file(trainer, pl_module, output_dir(trainer, self.output_dir), step)
        if trainer.fast_dev_run:
            print(f"validation {what} | {result} (fast_dev_run: not written)", flush=True)
            return
        text = "".join(json.dumps(sample) + "\n" for sample in samples)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        print(f"validation {what} | {result} -> {path}", flush=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.fast_dev_run and not trainer.interrupted:
            path = self.log_path(trainer)
            if path.is_file():
                print(run_summary(trainer, [r for _, r in read_jsonl(path)], path), flush=True)


Histograms = tuple[torch.Tensor, torch.Tensor] | None  # (rewards, completion lengths) of a report
SampleTable = tuple[list[str], list[list[Any]]]  # columns and rows


def _tensorboard_views(logger: TensorBoardLogger, hists: Histograms, table: SampleTable, step: int) -> None:
    if hists is not None:
        logger.experiment.add_histogram("train/reward_hist", hists[0], global_step=step)
        logger.experiment.add_histogram("train/completion_length_hist", hists[1], global_step=step)
    if table[1]:
        logger.experiment.add_text("samples", _markdown(*table), global_step=step)


def _wandb_views(logger: WandbLogger, hists: Histograms, table: SampleTable, step: int) -> None:
    import wandb

    if hists is not None:
        logger.log_metrics(
            {
                "train/reward_hist": wandb.Histogram(hists[0].numpy()),
                "train/completion_length_hist": wandb.Histogram(hists[1].numpy()),
            },
            step=step,
        )
    if table[1]:
        logger.log_table("samples", columns=table[0], data=table[1], step=step)


def run_summary(trainer: pl.Trainer, records: list[dict[str, Any]], log: Path) -> str:
    """What a run did and where its outputs are, for the end of ``fit``."""
    rewards = [(r["step"], r["reward"]) for r in records if r.get("reward") is not None]
    lines = [f"Training finished at step {trainer.global_step}."]
    if rewards:
        (first_step, first), (last_step, last) = rewards[0], rewards[-1]
        lines.append(f"  reward       {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
        if len(rewards) >= 4:
            head = sum(v for _, v in rewards[:2]) / 2
            tail = sum(v for _, v in rewards[-2:]) / 2
            lines.append(f"               mean of the first two reports {head:.3f} -> last two {tail:.3f}")
    lines.append(f"  log          {log}")
    for callback in trainer.checkpoint_callbacks:
        folder = getattr(callback, "dirpath", None)
        if folder:
            lines.append(f"  checkpoints  {folder}  ({resume_hint(callback)})")
    for callback in trainer.callbacks:
        if isinstance(callback, HFCheckpoint) and callback.save_final:
            final = output_dir(trainer, callback.output_dir) / "final"
            lines.append(f"  model        {final}  (transformers' from_pretrained, or --model.model)")
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            lines.append(f"  tensorboard  tensorboard --logdir {Path(logger.save_dir) / (logger.name or '')}")
    return "\n".join(lines)


def resume_hint(callback: Checkpoint) -> str:
    """How to resume from what the ModelCheckpoint ``callback`` wrote: ``--ckpt_path last`` finds
    only a ``last.ckpt``, which it writes with ``save_last`` (the CLI's does); without one, the
    checkpoint it kept, by its path (Lightning's default ModelCheckpoint keeps the newest)."""
    last = getattr(callback, "last_model_path", "")
    if last and Path(last).is_file():
        return "resume with --ckpt_path last"
    kept = getattr(callback, "best_model_path", "")
    if not kept or not Path(kept).is_file():
        return "none written"
    which = "newest" if getattr(callback, "monitor", None) is None else "best"
    return (
        f"resume from the {which} with ckpt_path={kept}; there is no last.ckpt for ckpt_path 'last' "
        "unless ModelCheckpoint(save_last=True)"
    )


def _short_names(report: dict[str, float]) -> dict[str, float]:
    """A report's JSONL keys, under their short names."""
    out: dict[str, float] = {}
    for logged, value in report.items():
        key = logged.split("/", 1)[1]
        if key in JSONL_KEYS or key.startswith("rewards/"):
            out[key] = value
    return out


def _console_line(record: dict[str, Any]) -> str:
    def fmt(key: str) -> str:
        value = record.get(key)
        return "n/a" if value is None else f"{value:.4f}"

    return (
        f"step {record['step']} | epoch {record['epoch']} | loss {fmt('loss')} | "
        f"reward {fmt('reward')} | kl {fmt('kl')}"
    )


def _sample_table(samples: list[tuple[str, str, float]], components: list[dict[str, float]]) -> SampleTable:
    """Columns and rows of the samples table: prompt, completion, reward, and each reward
    component's score when there are several."""
    names = list(components[0]) if components and len(components[0]) > 1 else []
    rows = [[p, c, r, *(components[i][n] for n in names)] for i, (p, c, r) in enumerate(samples)]
    return ["prompt", "completion", "reward", *names], rows


def _markdown(columns: list[str], rows: list[list[Any]]) -> str:
    """The samples table as markdown (TensorBoard's text view): long prompts keep their end."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for prompt, completion, *scores in rows:
        values = [cell(prompt[-300:]), cell(completion), *(f"{v:.3f}" for v in scores)]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def _markdown_table(samples: list[tuple[str, str, float]], components: list[dict[str, float]]) -> str:
    """Prompt, completion, reward, and each reward component's score when there are several."""
    return _markdown(*_sample_table(samples, components))


def _validation_file(
    trainer: pl.Trainer, pl_module: pl.LightningModule, root: Path, step: int | None
) -> tuple[str, Path]:
    """What a validation evaluated (for its print line) and the file for its answers: in a fit
    ``step-{step}.jsonl``; in a ``validate``, ``validate-step-{step}-{model}.jsonl``, the model
    being the checkpoint's file name or a model spec's last two path parts (``runs/smoke/final``:
    ``smoke-final``), with no step for weights of no known step. Never an existing file's name
    (``-2``, ``-3``, ... added): in a fit, ``val_check_interval`` counts batches, so under
    accumulation two validations may fall inside one optimizer step (the same weights)."""
    folder = root / "validation"
    if trainer.state.fn == TrainerFn.FITTING:
        return f"at step {step}", _new_path(folder, f"step-{step}")
    spec = _model_spec(pl_module)
    if trainer.ckpt_path:
        model = Path(trainer.ckpt_path).stem
    else:
        model = "-".join(p for p in Path(spec or "model").parts[-2:] if p.strip("/"))
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", model)
    name = f"validate-{model}" if step is None else f"validate-step-{step}-{model}"
    what = f"of {trainer.ckpt_path or spec or 'the model'}" + ("" if step is None else f" at step {step}")
    return what, _new_path(folder, name)


def _model_spec(pl_module: pl.LightningModule) -> str | None:
    spec = pl_module.hparams.get("model")
    return spec if isinstance(spec, str) else None


def _new_path(folder: Path, name: str) -> Path:
    """``folder/name.jsonl``, or ``name-2.jsonl``, ``name-3.jsonl``, ...: the first not taken."""
    path, n = folder / f"{name}.jsonl", 1
    while path.exists():
        n += 1
        path = folder / f"{name}-{n}.jsonl"
    return path


def _truncate_after(path: Path, step: int) -> None:
    """Drop records whose step is past ``step`` (written after the checkpoint we resume from)."""
    kept = [line for line, record in read_jsonl(path) if record.get("step", 0) <= step]
    write_atomically(path, lambda tmp: tmp.write_text("".join(kept), encoding="utf-8"))
