"""The GPU check in one call: the GPU tests, then the benchmark on SmolLM2-135M's and -1.7B's shapes.

    bash tests/gpu/check.sh OUT_DIR                       # on the GPU machine
    bash tests/gpu/check.sh OUT_DIR --quick --data D --tokenizer T   # the same lines on CPU, tiny
    python tests/gpu/check.py --prepare tests/gpu/carry   # here, before: what the GPU machine lacks

Through the device tool: ``bash tests/gpu/check.sh $OUT/gpu`` with ``tests/gpu/carry`` carried and a
330 s limit; then commit ``$OUT/gpu/*`` under ``notebooks/figures/gpu/``, where
``notebooks/throughput.ipynb`` tables it.

The GPU machine has no network and neither ``../shared`` nor the embedded model, so ``--prepare``
fills a folder that travels with the call (git ignores it): about 10 GSM8K train prompts, SmolLM2's
tokenizer files and the wheels of what the check imports that the machine may lack (pytest). The
check installs only what is missing, from those wheels. The models' weights do not travel: the
benchmark builds ``random:`` models of each shape (configs written here) in bf16 on the GPU.

Everything lands under OUT_DIR: ``environment.json``, ``install.json``, ``pytest.log`` and
``pytest.xml`` (the GPU tests; skipped without CUDA), ``bench.jsonl`` (one JSON line per benchmark
line: the benchmark's own figures plus ``label``, ``command``, ``date`` and the peak CUDA memory of
the line) and ``summary.json``. It exits 1 when a test failed or a benchmark line raised.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / "tests" / "gpu" / "carry"
# module -> the distribution whose wheel provides it: what the check imports beyond torch,
# lightning, transformers, peft, tensorboard and torchmetrics (on the GPU image already), and what
# the ``forge-lightning serve`` process of test_rollout_server.py imports (the CLI package).
NEEDED = {
    "pytest": "pytest",
    "iniconfig": "iniconfig",
    "pluggy": "pluggy",
    "pygments": "pygments",
    "packaging": "packaging",
    "jsonargparse": "jsonargparse",
    "docstring_parser": "docstring-parser",
    "typeshed_client": "typeshed-client",
}
# SmolLM2's shapes (Llama architecture, tied embeddings, 49152-token vocabulary).
# name: (hidden, intermediate, layers, attention heads, key/value heads)
SHAPES = {"smollm2-135m": (576, 1536, 30, 9, 3), "smollm2-1.7b": (2048, 8192, 24, 32, 32)}
TINY_SHAPES = {"tiny-a": (32, 64, 2, 4, 2), "tiny-b": (64, 128, 3, 4, 4)}
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tests/gpu/check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the results (created)")
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes, few tokens: a rehearsal")
    parser.add_argument("--prepare", action="store_true", help="fill OUT (the carry folder) and stop")
    parser.add_argument("--carry", type=Path, default=CARRY, help="the carried folder (default %(default)s)")
    parser.add_argument("--data", type=Path, help="GSM8K folder or file (default: CARRY/gsm8k)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: CARRY/tokenizer)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; no bench line starts after")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare:
        prepare(args.out)
        return 0
    start = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "install.json", install_missing(args.carry / "wheels"))
    import torch

    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda  # without a GPU only the rehearsal makes sense
    write_json(out / "environment.json", describe(torch, quick))
    if not cuda:
        print(
            "check: no CUDA device here: the GPU tests are skipped, the bench runs --quick on CPU", flush=True
        )
    tests = run_gpu_tests(out, timeout=90 if args.quick else 180)
    print(f"check: GPU tests {tests['counts']}", flush=True)
    models = write_models(out / "models", args.tokenizer or args.carry / "tokenizer", args.quick)
    data = args.data or args.carry / "gsm8k"
    lines = run_bench(
        out / "bench.jsonl", models, data, quick=args.quick or not cuda, deadline=start + args.budget
    )
    errors = [line["label"] for line in lines if "error" in line]
    summary = {"cuda": cuda, "quick": quick, "tests": tests, "bench_lines": len(lines),
               "bench_errors": errors, "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    write_json(out / "summary.json", summary)
    print(f"check: {len(lines)} bench lines, {len(errors)} failed, {summary['seconds']} s; results in {out}")
    return 1 if tests["counts"].get("failed", 0) or tests["counts"].get("errors", 0) or errors else 0


def install_missing(wheels: Path) -> dict[str, Any]:
    """pip-install, from the carried wheels only, every needed module that does not import."""
    missing = sorted({dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None})
    report: dict[str, Any] = {"missing": missing, "installed": [], "wheels": str(wheels)}
    if missing and wheels.is_dir():
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(wheels),
            *missing,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        report["installed"] = missing if done.returncode == 0 else []
        report["pip_output"] = (done.stdout + done.stderr)[-2000:]
    elif missing:
        report["pip_output"] = f"no wheels folder at {wheels}"
    return report


def describe(torch: Any, quick: bool) -> dict[str, Any]:
    import lightning
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
    }


def run_gpu_tests(out: Path, timeout: float) -> dict[str, Any]:
    """pytest over tests/gpu/ in its own process; the counts and the failing tests from its XML."""
    xml = out / "pytest.xml"
    command = [sys.executable, "-m", "pytest", str(REPO / "tests" / "gpu"), "-q", "-rA",
               "-p", "no:cacheprovider", f"--junitxml={xml}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(out / "pytest.log", "w", encoding="utf-8") as log:
        try:
            subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            log.write(f"\ncheck: pytest stopped after {timeout} s\n")
    if not xml.is_file():
        return {"counts": {"errors": 1}, "failed": ["pytest did not finish (see pytest.log)"]}
    suite = ElementTree.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = counts.pop("failures")
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    return {"counts": counts, "failed": failed}


def write_models(folder: Path, tokenizer_dir: Path, quick: bool) -> dict[str, Path]:
    """A config (no weights) and the tokenizer for each shape, as ``random:`` model specs read them."""
    from transformers import AutoTokenizer, LlamaConfig

    if not tokenizer_dir.is_dir():
        raise SystemExit(
            f"check: no tokenizer folder at {tokenizer_dir} (run --prepare, or pass --tokenizer)"
        )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id}  # fmt: skip
    models = {}
    for name, shape in (TINY_SHAPES if quick else SHAPES).items():
        target = folder / name
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            **special,
            **dict(zip(SHAPE_FIELDS, shape)),
        )
        config.save_pretrained(target)
        tokenizer.save_pretrained(target)
        models[name] = target
    return models


def run_bench(
    path: Path, models: dict[str, Path], data: Path, *, quick: bool, deadline: float
) -> list[dict[str, Any]]:
    """One benchmark line per shape and prompts-per-step, in this process, appended to ``path``."""
    import torch

    from forge_lightning.bench import throughput as bench

    tokens, steps = ("8", "1") if quick else ("256", "2")
    device = "cpu" if quick else "cuda"
    lines = []
    for name, folder in models.items():
        for prompts in ("1", "8"):
            label = f"{name} {prompts}x8x{tokens}"
            argv = ["--data", str(data), "--model", f"random:{folder}", "--device", device, "--fixed-length"]
            argv += [
                "--prompts-per-step",
                prompts,
                "--group",
                "8",
                "--max-new-tokens",
                tokens,
                "--steps",
                steps,
            ]
            line: dict[str, Any] = {
                "label": label,
                "command": "python -m forge_lightning.bench " + " ".join(argv),
            }
            line["date"] = datetime.date.today().isoformat()
            if time.monotonic() > deadline:
                line["error"] = "not run: the check's time budget was spent"
            else:
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    line.update(bench.main(argv))
                except Exception as err:  # one failing line must not cost the others
                    line["error"] = f"{type(err).__name__}: {err}"[:2000]
                if device == "cuda":
                    line["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            print(
                f"check: bench {label}: {line.get('completion_tokens_per_s', line.get('error'))}", flush=True
            )
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
            lines.append(line)
    return lines


def prepare(carry: Path) -> None:
    """Fill the carried folder: GSM8K prompts, SmolLM2's tokenizer, wheels of NEEDED."""
    from forge_lightning.models.loading import _embedded_cache

    shared = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    (carry / "gsm8k").mkdir(parents=True, exist_ok=True)
    rows = shared.read_text(encoding="utf-8").splitlines()[:10]
    (carry / "gsm8k" / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    source = _embedded_cache()
    (carry / "tokenizer").mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, carry / "tokenizer" / name)
    wheels = carry / "wheels"
    wheels.mkdir(exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        "-d",
        str(wheels),
        *set(NEEDED.values()),
    ]
    subprocess.run(command, check=True)
    size = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file()) / 2**20
    count = len(list(wheels.iterdir()))
    print(f"prepared {carry}: {len(rows)} prompts, tokenizer, {count} wheels, {size:.1f} MiB")


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
