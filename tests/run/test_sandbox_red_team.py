"""Hostile code against the sandbox (``sandbox: process``): the code-execution example reward
(examples/code_execution.py) running programs that spin, fork, allocate 10 GB, write outside their
folder, read the run folder and connect to a socket this test listens on; and a fit whose reward
and tool hang. Each is stopped or refused, the run goes on, the timings hold, no process is left,
nothing outside the scratch folders changes, and every failure is counted with its cause logged."""

from __future__ import annotations

import json
import logging
import os
import socket
import string
import time
from pathlib import Path

import hostile
import lightning.pytorch as pl
import pytest
import torch
from conftest import make_model
from test_sandbox import isolating_machine, processes_naming  # noqa: F401 (an autouse fixture)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from forge_lightning.examples.code_execution import passes_tests
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.scoring import score
from forge_lightning.run.sandbox import Sandbox, SandboxLimits
from forge_lightning.run.sandbox_worker import run_python

pytestmark = pytest.mark.integration

WORKER = "forge_lightning.run.sandbox_worker"


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root`` with its size and modification time."""
    files = [path for path in root.rglob("*") if path.is_file()]
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for path in files}


@pytest.fixture
def listener():
    """A TCP socket listening on 127.0.0.1, and a function that says whether anyone connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)

    def connected() -> bool:
        try:
            server.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    yield server.getsockname()[1], connected
    server.close()


def hostile_programs(outside: Path, secret: Path, port: int) -> dict[str, str]:
    """Programs that print ``ok`` where what they try succeeded."""
    return {
        "spins": "while True:\n    pass\n",
        "forks": (
            "import os, time\nfor i in range(200):\n    if os.fork() == 0:\n        time.sleep(30)\n"
            "        break\nelse:\n    print('ok')\n"
        ),
        "allocates 10 GB": "x = bytearray(10 * 1024 ** 3)\nprint('ok')\n",
        "writes outside": f"open({str(outside)!r}, 'w').write('x')\nprint('ok')\n",
        "reads the run folder": f"print(open({str(secret)!r}).read())\n",
        "connects": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('ok')\n"
        ),
    }


# What stops each program: its time, the worker's pids cgroup (or RLIMIT_NPROC), its address
# space, Landlock's file rules, and the network namespace with Landlock's TCP rules.
STOPPED_BY = {
    "forks": "BlockingIOError: [Errno 11] Resource temporarily unavailable",
    "allocates 10 GB": "MemoryError",
    "writes outside": "PermissionError: [Errno 13] Permission denied",
    "reads the run folder": "PermissionError: [Errno 13] Permission denied",
    "connects": "PermissionError: [Errno 13] Permission denied",
}


def test_hostile_programs_are_stopped_or_refused_and_the_batch_goes_on(tmp_path, listener):
    port, connected = listener
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    secret = run_folder / "secret.txt"
    secret.write_text("ok")
    outside = tmp_path / "outside.txt"
    programs = hostile_programs(outside, secret, port)
    # The reward scores a batch of them (those that stop at once) and a benign program among them.
    quick = [name for name in programs if name not in ("spins", "forks")]
    responses = [f"```python\n{programs[name]}```" for name in quick] + ["print(int(input()) * 2)"]
    tests = [[{"input": "", "output": "ok"}]] * len(quick) + [[{"input": "21", "output": "42"}]]
    before = tree(tmp_path)
    sandbox = Sandbox(workers=1, limits=SandboxLimits(memory_mb=512, cpu_seconds=20))
    sandbox.prepare({"reward 'passes_tests'": passes_tests})
    try:
        runs = {
            name: sandbox.call(run_python, (programs[name], "", 2.0, 256), {}, 20, name)
            for name in STOPPED_BY
        }
        start = time.monotonic()
        spun = sandbox.call(run_python, (programs["spins"], "", 1.0, 256), {}, 20, "spins")
        spin_time = time.monotonic() - start
        scored = score(
            passes_tests, ["p"] * len(responses), responses, tests=tests, sandbox=sandbox, reward_timeout=30
        )
        workers = sandbox.worker_pids()
    finally:
        sandbox.close()
    last_lines = {name: run.stderr.strip().splitlines()[-1] for name, run in runs.items()}
    assert all(last_lines[name].startswith(error) for name, error in STOPPED_BY.items()), last_lines
    # Each failed by the error (the fork storm's children, holding its output open, died at its time).
    assert all(run.returncode == 1 for run in runs.values())
    assert spun.timed_out and spin_time < 1.0 + 1.0  # killed within its time + 1 s
    assert dict(zip([*quick, "benign"], scored.total)) == {**dict.fromkeys(quick, 0.0), "benign": 1.0}
    assert scored.num_errors == 0  # every hostile program failed its test; the batch went on
    assert not connected()
    assert not outside.exists() and tree(tmp_path) == before
    assert all(not os.path.exists(f"/proc/{pid}") for pid in workers)


