"""Two DDP ranks (gloo, CPU) sampling on two ``forge-lightning serve`` servers, one killed with
SIGKILL after step 1 (tests/helpers/ddp_servers.py): the fit finishes its steps, counts the
failure, and trains every prompt's group exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers.ddp_servers import GROUP_SIZE, PROMPTS

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
SECRET = "ddp-test-secret"


@pytest.fixture
def two_servers(tmp_path, tiny_model_dir):
    """Two servers of the tiny model started as a user starts them; (process, host:port) each."""
    config = ServeConfig({"model": str(tiny_model_dir)}).write(tmp_path / "serve")
    started = []
    for i in range(2):
        port, log = free_port(), tmp_path / "serve" / f"server-{i}.log"
        process = spawn_server(config, port, SECRET, 1, log.open("ab"))
        started.append((process, f"127.0.0.1:{port}"))
    for i, (process, address) in enumerate(started):
        wait_until_healthy(address, SECRET, process, address, tmp_path / "serve" / f"server-{i}.log")
    yield started
    for process, _ in started:
        stop_process(process)


def test_a_server_killed_after_step_1_loses_no_prompt_and_is_counted(tmp_path, tiny_model_dir, two_servers):
    (victim, _), (survivor, _) = two_servers
    addresses = ",".join(address for _, address in two_servers)
    out = tmp_path / "run"
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    script = [
        str(TESTS / "helpers" / "ddp_servers.py"),
        str(out),
        str(tiny_model_dir),
        addresses,
        str(victim.pid),
    ]
    env = {**os.environ, SECRET_ENV: SECRET, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([*torchrun, *script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert victim.poll() == -9 and survivor.poll() is None
    assert "is marked dead" in done.stderr
    logged = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert logged[0]["server_failures"] == 0 and sum(r["server_failures"] for r in logged) >= 1
    # Every prompt's whole group (the reward gets its prompt once per completion) was scored, so
    # trained, exactly once across the ranks and steps.
    batches = [json.loads(line) for rank in (0, 1) for line in (out / f"scored-{rank}.jsonl").open()]
    assert len(batches) == 6 and all(b["responses"] == len(b["prompts"]) for b in batches)
    assert Counter(p for b in batches for p in b["prompts"]) == {p: GROUP_SIZE for p in PROMPTS}
