"""``forge-lightning check-resume`` on a config whose rollouts a server samples: the trainer is
killed at its hard moments while the server it uses lives on, and each resume (which pushes the
checkpoint's weights to the server first) continues the straight run exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forge_lightning.cli.forge_cli import main
from forge_lightning.serving.processes import (
    ServeConfig,
    free_port,
    spawn_server,
    stop_process,
    wait_until_healthy,
)
from forge_lightning.serving.wire import SECRET_ENV

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]
SECRET = "resume-secret"

CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  max_steps: 3
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
model:
  model: {model}
  reward: helpers.faults.distinct_characters
  group_size: 4
  max_new_tokens: 6
  learning_rate: 0.01
  warmup_steps: 1
  gradient_accumulation_steps: 2
  kl_beta: 0.05
  rollout_servers: ["{server}"]
data:
  source: mock
  prompts_per_step: 2
"""


@pytest.fixture
def server(tmp_path, tiny_model_dir, monkeypatch) -> str:
    """One server of the tiny model, started as a user starts one; its host:port."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    config = ServeConfig({"model": str(tiny_model_dir)}).write(tmp_path / "serve")
    port, log = free_port(), tmp_path / "serve" / "server.log"
    process = spawn_server(config, port, SECRET, 1, log.open("ab"))
    wait_until_healthy(f"127.0.0.1:{port}", SECRET, process, "the test's server", log)
    yield f"127.0.0.1:{port}"
    stop_process(process)


def test_a_run_on_a_server_that_outlives_its_killed_trainer_resumes_exactly(
    tmp_path, tiny_model_dir, server, monkeypatch, capsys
):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "served.yaml"
    path.write_text(CONFIG.format(model=tiny_model_dir, server=server))
    try:
        main(["check-resume", "--config", str(path), "--workdir", str(tmp_path / "work")])
    except SystemExit as exit_:  # FAIL (1) or no check made (2); PASS returns
        pytest.fail(f"check-resume exited {exit_.code}: {capsys.readouterr().err[-3000:]}")
    assert capsys.readouterr().out.strip().endswith("PASS")