def test_run_python_refuses_to_run_a_program_outside_a_sandbox_worker(tmp_path):
    with pytest.raises(RuntimeError, match="only inside a sandbox worker"):
        passes_tests(["p"], [f"open({str(tmp_path / 'x')!r}, 'w')"], [[{"input": "", "output": ""}]])
    assert list(tmp_path.iterdir()) == []


# -- a fit whose reward and tool hang -------------------------------------------------------------

SPECIAL = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"]
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character and ChatML's two special tokens (the EOS ends a turn)."""
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + CHARS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
    )
    tok.chat_template = TEMPLATE
    return tok


class TurnEngine:
    """Writes the policy's ``k``-th turn after ``k`` tool messages, then its end of turn."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok, self.turns = tok, turns

    def generate(self, model, prompt_ids, prompt_mask, group_size, params):
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, mask) if m])
            turn = self.turns[min(text.count("<|im_start|>tool"), len(self.turns) - 1)]
            new = self.tok(turn, add_special_tokens=False)["input_ids"]
            rows += [[*new, self.tok.eos_token_id][: params.max_new_tokens]] * group_size
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])

    def sync_weights(self, model) -> None:
        pass


def test_a_fit_whose_reward_and_tool_hang_finishes_and_counts_each_failure(tmp_path, trainer, loader, caplog):
    tok = chat_tokenizer()
    call = f"<tool_call>{json.dumps({'name': 'stalls', 'arguments': {'x': 1}})}</tool_call>"
    grpo = GRPOLightningModule(
        model=make_model(len(tok), bos_token_id=2, eos_token_id=1, pad_token_id=0),
        tokenizer=tok,
        reward=[passes_tests, hostile.spins],
        accuracy=hostile.counts,
        tools=[hostile.stalls, hostile.doubles],
        use_chat_template=True,
        group_size=2,
        max_new_tokens=200,
        gradient_accumulation_steps=1,
        on_reward_error="zero",
        reward_timeout=1.0,
        tool_timeout=1.0,
        sandbox="process",
        sandbox_workers=2,
    )
    grpo.generator = TurnEngine(tok, [call, "```python\nprint(int(input()) * 2)\n```"])
    workers: list[int] = []

    class Workers(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            workers.extend(pl_module.sandbox.worker_pids())

    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="forge_lightning.run.sandbox"):
        fit = trainer(tmp_path, max_steps=1, callbacks=[Workers()], limit_val_batches=0)
        fit.fit(grpo, loader([{"prompt": "Q", "tests": [{"input": "21", "output": "42"}]}]))
    wall = time.monotonic() - start

    assert fit.global_step == 1  # the run finished
    metrics = grpo.last_step.metrics
    assert metrics["train/rewards/passes_tests"] == 1.0  # the program passed, in the sandbox
    assert metrics["train/reward_errors"] == 2.0  # spins on both completions: killed, counted
    assert metrics["train/tool_errors"] == 1.0  # each completion's stalled call
    assert "'spins' ran past 1s" in caplog.text and "tool 'stalls' ran past 1s" in caplog.text
    assert wall < 30.0
    assert workers and all(not os.path.exists(f"/proc/{pid}") for pid in workers)  # teardown killed them
    assert processes_naming(WORKER) == []
