"""first_difference: two run folders written by hand, alike or apart in one value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from forge_lightning.run.run_diff import first_difference

RECORDS = [
    {"step": 1, "loss": 0.5, "reward": 0.25, "rollout_wait_s": 0.1},
    {"step": 2, "loss": -0.125, "reward": 0.5, "rollout_wait_s": 0.2},
]
WEIGHTS = {"layer.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "bias": torch.zeros(2)}


def run(root: Path, records: list[dict] = RECORDS, weights: dict = WEIGHTS, moments: float = 1.0) -> Path:
    """A run folder: its training log, final/model.safetensors and checkpoints/last.ckpt (the
    weights, an optimizer moment of ``moments`` everywhere, and a timing that differs in each run)."""
    (root / "final").mkdir(parents=True)
    (root / "checkpoints").mkdir()
    (root / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    save_file(weights, root / "final" / "model.safetensors")
    optimizer = [{"state": {0: {"exp_avg": torch.full((2, 3), moments)}}, "param_groups": [{"lr": 0.1}]}]
    state = {"state_dict": weights, "optimizer_states": optimizer, "timer": str(root)}
    torch.save(state, root / "checkpoints" / "last.ckpt")
    return root


def test_alike_runs_have_no_difference_and_timings_are_not_compared(tmp_path):
    resumed = [{**r, "rollout_wait_s": 9.0} for r in RECORDS]
    straight = run(tmp_path / "straight")
    assert first_difference(straight, run(tmp_path / "resumed", resumed), ignore=("rollout_wait_s",)) is None
    difference = first_difference(straight, run(tmp_path / "again", resumed))
    assert str(difference) == "training_log.jsonl step 1, rollout_wait_s: straight 0.1, resumed 9.0"


def test_a_logged_value_differs_beyond_the_tolerance_and_is_named_with_its_step(tmp_path):
    straight = run(tmp_path / "straight", [{**r, "rollout_wait_s": 0} for r in RECORDS])
    close = [RECORDS[0], {**RECORDS[1], "loss": -0.125 * (1 + 1e-7)}]
    assert first_difference(straight, run(tmp_path / "close", close), ignore=("rollout_wait_s",)) is None
    apart = [RECORDS[0], {**RECORDS[1], "loss": -0.125 * (1 + 1e-5), "reward": 0.75}]
    difference = first_difference(straight, run(tmp_path / "apart", apart), ignore=("rollout_wait_s",))
    assert (difference.where, difference.key) == ("training_log.jsonl step 2", "loss")
    assert (difference.straight, difference.resumed) == (-0.125, pytest.approx(-0.125 * (1 + 1e-5)))


def test_a_missing_or_extra_record_or_key_is_a_difference(tmp_path):
    straight = run(tmp_path / "straight")
    difference = first_difference(straight, run(tmp_path / "short", RECORDS[:1]))
    assert (difference.key, difference.straight, difference.resumed) == ("steps logged", [1, 2], [1])
    extra = [RECORDS[0], {**RECORDS[1], "kl": 0.0}]
    assert str(first_difference(straight, run(tmp_path / "extra", extra))).endswith(
        "kl: straight missing, resumed 0.0"
    )


def test_a_weight_differs_by_its_file_tensor_and_first_element(tmp_path):
    changed = {**WEIGHTS, "layer.weight": WEIGHTS["layer.weight"].clone()}
    changed["layer.weight"][1, 2] += 1e-6  # a tolerance would have let it through
    difference = first_difference(run(tmp_path / "straight"), run(tmp_path / "resumed", weights=changed))
    assert (difference.where, difference.key) == ("final/model.safetensors", "layer.weight[1, 2]")
    assert (difference.straight, difference.resumed) == (5.0, pytest.approx(5.0 + 1e-6))


def test_the_optimizer_state_of_the_last_checkpoint_is_compared_exactly(tmp_path):
    difference = first_difference(run(tmp_path / "straight"), run(tmp_path / "resumed", moments=1.5))
    assert difference.where == "checkpoints/last.ckpt"
    assert difference.key == "optimizer_states[0].state.0.exp_avg[0, 0]"
    assert (difference.straight, difference.resumed) == (1.0, 1.5)


def test_a_weights_file_the_resumed_run_lacks_is_a_difference(tmp_path):
    straight, resumed = run(tmp_path / "straight"), run(tmp_path / "resumed")
    (straight / "2").mkdir()
    save_file(WEIGHTS, straight / "2" / "model.safetensors")
    (straight / ".3.tmp-1-abcdef01").mkdir()  # a killed write's leftover is no file of the run
    save_file(WEIGHTS, straight / ".3.tmp-1-abcdef01" / "model.safetensors")
    said = "2/model.safetensors, the file: straight written, resumed missing"
    assert str(first_difference(straight, resumed)) == said
