"""A run written by forge_lightning 0.1.0 before the package took its layer folders resumes where
it stopped, and its checkpoint and saved config load: the import paths they hold still lead to the
same classes.

``fixtures/run_0_1_0`` is that run (its ``config.yaml`` says how it was made): two steps of a
randomly initialised 2-layer Llama (``tiny_model/``: config and tokenizer only) on arithmetic
problems, rewarded by a CompositeReward of library rewards, with ``last.ckpt`` after step 2; and
``resumed_step_3.json``, the step-3 record the same version wrote when it resumed that run.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_0_1_0"


def class_paths(node: object) -> list[str]:
    """Every ``class_path`` value in a parsed config, however deep."""
    if isinstance(node, dict):
        found = [node["class_path"]] if isinstance(node.get("class_path"), str) else []
        return found + [p for value in node.values() for p in class_paths(value)]
    if isinstance(node, list):
        return [p for value in node for p in class_paths(value)]
    return []


@pytest.mark.integration
def test_a_run_of_version_0_1_0_resumes_and_trains_its_next_step_as_that_version_did(tmp_path):
    run = shutil.copytree(FIXTURE, tmp_path / "old")
    done = subprocess.run(
        [sys.executable, "-m", "forge_lightning", "fit", "--config", "config.yaml"]
        + ["--ckpt_path", "last", "--trainer.max_steps", "3"],
        cwd=run,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # as the fixture was written
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "run" / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    want = json.loads((FIXTURE / "resumed_step_3.json").read_text())
    assert set(want) <= set(records[-1])
    for key, value in want.items():
        assert records[-1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_the_checkpoint_and_saved_config_of_version_0_1_0_load(monkeypatch):
    from forge_lightning.module import GRPOLightningModule
    from forge_lightning.rewards import CompositeReward, ExactMatchReward, LengthPenaltyReward

    monkeypatch.chdir(FIXTURE)  # the run's model spec is random:tiny_model, relative to it
    checkpoint = FIXTURE / "run" / "checkpoints" / "last.ckpt"
    module = GRPOLightningModule.load_from_checkpoint(checkpoint, map_location="cpu")
    assert type(module.reward) is CompositeReward
    assert [type(part) for part, *_ in module.reward.rewards_and_weights] == [
        ExactMatchReward,
        LengthPenaltyReward,
    ]
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    for name, weights in module.model.state_dict().items():
        torch.testing.assert_close(weights, saved["state_dict"][f"model.{name}"])

    config = yaml.safe_load((FIXTURE / "run" / "tensorboard" / "version_0" / "config.yaml").read_text())
    paths = class_paths(config)
    assert "forge_lightning.checkpoint_io.AtomicCheckpointIO" in paths  # a module that moved
    for path in paths:
        module_name, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module_name), name), path
