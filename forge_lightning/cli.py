"""``forge-lightning`` / ``python -m forge_lightning``: LightningCLI over the module and datamodule."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from forge_lightning.data.datamodule import GSM8KDataModule
from forge_lightning.module import GRPOLightningModule


class ForgeCLI(LightningCLI):
    """LightningCLI with the defaults a GRPO run wants, and a strict ``--ckpt_path last``."""

    @override
    def before_fit(self) -> None:
        if self._get(self.config, "ckpt_path") == "last":
            _require_last_checkpoint(self.trainer.checkpoint_callbacks)

    def before_validate(self) -> None:
        # The shipped configs validate nothing during fit (limit_val_batches: 0); evaluating a
        # checkpoint with them would otherwise end at once with no metric and no complaint.
        if self.trainer.limit_val_batches == 0:
            raise SystemExit(
                "validate: trainer.limit_val_batches is 0 in this config, so nothing would be evaluated; "
                "pass --trainer.limit_val_batches 1.0 for the whole validation split (or a batch count)"
            )

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with every folder of the run derived from ``trainer.default_root_dir``
        where the config leaves it unset: TensorBoard logs in ``<root>/tensorboard/`` and
        Lightning checkpoints in ``<root>/checkpoints/`` (the callbacks already write to the root)."""
        # Added here rather than in trainer_defaults: a default progress-bar callback would clash
        # with --trainer.enable_progress_bar=false and with a bar the config brings itself.
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        wanted = config.get("enable_progress_bar") is not False
        if wanted and "callbacks" not in kwargs and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, default_progress_bar()]
        root = Path(config.get("default_root_dir") or Path.cwd())
        if config.get("logger") in (None, True) and "logger" not in kwargs:
            kwargs["logger"] = TensorBoardLogger(save_dir=str(root), name="tensorboard")
        trainer = super().instantiate_trainer(**kwargs)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(root / "checkpoints")
        return trainer


def default_progress_bar() -> ProgressBar:
    """Rich's progress bar (reward and kl beside it) when ``rich`` imports, else Lightning's TQDM one."""
    try:
        return RichProgressBar()
    except ModuleNotFoundError:
        return TQDMProgressBar()


def _require_last_checkpoint(callbacks: list[Any]) -> None:
    """Stock Lightning starts from scratch, with only a warning, when ``last`` finds nothing;
    a resume that silently restarts would throw the run away, so it is an error here."""
    folders = [Path(cb.dirpath) for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not folders:
        raise SystemExit(
            "--ckpt_path last needs a ModelCheckpoint callback (trainer.callbacks) with save_last, so "
            "the checkpoint can be found again"
        )
    if not any((folder / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt").is_file() for folder in folders):
        raise SystemExit(
            f"--ckpt_path last: no last.ckpt in {', '.join(map(str, folders))}. Nothing to resume; "
            "run without --ckpt_path to start a new run"
        )


def build_cli(args: list[str] | None = None, run: bool = True) -> ForgeCLI:
    """Build (and by default run) the CLI; ``args`` as on the command line (None reads ``sys.argv``)."""
    # The module logs its metrics once per optimizer step, so every batch may flush them; the
    # sanity check would spend a full greedy generation before the first step. Checkpoints are
    # written atomically; the PhaseProfiler times each step's phases (the perf/* metrics).
    trainer_defaults: dict[str, Any] = {
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "plugins": [{"class_path": "forge_lightning.checkpoint_io.AtomicCheckpointIO"}],
        "profiler": {"class_path": "forge_lightning.profiler.PhaseProfiler"},
    }
    return ForgeCLI(
        GRPOLightningModule,
        GSM8KDataModule,
        trainer_defaults=trainer_defaults,
        # The saved config.yaml is the record of what ran; a resumed run in the same folder
        # writes the same file again instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        # The module owns its optimizer and warmup-cosine schedule (configure_optimizers).
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: ``plot`` draws a run's curves, anything else goes to LightningCLI."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["plot"]:
        from forge_lightning.plot import main as plot_main  # matplotlib only when plotting

        plot_main(args[1:])
    else:
        build_cli(argv)


if __name__ == "__main__":
    main()
