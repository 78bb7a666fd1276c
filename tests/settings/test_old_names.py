"""A setting's former name (settings/declare.py ``OldName``): ``behav_imp_weight_cap``, the async
worker's cap before ``rollout_correction_cap`` became the one cap of the correction weight, is still
taken as a keyword, a flag, a config's key and a checkpoint's, and gives the loss the cap it gave."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from forge_lightning.grpo import LossSettings
from forge_lightning.module import GRPOLightningModule
from forge_lightning.run.resume import check_resume_settings
from forge_lightning.settings.declare import Group, OldName, count, setting
from forge_lightning.settings.groups import (
    CHANGEABLE_ON_RESUME,
    DECLARED,
    GRPOSettings,
    current_names,
    setting_help,
)
from forge_lightning.settings.signature import given_hyperparameters, setting_parameters

OLD_CHECKPOINT = Path(__file__).resolve().parents[1] / "run" / "fixtures" / "run_0_1_0"
# What every config and checkpoint held before the one cap: each name at its default.
OLD_PAIR = {"behav_imp_weight_cap": 5.0, "rollout_correction_cap": 3.0}
GIVEN_TWICE = (
    r"^behav_imp_weight_cap=4.0 and rollout_correction_cap=2.0 are one setting given twice: give "
    r"rollout_correction_cap alone \(behav_imp_weight_cap is its former name\)$"
)


@dataclass(frozen=True)
class PolishSettings(Group):
    """A group a test declares, whose one setting had another name."""

    polish_rounds: int = setting(3, check=count(1))
    """rounds of polish each completion gets (a synthetic setting)."""

    old_names = (OldName("shine_rounds", "polish_rounds", old_defaults=(("shine_rounds", 2),)),)


@contextlib.contextmanager
def no_warning() -> Iterator[None]:
    """A warning in the block fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_any_groups_former_name_is_a_keyword_with_help_read_as_its_setting():
    declared = {**DECLARED, "polish": PolishSettings}
    [old] = [p for p in setting_parameters(declared) if p.name == "shine_rounds"]
    assert (old.default, old.annotation) == (3, int)  # the setting's
    assert setting_help(declared)["shine_rounds"] == (
        "deprecated: the former name of ``polish_rounds``, which it sets."
    )
    with pytest.warns(DeprecationWarning, match="^shine_rounds is deprecated: use polish_rounds$"):
        assert current_names({"shine_rounds": 5}, declared) == {"polish_rounds": 5}
    with no_warning():
        assert current_names({"shine_rounds": 2}, declared) == {"polish_rounds": 3}  # its old default


def test_the_former_name_sets_the_one_cap_with_a_warning_naming_it(module):
    with pytest.warns(
        DeprecationWarning, match="^behav_imp_weight_cap is deprecated: use rollout_correction_cap$"
    ):
        grpo = module(behav_imp_weight_cap=4.0)
    assert grpo.hparams["rollout_correction_cap"] == 4.0
    assert "behav_imp_weight_cap" not in grpo.hparams  # saved as the setting it became
    assert grpo.settings.loss.behav_imp_weight_cap == 4.0
    with pytest.warns(DeprecationWarning):
        assert module(behav_imp_weight_cap=None).settings.loss.behav_imp_weight_cap is None  # no cap


def test_the_former_name_and_the_setting_given_differently_is_a_one_line_error(module):
    with pytest.raises(ValueError, match=GIVEN_TWICE):
        module(behav_imp_weight_cap=4.0, rollout_correction_cap=2.0)
    with pytest.warns(DeprecationWarning):
        assert (
            module(behav_imp_weight_cap=4.0, rollout_correction_cap=4.0).hparams["rollout_correction_cap"]
            == 4.0
        )


def test_the_former_name_is_a_flag_of_the_settings_type():
    parser = ArgumentParser()
    parser.add_class_arguments(GRPOLightningModule, "model")
    assert parser.parse_args(["--model.behav_imp_weight_cap", "4"]).model.behav_imp_weight_cap == 4.0
    assert parser.parse_args([]).model.behav_imp_weight_cap == "auto"
    help_text = " ".join(parser.format_help().split())
    assert "deprecated: the former name of ``rollout_correction_cap``, which it sets." in help_text


