"""A full disk: a failed save names its path and says the disk is full; a save with less space
left than the previous one took is warned about first, once."""

from __future__ import annotations

import errno
import shutil
import warnings
from collections import namedtuple

import pytest
import torch

from forge_lightning.callbacks import HFCheckpoint, hf_checkpoint
from forge_lightning.run.checkpoint_io import AtomicCheckpointIO

Usage = namedtuple("Usage", "total used free")


def little_space(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * free, 9 * free, free))


def torch_save_failing_with(monkeypatch, error: Exception) -> None:
    def failing(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"half a checkpoint")
        raise error

    monkeypatch.setattr(torch, "save", failing)


def test_a_torch_stream_error_on_a_full_disk_says_no_space_and_names_the_file(tmp_path, monkeypatch):
    target = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, target)
    torch_save_failing_with(monkeypatch, RuntimeError("basic_ios::clear: iostream error"))
    little_space(monkeypatch, free=4096)
    full = r"could not write .*last.ckpt: No space left.*iostream error.*0.0 MiB free in"
    with pytest.raises(OSError, match=full) as err:
        AtomicCheckpointIO().save_checkpoint({"step": 2}, target)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert torch.load(target)["step"] == 1  # the previous checkpoint is intact, no temp file left
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_a_torch_stream_error_with_space_left_names_the_file_but_not_the_disk(tmp_path, monkeypatch):
    torch_save_failing_with(monkeypatch, RuntimeError("unexpected pos 17024 vs 16918"))
    little_space(monkeypatch, free=1 << 30)
    target = tmp_path / "epoch=0-step=2.ckpt"
    with pytest.raises(RuntimeError, match=r"could not write .*step=2.ckpt: unexpected pos") as err:
        AtomicCheckpointIO().save_checkpoint({"step": 2}, target)
    assert "No space" not in str(err.value)


def test_enospc_says_how_much_space_is_left_where(tmp_path, monkeypatch):
    torch_save_failing_with(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    little_space(monkeypatch, free=3 << 20)
    with pytest.raises(OSError, match=rf"last.ckpt.*No space left on device; 3.0 MiB free in {tmp_path}"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, tmp_path / "last.ckpt")


def test_a_save_with_less_space_left_than_the_previous_took_is_warned_once(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plenty of space: no warning
        io.save_checkpoint({"w": torch.zeros(1000)}, tmp_path / "epoch=0-step=1.ckpt")
    little_space(monkeypatch, free=100)
    with pytest.warns(UserWarning, match=rf"only 0.0 MiB free in {tmp_path}, less than the previous"):
        io.save_checkpoint({"w": torch.zeros(1000)}, tmp_path / "epoch=0-step=2.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        io.save_checkpoint({"w": torch.zeros(1000)}, tmp_path / "epoch=0-step=3.ckpt")


@pytest.mark.integration
def test_hf_folders_warn_before_a_save_with_too_little_space_and_name_a_full_disk(
    tmp_path, module, trainer, loader, count_a, monkeypatch
):
    little_space(monkeypatch, free=1000)  # less than any HF folder
    fit = trainer(tmp_path, callbacks=[HFCheckpoint(save_steps=1)], max_steps=2)
    low = rf"only 0.0 MiB free in {tmp_path}, less than the previous HF checkpoint folder took"
    with pytest.warns(UserWarning, match=low) as seen:
        fit.fit(module(reward=count_a), loader([{"prompt": "q"}] * 2))
    assert len([w for w in seen if "MiB free" in str(w.message)]) == 1  # before 2/, not again for final/

    def full_disk(*args) -> str:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 17024 vs 16918")

    monkeypatch.setattr(hf_checkpoint, "model_card", full_disk)  # written last into each folder
    fit = trainer(tmp_path / "full", callbacks=[HFCheckpoint(save_steps=1)], max_steps=1)
    with pytest.raises(OSError, match=r"could not write .*full/1: No space left on device.*unexpected pos"):
        fit.fit(module(reward=count_a), loader([{"prompt": "q"}]))
    assert not (tmp_path / "full" / "1").exists()
