"""The GPU check's rehearsal: ``check.sh --quick`` on the CPU writes every file the GPU run writes,
so the one run on a lent GPU machine is not the script's first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test here builds a Trainer or starts a process

ROOT = Path(__file__).resolve().parents[1]
# What the GPU image lacks and the check must not need: packages of the CLI and the hub loaders.
NOT_ON_THE_GPU_IMAGE = ("jsonargparse", "docstring_parser", "typeshed_client", "gguf", "datasets", "dill")


def test_quick_check_writes_every_result_file(tmp_path, gsm8k_dir, tiny_model_dir):
    out = tmp_path / "gpu"
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "check.sh"), str(out), "--quick"]
        + ["--data", str(gsm8k_dir), "--tokenizer", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    counts = summary["tests"]["counts"]
    assert counts["tests"] >= 5 and counts["failed"] == counts["errors"] == 0
    if summary["cuda"]:
        assert counts["passed"] == counts["tests"]
    else:  # said once, in one line, and every GPU test skipped rather than failed
        assert [line for line in done.stdout.splitlines() if "no CUDA device" in line] != []
        assert done.stdout.count("no CUDA device") == 1 and counts["skipped"] == counts["tests"]
    assert (out / "pytest.xml").is_file() and (out / "pytest.log").is_file()
    environment = json.loads((out / "environment.json").read_text())
    assert {"torch", "device", "date", "bf16_supported"} <= set(environment)
    lines = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [line["label"] for line in lines] == [
        "tiny-a 1x8x8",
        "tiny-a 8x8x8",
        "tiny-b 1x8x8",
        "tiny-b 8x8x8",
    ]
    for line in lines:
        assert "error" not in line, line.get("error")
        assert (
            line["completion_tokens_per_s"] > 0 and line["vs_generate"] > 0 and line["vs_straightforward"] > 0
        )
        assert line["completion_tokens_per_step"] == int(line["settings"]["prompts_per_step"]) * 8 * 8
        assert line["command"].startswith("python -m forge_lightning.bench ")
    assert summary["bench_lines"] == 4 and summary["bench_errors"] == []


def test_the_check_imports_nothing_the_gpu_image_lacks():
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in NOT_ON_THE_GPU_IMAGE)
    code = f"import sys; {blocked}; import forge_lightning.bench, forge_lightning.module, check"
    env_path = str(ROOT / "tests" / "gpu")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": f"{ROOT}:{env_path}"}
    )
    assert done.returncode == 0, done.stderr[-2000:]
