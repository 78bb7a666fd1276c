"""Hostile code against the sandbox (``sandbox: process``): the code-execution example reward
(examples/code_execution.py) running programs that spin, fork, allocate 10 GB, write outside their
folder, read the run folder and connect to a socket this test listens on; and a fit whose reward
and tool hang. Each is stopped or refused, the run goes on, the timings hold, no process is left,
nothing outside the scratch folders changes, and every failure is counted with its cause logged."""

from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import lightning.pytorch as pl
import pytest
from helpers import hostile
from helpers.engines import TurnEngine
from helpers.models import make_model
from helpers.sandbox import processes_naming
from helpers.tools import chat_tokenizer

from forge_lightning.examples.code_execution import passes_tests
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rollout.tools.function_call import CUT_MARK, Job, called, tool_text
from forge_lightning.sandbox.pool import ForgedAnswer, Sandbox, SandboxCallError, SandboxLimits, SandboxRaised
from forge_lightning.sandbox.process import WorkerProcess
from forge_lightning.sandbox.worker import run_python

# Where the machine cannot isolate sandboxed workers these tests are skipped (conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("isolating_machine")]

WORKER = "forge_lightning.sandbox.worker"


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root`` with its size and modification time."""
    files = [path for path in root.rglob("*") if path.is_file()]
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for path in files}


@pytest.fixture
def listener():
    """A TCP socket listening on 127.0.0.1, and a function that says whether anyone connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    yield server.getsockname()[1], listening(server)
    server.close()


def listening(server: socket.socket) -> Callable[[], bool]:
    """Make ``server`` (bound) listen; a function that says whether anyone connected since."""
    server.listen()
    server.setblocking(False)

    def connected() -> bool:
        try:
            server.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    return connected


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
# space, Landlock's file rules, and the socket filter (EPERM from socket(), before the network
# namespace and Landlock's TCP rules are reached).
STOPPED_BY = {
    "forks": "BlockingIOError: [Errno 11] Resource temporarily unavailable",
    "allocates 10 GB": "MemoryError",
    "writes outside": "PermissionError: [Errno 13] Permission denied",
    "reads the run folder": "PermissionError: [Errno 13] Permission denied",
    "connects": "PermissionError: [Errno 1] Operation not permitted",
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
    # A PythonRun crosses back as the dict of its fields (data, never a pickle).
    last_lines = {name: run["stderr"].strip().splitlines()[-1] for name, run in runs.items()}
    assert all(last_lines[name].startswith(error) for name, error in STOPPED_BY.items()), last_lines
    # Each failed by the error (the fork storm's children, holding its output open, died at its time).
    assert all(run["returncode"] == 1 for run in runs.values())
    assert spun["timed_out"] and spin_time < 1.0 + 1.0  # killed within its time + 1 s
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
    grpo.engine = TurnEngine(tok, [call, "```python\nprint(int(input()) * 2)\n```"])
    workers: list[int] = []

    class Workers(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            workers.extend(pl_module.sandbox.worker_pids())

    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="forge_lightning.sandbox.pool"):
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


# -- what crosses back is data; a call speaks for itself alone; no sockets, no root, no secrets ----


def test_a_returned_or_raised_object_that_would_run_code_when_unpickled_is_that_calls_error(tmp_path):
    returned, raised = tmp_path / "returned", tmp_path / "raised"
    assert "marker" in hostile.returns_a_bomb.__code__.co_varnames  # the control: in the trainer it is a bomb
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"bombs": hostile.returns_a_bomb})
    try:
        with pytest.raises(SandboxCallError, match="not data .*hostile.Bomb"):
            sandbox.call(hostile.returns_a_bomb, (["p"], ["r"], [str(returned)]), {}, 10, "returns")
        with pytest.raises(SandboxRaised, match="hostile.BombError"):
            sandbox.call(hostile.raises_a_bomb, (["p"], ["r"], [str(raised)]), {}, 10, "raises")
        assert sandbox.call(hostile.counts, (["p"], ["abc"]), {}, 10, "after") == [3.0]
    finally:
        sandbox.close()
    assert not returned.exists() and not raised.exists()  # nothing was unpickled in the trainer


