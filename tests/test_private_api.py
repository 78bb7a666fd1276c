"""The private attributes of other libraries the package relies on, one each where the library
offers no public way (see the function named in each test): these fail the day a library moves
one, rather than the feature silently stopping. Checked on lightning 2.4.0 / 2.6.6, jsonargparse
4.40.0 / 4.53.0, torch 2.13, transformers 4.56.0 / 5.24.0, datasets 2.19.0 / 5.2.0."""

import argparse
import inspect
import warnings
from datetime import timedelta

import datasets
import pytest
import torch
from helpers.models import make_model
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.cli import LightningCLI

from forge_lightning.callbacks.preemption import hide_sigterm
from forge_lightning.callbacks.step_boundary import mark_saved
from forge_lightning.callbacks.trainer_view import max_time_set
from forge_lightning.cli.forge_cli import ForgeCLI
from forge_lightning.cli.parser_internals import option, parse_unvalidated, parts, read_as_string
from forge_lightning.data.datamodule import fingerprint
from forge_lightning.run.fit import FitShape
from forge_lightning.training.optim import set_last_lr, total_optimizer_steps


@pytest.mark.integration
def test_a_sigterm_can_be_hidden_from_the_trainer(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    trainer._signal_connector.received_sigterm = True  # what Lightning's handler sets
    assert trainer.received_sigterm
    hide_sigterm(trainer)
    assert not trainer.received_sigterm


def test_a_model_checkpoint_can_be_told_a_step_is_saved(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path)
    assert mark_saved(callback, 5)
    assert callback._last_global_step_saved == 5


def test_lightning_cli_still_builds_subcommand_parsers_through_the_overridden_method():
    assert "_prepare_subcommand_parser" in vars(LightningCLI)
    ours = inspect.signature(ForgeCLI._prepare_subcommand_parser).parameters
    assert list(inspect.signature(LightningCLI._prepare_subcommand_parser).parameters) == list(ours)


def test_jsonargparse_still_orders_a_unions_types_for_a_value_in_one_function():
    # nested_flags_keep_single_values (cli/parser_internals.py) wraps it while the CLI parses.
    from jsonargparse import _typehints

    parameters = inspect.signature(_typehints.sort_subtypes_for_union).parameters
    assert list(parameters) == ["subtypes", "val", "prev_val", "append"]
    assert all(hasattr(_typehints, n) for n in ("NestedArg", "sequence_origin_types", "get_typehint_origin"))


def test_jsonargparse_options_can_be_found_retyped_and_parsed_unvalidated(tmp_path):
    parser = ArgumentParser()
    parser.add_argument("--model", type=str | dict | None, default=None)
    parser.add_argument("--n", type=int, default=0)
    spec = option(parser, "--model")
    assert spec is not None and spec.dest == "model"
    assert read_as_string(spec) and spec._typehint is str
    written = tmp_path / "x.gguf"
    written.write_text("a: 1\n")  # YAML text jsonargparse would read as a dict if the path were on
    config = parse_unvalidated(parser, ["--model", str(written), "--n", "3"])
    assert config.model == str(written) and config.n == 3
    actions, groups = parts(parser)
    assert spec in actions and all(isinstance(a, argparse.Action) for a in actions)
    assert groups and all(hasattr(g, "title") for g in groups)


def test_a_scheduler_reports_the_rates_it_is_given():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_a_dataset_has_a_fingerprint_of_its_rows():
    one, other = datasets.Dataset.from_dict({"a": [1]}), datasets.Dataset.from_dict({"a": [2]})
    assert isinstance(fingerprint(one), str) and fingerprint(one) != fingerprint(other)


def test_a_transformers_model_lists_its_block_classes():
    assert "LlamaDecoderLayer" in set(make_model(16)._no_split_modules)


@pytest.mark.parametrize(("duration", "warns"), [(timedelta(minutes=5), True), (None, False)])
def test_a_timer_with_a_duration_and_no_max_steps_warns_about_the_schedule(duration, warns):
    """Read through the Timer's public ``time_remaining()`` (None exactly without a duration)."""
    fit = FitShape(
        max_epochs=1, stepping_batches=lambda: 4, max_time_set=max_time_set([Timer(duration=duration)])
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert total_optimizer_steps(fit, 1, 1) == 4
    assert any("max_time" in str(w.message) for w in seen) == warns


@pytest.mark.integration
def test_an_evaluation_logs_outside_a_fit_at_the_count_of_stepped_batches(tmp_path):
    from forge_lightning.callbacks.step_axis import EvaluationLogStep

    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 0
    step = EvaluationLogStep()
    step.set(trainer, 7)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 7
    step.restore(trainer)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 0


def test_lightning_takes_the_hyperparameters_given_and_says_when_its_cli_gives_them():
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    from forge_lightning.settings.signature import given_by_cli, given_hyperparameters

    assert not given_by_cli()
    with _given_hyperparameters_context({"group_size": 4}, "forge_lightning.module.GRPOLightningModule"):
        assert given_by_cli()
    module = LightningModule()
    with given_hyperparameters({"group_size": 3}):
        module.save_hyperparameters()
    assert dict(module.hparams) == {"group_size": 3}
