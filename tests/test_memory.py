"""Freed CPU memory handed back to the OS after each rollout."""

from __future__ import annotations

import sys

import pytest

from forge_lightning import memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is Linux-only")
def test_trim_finds_glibc_malloc_trim_on_linux():
    assert memory.release_freed_memory() is True


def test_trim_is_a_no_op_off_linux(monkeypatch):
    memory._malloc_trim.cache_clear()
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    try:
        assert memory.release_freed_memory() is False
    finally:
        memory._malloc_trim.cache_clear()


def test_training_step_trims_once_per_rollout_on_cpu(monkeypatch, tmp_path):
    from test_module import loader, module, trainer

    calls = []
    monkeypatch.setattr("forge_lightning.module.release_freed_memory", lambda: calls.append(1) or True)
    fit = trainer(tmp_path, max_steps=3)
    fit.fit(module(kl_beta=0.0), loader([{"prompt": f"q{i}"} for i in range(3)]))
    assert len(calls) == 3
