"""KillPoint: the moment $FORGE_KILL_POINT names, found from the hooks Lightning calls (driven here
by hand, with the SIGKILL recorded instead of sent)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import forge_lightning.callbacks.kill_point as kill_point
import forge_lightning.run.checkpoint_io as checkpoint_io
import forge_lightning.run.fileio as fileio
from forge_lightning.callbacks import KillPoint
from forge_lightning.callbacks.kill_point import KILL_POINT_ENV, KillPointSpec


@pytest.fixture
def armed(monkeypatch):
    """``armed(spec)``: a KillPoint under ``$FORGE_KILL_POINT=spec``, the fake trainer it sees, and
    the global steps at which it would have SIGKILLed the process (recorded instead)."""

    def make(spec: str | None) -> tuple[KillPoint, SimpleNamespace, list[int]]:
        if spec is None:
            monkeypatch.delenv(KILL_POINT_ENV, raising=False)
        else:
            monkeypatch.setenv(KILL_POINT_ENV, spec)
        trainer, deaths = SimpleNamespace(global_step=0), []
        monkeypatch.setattr(kill_point, "_die", lambda: deaths.append(trainer.global_step))
        return KillPoint(), trainer, deaths

    return make


def batches(callback: KillPoint, trainer: SimpleNamespace, steps: int, per_step: int) -> None:
    """Run ``steps`` optimizer steps of ``per_step`` batches through the hooks, each batch one backward."""
    for _ in range(steps):
        for batch in range(1, per_step + 1):
            callback.on_train_batch_start(trainer, None, None, 0)
            callback.on_after_backward(trainer, None)
            if batch == per_step:
                trainer.global_step += 1
            callback.on_train_batch_end(trainer, None, None, None, 0)


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("backward@2/2", KillPointSpec("backward", 2, "2")),
        ("batch_end@3", KillPointSpec("batch_end", 3)),
        ("write@2/last.ckpt", KillPointSpec("write", 2, "last.ckpt")),
    ],
)
def test_a_kill_point_reads_back_as_it_is_written(text, spec):
    assert KillPointSpec.parse(text) == spec
    assert str(spec) == text


@pytest.mark.parametrize("text", ["backward", "sleep@2", "backward@0", "backward@2/x", "write@2"])
def test_a_malformed_kill_point_is_refused_by_name(text):
    with pytest.raises(ValueError, match=KILL_POINT_ENV):
        KillPointSpec.parse(text)


def test_without_the_variable_it_never_kills(armed):
    callback, trainer, deaths = armed(None)
    batches(callback, trainer, steps=3, per_step=2)
    assert deaths == []


@pytest.mark.parametrize(("spec", "per_step"), [("backward@2/2", 2), ("backward@2", 1)])
def test_backward_kills_inside_the_named_batch_of_the_step_before_it_steps(armed, spec, per_step):
    callback, trainer, deaths = armed(spec)
    batches(callback, trainer, steps=3, per_step=per_step)
    assert deaths == [1]  # once, in step 2 (global step 1: step 1 taken, step 2 not yet)


def test_batch_end_kills_as_the_batch_that_ends_the_step_ends(armed):
    callback, trainer, deaths = armed("batch_end@2")
    batches(callback, trainer, steps=1, per_step=2)
    assert deaths == []
    batches(callback, trainer, steps=1, per_step=2)
    assert deaths == [2]


def test_write_kills_after_the_named_file_is_staged_before_it_is_renamed(armed, monkeypatch, tmp_path):
    original = fileio.write_atomically
    callback, trainer, deaths = armed("write@2/last.ckpt")
    target = tmp_path / "last.ckpt"

    def die() -> None:  # what the folder holds at that moment
        staged = [p.read_text() for p in tmp_path.glob(".last.ckpt.tmp-*")]
        deaths.append((trainer.global_step, target.read_text(), staged))

    monkeypatch.setattr(kill_point, "_die", die)
    callback.setup(trainer, None, "fit")
    for step in (1, 2):
        trainer.global_step = step
        checkpoint_io.write_atomically(target, lambda staging: Path(staging).write_text(f"step {step}"))
        fileio.write_atomically(tmp_path / "other.ckpt", lambda staging: Path(staging).write_text("x"))
    assert deaths == [(2, "step 1", ["step 2"])]  # step 2's whole, beside step 1's still in place
    callback.teardown(trainer, None, "fit")
    assert fileio.write_atomically is original and checkpoint_io.write_atomically is original