def test_a_call_that_writes_on_every_descriptor_cannot_answer_for_the_next_call():
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"forges": hostile.forges_answers})
    try:
        # Its only descriptor is its own answer pipe: what it forged there is its own error...
        with pytest.raises(SandboxCallError, match="forges answered out of form"):
            sandbox.call(hostile.forges_answers, (1,), {}, 10, "forges")
        # ... and no later call's answer (on today's main, the next call got the forged 99 or 1).
        answers = [sandbox.call(hostile.doubles, (value,), {}, 10, "doubles") for value in (2, 3)]
    finally:
        sandbox.close()
    assert answers == [4, 6]


def test_an_answer_naming_another_call_kills_its_worker_and_is_that_calls_error(tmp_path):
    marker = tmp_path / "unpickled"
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"where": hostile.where})
    try:
        sandbox.call(hostile.where, (), {}, 10, "warm-up")
        (worker,) = sandbox._all
        reader, writer = os.pipe()  # the worker's answers now come from this pipe, as forged as can be
        worker.answers.close()
        worker.answers = Connection(reader, writable=False)
        forged = Connection(writer, readable=False)
        forged.send_bytes(json.dumps(["0" * 32, "ok", {"files": ["forged"]}]).encode())
        with pytest.raises(ForgedAnswer, match="names another call.*its worker was killed"):
            sandbox.call(hostile.where, (), {}, 10, "first")
        assert not os.path.exists(f"/proc/{worker.process.pid}")
        assert sandbox.call(hostile.where, (), {}, 10, "second")["files"] == []  # in a new worker
    finally:
        sandbox.close()
    ask = WorkerProcess.__new__(WorkerProcess)  # and a pickle is never read: it is out of form
    task_r, task_w = os.pipe()
    reader, writer = os.pipe()
    ask.tasks, ask.answers = Connection(task_w, readable=False), Connection(reader, writable=False)
    Connection(writer, readable=False).send_bytes(pickle.dumps(hostile.Bomb(str(marker))))
    with pytest.raises(ForgedAnswer, match="not the sandbox's JSON"):
        ask.ask(b"task", 5.0)
    assert not marker.exists()
    os.close(task_r)


@pytest.mark.parametrize(
    "what, expected",
    [("socket", "PermissionError"), ("unix", "PermissionError"), ("bind", "PermissionError"),
     ("sendmsg", "PermissionError"), ("socketpair", "made"), ("send", "made"), ("asyncio", "made")],
)  # fmt: skip
def test_sockets_are_refused_in_the_sandbox_and_a_socket_pair_still_works(what, expected):
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"tries": hostile.tries})
    try:
        assert sandbox.call(hostile.tries, (what,), {}, 10, what) == expected
        assert hostile.tries(what) == "made"  # the control: the trainer may
    finally:
        sandbox.close()


@pytest.fixture
def unix_listener():
    """A Unix socket, mode 0777, in a world-readable folder outside the sandbox's reach; a function
    that says whether anyone connected."""
    folder = Path(tempfile.mkdtemp(prefix="forge-red-team-"))
    folder.chmod(0o755)
    path = folder / "service.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o777)
    yield str(path), listening(server)
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def root_secret():
    """A 0600 file of root's in /etc (under a root trainer; None elsewhere)."""
    if os.geteuid() != 0:
        yield None
        return
    path = Path(f"/etc/forge-red-team-{os.getpid()}")
    path.write_text("root only")
    path.chmod(0o600)
    yield str(path)
    path.unlink()


def test_calls_run_as_nobody_under_root_and_see_only_the_variables_sandbox_env_names(monkeypatch):
    monkeypatch.setenv(hostile.SECRET_NAME, "s3cret")
    seen = {}
    for names in ((), (hostile.SECRET_NAME,)):
        sandbox = Sandbox(workers=1, env=names)
        sandbox.prepare({"who": hostile.who})
        try:
            seen[names] = sandbox.call(hostile.who, (), {}, 10, "who")
        finally:
            sandbox.close()
    assert seen[()]["secret"] is None and seen[(hostile.SECRET_NAME,)]["secret"] == "s3cret"
    if os.geteuid() == 0:
        assert seen[()]["uid"] == seen[()]["gid"] == 65534


