"""A policy sharded by FSDP2 over two trainer ranks reaches a rollout server whole: each parameter
gathered once, by both ranks, and sent by rank 0 (helpers/fsdp_push.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]


def test_two_fsdp_ranks_push_the_full_weights_to_a_server(tmp_path):
    env = {
        **os.environ,
        "FORGE_LIGHTNING_SERVE_SECRET": "fsdp-secret",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(TESTS / "helpers" / "fsdp_push.py"), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "result.json").read_text()) == {"connect": True, "step": True, "version": 1}
