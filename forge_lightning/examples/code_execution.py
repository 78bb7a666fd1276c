"""A reward that runs the model's Python against test cases: the example that needs the sandbox.

The program a completion writes is data: it never runs in the trainer. Under ``sandbox: process``
the reward itself runs in a sandboxed worker (sandbox/pool.py: no network, reads only Python and
``sys.path``, writes only its scratch folder, its processes bounded), and each program runs in a
fresh interpreter started there (sandbox/worker.py's ``run_python``: ``python -I -S``, reads
narrowed to the Python installation, an address-space cap, killed with every process it started
past its time). Outside a sandbox worker it refuses to run anything::

    model:
      reward: forge_lightning.examples.code_execution.passes_tests
      sandbox: process
      reward_timeout: 120   # a call runs every program of its batch, each up to PROGRAM_SECONDS

Each row gives its tests in a ``tests`` column: a list of ``{"input": ..., "output": ...}``, the
program's standard input and the standard output expected (compared without surrounding space).
"""

from __future__ import annotations

import re
from typing import Any

from forge_lightning.sandbox.worker import PythonRun, run_python

# Seconds and MiB of address space one program may use on one test.
PROGRAM_SECONDS = 2.0
PROGRAM_MEMORY_MB = 256
# The program: the last fenced block of the response (```python ... ```), else the whole response.
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def program_of(response: str) -> str:
    """The program a response writes: its last fenced code block, else all of it."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


def passes(run: PythonRun, expected: Any) -> bool:
    """Whether a program's run passed a test: it ended in time with code 0 and printed ``expected``."""
    return not run.timed_out and run.returncode == 0 and run.stdout.strip() == str(expected).strip()


def passes_tests(prompts: list[str], responses: list[str], tests: list[list[dict[str, Any]]]) -> list[float]:
    """The share of its row's ``tests`` each response's program passes (0.0 for a row without
    tests). A program that hangs, crashes, runs out of memory or is refused what it tries
    (the network, a file outside its folder, more processes) fails that test; the batch goes on."""
    scores = []
    for response, cases in zip(responses, tests):
        program = program_of(response)
        runs = [run_python(program, str(case["input"]), PROGRAM_SECONDS, PROGRAM_MEMORY_MB) for case in cases]
        scores.append(
            sum(passes(run, case["output"]) for run, case in zip(runs, cases)) / len(cases) if cases else 0.0
        )
    return scores