def test_a_module_only_root_can_read_imports_and_neither_its_neighbours_nor_a_run_folder_can(
    tmp_path, monkeypatch
):
    if os.geteuid() != 0:
        pytest.skip("a module only root can read needs a root trainer")
    folder = tmp_path / "project"
    (folder / "runs" / "r1").mkdir(parents=True)
    (folder / "runs" / "r1" / "secret.txt").write_text("the run's")
    (folder / "data.txt").write_text("beside the module")
    name = f"closed_reward_{os.getpid()}"
    module = folder / f"{name}.py"
    module.write_text(
        "def peek(path):\n"
        "    try:\n        return open(path).read()\n"
        "    except OSError:\n        return None\n"
    )
    module.chmod(0o600)
    folder.chmod(0o700)
    monkeypatch.syspath_prepend(str(folder))
    peek = importlib.import_module(name).peek
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"peek": peek})
    try:
        seen = {
            what: sandbox.call(peek, (str(path),), {}, 10, what)
            for what, path in [
                ("module", module),
                ("data", folder / "data.txt"),
                ("run", folder / "runs" / "r1" / "secret.txt"),
            ]
        }
    finally:
        sandbox.close()
        sys.modules.pop(name, None)
    assert seen == {"module": None, "data": None, "run": None}  # imported by the worker, read by no call
    assert peek(str(folder / "data.txt")) == "beside the module"  # the control: the trainer reads it


def test_a_fit_whose_rewards_attack_the_trainer_and_the_machine_finishes_and_counts_them(
    tmp_path, trainer, loader, unix_listener, root_secret, monkeypatch
):
    monkeypatch.setenv(hostile.SECRET_NAME, "s3cret")
    path, connected = unix_listener
    marker = tmp_path / "unpickled"
    readable = root_secret or str(tmp_path / "stands-in")  # a test that is not root has no root file
    if root_secret is None:
        Path(readable).write_text("x")
    row = {"prompt": "Q", "marker": str(marker), "path": path, "secret_path": readable}
    # The controls: in the trainer's process each attack works.
    assert hostile.connects_unix(["p"], ["r"], [path]) == [1.0] and connected()
    assert hostile.reads_file(["p"], ["r"], [readable]) == [1.0]
    assert hostile.reads_secret(["p"], ["r"]) == [1.0]

    grpo = GRPOLightningModule(
        model=make_model(len(chat_tokenizer()), bos_token_id=2, eos_token_id=1, pad_token_id=0),
        tokenizer=chat_tokenizer(),
        reward=[
            hostile.returns_a_bomb,
            hostile.raises_a_bomb,
            hostile.connects_unix,
            hostile.reads_secret,
            hostile.reads_secret_file,
            hostile.counts,
        ],  # fmt: skip
        group_size=2,
        max_new_tokens=4,
        gradient_accumulation_steps=1,
        on_reward_error="zero",
        reward_timeout=10.0,
        sandbox="process",
        sandbox_workers=2,
    )
    fit = trainer(tmp_path, max_steps=1, limit_val_batches=0)
    fit.fit(grpo, loader([row]))
    metrics = grpo.last_step.metrics
    assert fit.global_step == 1  # the run finished
    assert not marker.exists()  # nothing was unpickled in the trainer
    assert metrics["train/reward_errors"] == 2.0  # both completions: each failed with both bombs
    assert not connected()
    for name in ("connects_unix", "reads_secret"):
        assert metrics[f"train/rewards/{name}"] == 0.0, name
    if root_secret is not None:
        assert metrics["train/rewards/reads_secret_file"] == 0.0
    assert metrics["train/rewards/counts"] > 0.0  # the honest reward ran beside them


def test_a_sandboxed_tools_value_is_made_text_and_cut_in_its_worker(tmp_path):
    marker = tmp_path / "unpickled"
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"bomb": hostile.gives_a_bomb, "lot": hostile.gives_a_lot, "tool text": tool_text})
    try:
        bomb = called(Job(hostile.gives_a_bomb, {"marker": str(marker)}, "bomb", sandbox=sandbox), 200)
        lot = called(Job(hostile.gives_a_lot, {"n": 5_000_000}, "lot", sandbox=sandbox, timeout=30), 50)
    finally:
        sandbox.close()
    assert "hostile.Bomb object" in bomb[0] and not bomb[1] and not marker.exists()  # its str, as text
    assert lot == ("x" * 50 + CUT_MARK.format(total=5_000_000, kept=50), True)
    assert tool_text(hostile.gives_a_lot, 50, n=5_000_000) == lot  # what the worker sends back
