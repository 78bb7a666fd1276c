"""Evaluations of the multi-step and GSM8K calculator runs of notebooks/chains.ipynb: a
``forge-lightning validate`` of one model under one setup, its answers copied to
``evals/<label>.jsonl`` beside this file and one line recorded in ``evals.jsonl`` (the command, the
accuracy, calls per answer, and among right answers the share whose final number is a calculator
result; notebooks/chains.ipynb reads both):

    OMP_NUM_THREADS=1 python notebooks/figures/multistep/evaluate.py LABEL MODEL SETUP [EXTRA FLAGS...]

SETUP: ``multistep`` (configs/multistep_cpu.yaml, the whole held-out part: greedy, 256 new tokens,
the calculator on), ``unseen`` (the same on the phrasing-held-out part: 200 problems in wordings
no train part uses), ``gsm8k`` (configs/gsm8k_calculator_cpu.yaml: the first 200 GSM8K test
problems, greedy, 256 new tokens, the calculator on) or ``gsm8k_no_tools`` (the same without the
calculator). MODEL is ``embedded`` or a run's ``final/`` folder. EXTRA FLAGS are added to the
command (``--model.val_num_generations 8 --model.val_temperature 0.8`` for pass@8). Run from the
repository root.
"""

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from forge_lightning.data.gsm8k import extract_answer, normalize_number

HERE = Path(__file__).resolve().parent
SETUPS = {
    "multistep": ["--config", "configs/multistep_cpu.yaml", "--data.val_part", "heldout"],
    "unseen": ["--config", "configs/multistep_cpu.yaml", "--data.val_part", "unseen"],
    "gsm8k": ["--config", "configs/gsm8k_calculator_cpu.yaml"],
    "gsm8k_no_tools": ["--config", "configs/gsm8k_calculator_cpu.yaml", "--model.calculator", "null"],
}


def calculator_final(row: dict) -> bool:
    """Whether the answer's final number is one the calculator wrote in it."""
    results = {normalize_number(call["result"]) for call in row.get("tool_calls") or [] if call.get("ok")}
    return extract_answer(row["completion"]) in results


def summary(rows: list[dict]) -> dict:
    """Accuracy, calls per answer and the calculator's share of the right answers' final numbers."""
    right = [r for r in rows if r["correct"]]
    out = {
        "problems": len(rows),
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "calls_per_answer": sum(len(r.get("tool_calls") or []) for r in rows) / len(rows),
        "right": len(right),
        "right_final_from_calculator": (sum(map(calculator_final, right)) / len(right)) if right else None,
    }
    samples = [s for r in rows for s in r.get("samples", [])]
    if samples:  # a sampled evaluation: pass@n over each prompt's n samples
        n = len(rows[0]["samples"])
        out[f"pass@{n}"] = sum(any(s["correct"] for s in r["samples"]) for r in rows) / len(rows)
        out[f"mean@{n}"] = sum(s["correct"] for s in samples) / len(samples)
    return out


if __name__ == "__main__":
    label, model, setup, *extra = sys.argv[1:]
    command = ["forge-lightning", "validate", *SETUPS[setup], "--model.model", model, *extra]
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([*command, "--trainer.default_root_dir", out], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        (answers,) = Path(out, "validation").glob("*.jsonl")
        (HERE / "evals").mkdir(exist_ok=True)
        shutil.copy(answers, HERE / "evals" / f"{label}.jsonl")
    rows = [json.loads(line) for line in (HERE / "evals" / f"{label}.jsonl").read_text().splitlines()]
    record = {"label": label, "command": shlex.join(command), **summary(rows)}
    with open(HERE / "evals.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