def test_the_former_name_given_by_lightning_cli_is_saved_as_the_setting(module):
    objects = {"model": module().model, "tokenizer": module().tokenizer}
    given = {
        "behav_imp_weight_cap": 4.0,
        "rollout_correction_cap": "auto",
        "group_size": 4,
        "max_new_tokens": 8,
    }
    with given_hyperparameters({**given, "reward": None}), pytest.warns(DeprecationWarning):
        grpo = GRPOLightningModule(**objects, **given)
    assert grpo.hparams["rollout_correction_cap"] == 4.0 and "behav_imp_weight_cap" not in grpo.hparams


@pytest.mark.parametrize(
    ("given", "cap"),
    [
        ({}, 5.0),  # the default correction of a rollout sampled by older weights (async): AReaL's
        ({"rollout_mode": "async", "max_staleness": 1}, 5.0),
        ({"rollout_correction": "mask"}, 3.0),  # a named correction: TRL's
        ({"rollout_correction": "truncate", "rollout_correction_level": "sequence"}, 3.0),
        ({"rollout_correction": "mask", "rollout_correction_cap": 2.0}, 2.0),
        ({"rollout_mode": "async", "rollout_correction_cap": 8.0}, 8.0),
        ({"rollout_correction_cap": None}, None),
    ],
)
def test_each_modes_loss_is_the_one_it_was(module, given, cap):
    named = {k: given[k] for k in ("rollout_correction", "rollout_correction_level") if k in given}
    want = replace(LossSettings(max_completion_length=8), behav_imp_weight_cap=cap, **named)
    with no_warning():
        assert module(**given).settings.loss == want


@pytest.mark.parametrize(
    ("mode", "cap"), [({}, 5.0), ({"rollout_mode": "async"}, 5.0), ({"rollout_correction": "mask"}, 3.0)]
)
def test_an_old_checkpoints_pair_of_caps_at_their_defaults_is_the_modes_cap(mode, cap):
    with no_warning():
        settings = GRPOSettings.from_hparams({**OLD_PAIR, **mode})
    assert settings.off_policy.rollout_correction_cap == "auto"
    assert settings.loss.behav_imp_weight_cap == cap


@pytest.mark.parametrize(
    ("old", "cap"),
    [
        ({"behav_imp_weight_cap": 4.0, "rollout_correction_cap": 3.0, "rollout_mode": "async"}, 4.0),
        ({"behav_imp_weight_cap": None, "rollout_correction_cap": 3.0}, None),
        ({"behav_imp_weight_cap": 5.0, "rollout_correction_cap": 2.0, "rollout_correction": "truncate"}, 2.0),
    ],
)
def test_an_old_checkpoints_changed_cap_is_the_one_its_run_had(old, cap):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert GRPOSettings.from_hparams(old).loss.behav_imp_weight_cap == cap


def test_an_old_checkpoints_hparams_resume_under_the_one_cap(module):
    grpo = module()
    old = {**grpo.hparams, **OLD_PAIR}
    with no_warning():
        check_resume_settings(current_names(old), grpo.hparams, changeable=CHANGEABLE_ON_RESUME)
    with pytest.raises(ValueError, match=r"model.rollout_correction_cap: 3.0 -> 'auto'"):
        check_resume_settings(old, grpo.hparams, changeable=CHANGEABLE_ON_RESUME)  # without the renaming


def test_a_checkpoint_of_version_0_1_0_loads_with_its_cap(monkeypatch):
    monkeypatch.chdir(OLD_CHECKPOINT)  # its model spec is random:tiny_model, relative to it
    grpo = GRPOLightningModule.load_from_checkpoint(OLD_CHECKPOINT / "run" / "checkpoints" / "last.ckpt")
    assert grpo.hparams["rollout_correction_cap"] == "auto" and "behav_imp_weight_cap" not in grpo.hparams
    assert grpo.settings.loss.behav_imp_weight_cap == 5.0


def test_the_async_caps_old_constant_still_imports():
    from forge_lightning.settings import groups
    from forge_lightning.settings.groups import training

    for where in (groups, training):
        with pytest.warns(DeprecationWarning, match="DEFAULT_BEHAV_IMP_WEIGHT_CAP is now ASYNC_CAP"):
            assert where.DEFAULT_BEHAV_IMP_WEIGHT_CAP == 5.0
