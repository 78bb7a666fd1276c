"""The sandbox's worker process (sandbox/pool.py starts it): a fresh interpreter in its own user,
pid, network, mount and IPC namespaces. Before it reads its first task it restricts itself, and
all it will start, by Landlock to reading the Python installation and the user's modules (the
paths the trainer names) and writing its scratch folder, and by a seccomp filter to no sockets
(sandbox/seccomp.py). It runs each call in a forked child that keeps no descriptor of the worker's but
its own answer pipe and, under a root trainer, runs as nobody (sandbox/isolation.py's
:func:`~forge_lightning.sandbox.isolation.enter_call`), under the call's resource limits. It answers
with the child's result (or how the child died), then kills every other process in its pid
namespace and empties the scratch folder, so that nothing a call started outlives it and no call
sees another's files.

Messages are frames on two pipes: the trainer's, a call id then a pickle of ``(function, args,
kwargs)`` (or of an episode's message), in; the answer out, as JSON ``[id, kind, value]``
(sandbox/frames.py): what a call hands back is read as data, never unpickled, by the worker and
the trainer alike. A third pipe, which only the trainer writes, is the lifeline: when it closes
(the trainer died) the worker exits, and with it (the pid namespace's first process) every process
it holds.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from forge_lightning.sandbox.episode_worker import FOLDER_PREFIX, EpisodeOp, Episodes
from forge_lightning.sandbox.frames import awaited, death, decoded, encoded, failed, raised, receive
from forge_lightning.sandbox.isolation import enter_call, expose, mapped
from forge_lightning.sandbox.landlock import restrict
from forge_lightning.sandbox.seccomp import deny_sockets

# Folders every Python process needs to read (its libraries, the system's configuration).
SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/bin", "/etc", "/proc", "/sys", "/dev")
# Files a sandboxed process may write besides its scratch folder.
DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/urandom")
POLL_SECONDS = 0.05
# The environment variable that marks a sandbox worker (sandbox/pool.py sets it).
WORKER_MARK = "FORGE_SANDBOX_WORKER"
# The length of a call's id, which starts each task frame (hex digits).
ID_BYTES = 32


def serve() -> None:
    """The worker's loop: ``sys.argv`` holds the fds of the task, answer and lifeline pipes, the
    scratch folder and its setup as JSON (the limits, SandboxLimits' fields; the id a call's
    process drops to, or null; the paths it may read and the folders it may only list)."""
    task_fd, answer_fd, lifeline_fd = (int(value) for value in sys.argv[1:4])
    scratch, setup = sys.argv[4], json.loads(sys.argv[5])
    limits = {**setup["limits"], "drop_to": setup["drop_to"]}
    tasks = Connection(task_fd, writable=False)
    answers = Connection(answer_fd, readable=False)
    mapped()  # under a root trainer, written by it before its first task
    if limits["drop_to"] is not None:  # the calls run as nobody: a Python below /root stays theirs to read
        expose(setup["read"], limits["drop_to"])
    restrict([*setup["read"], *SYSTEM_FOLDERS], [scratch], DEVICE_FILES, setup["list_only"])
    deny_sockets()
    for kind, value in (
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, limits["processes"]),  # binds a user that is not root (sandbox.py)
    ):
        resource.setrlimit(kind, (value, value))
    episodes = Episodes(scratch, limits)
    while True:
        ready, _, _ = select.select([task_fd, lifeline_fd], [], [])
        if lifeline_fd in ready:
            os._exit(0)  # the trainer is gone (or closed the pool)
        try:
            message = tasks.recv_bytes()
        except EOFError:
            os._exit(0)
        call, message = message[:ID_BYTES].decode(), message[ID_BYTES:]
        kind, value = _answer(message, scratch, limits, lifeline_fd, episodes)
        answers.send_bytes(json.dumps([call, kind, value]).encode())


def _answer(
    message: bytes, scratch: str, limits: dict[str, Any], lifeline_fd: int, episodes: Episodes
) -> tuple[str, Any]:
    """One message's answer ``(kind, value)``: a call run in a forked child, which is then killed
    with whatever it started; an episode's message (sandbox/episode_worker.py) handed to its episodes."""
    try:
        task = pickle.loads(message)  # the trainer's; imports the call's modules here, once per worker
    except BaseException as err:  # a module the worker cannot import, a class that fails to load
        return "failed", (
            f"could not be unpickled in the sandbox: {err!r} (a worker reads Python's installation and "
            "the modules of the functions its sandbox was prepared with, no others)"
        )
    if isinstance(task, EpisodeOp):
        return read_answer(episodes.answer(task, lifeline_fd))
    fn, args, kwargs = task
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the call's own process
        _run_child(fn, args, kwargs, writer, limits)
    os.close(writer)
    spared = episodes.groups()
    answer = _collect(pid, Connection(reader, writable=False), lifeline_fd, spared)
    _sweep(scratch, spared)
    return read_answer(answer)


def read_answer(answer: bytes) -> tuple[str, Any]:
    """A call's answer as data; a ``failed`` one where its process wrote bytes of its own."""
    try:
        return decoded(answer)
    except ValueError as err:
        return "failed", f"answered out of form: {err}"


def _run_child(fn: Any, args: tuple, kwargs: dict[str, Any], writer: int, limits: dict[str, Any]) -> None:
    """Run the call under its limits, holding no descriptor of the worker's and (under a root
    trainer) as nobody, and write its answer; never returns."""
    code = 0
    try:
        used = os.sysconf("SC_PAGE_SIZE") * int(open("/proc/self/statm").read().split()[0])
        enter_call(writer, limits["drop_to"])
        memory = used + (limits["memory_mb"] << 20)  # the call's own allowance above the worker's
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu = int(limits["cpu_seconds"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
        answer = encoded("ok", awaited(fn(*args, **kwargs)))
    except (SystemExit, KeyboardInterrupt) as err:
        answer = failed(f"raised {err!r} from its own code")
    except BaseException as err:
        answer = raised(err)
    try:
        Connection(writer, readable=False).send_bytes(answer)
    except BaseException:
        code = 1
    os._exit(code)


def _collect(pid: int, conn: Connection, lifeline_fd: int, spared: set[int]) -> bytes:
    """The child's answer, or a ``failed`` answer saying how it died; ``conn`` is closed."""
    with conn:
        return _wait_for(pid, conn, lifeline_fd, spared)


def _wait_for(pid: int, conn: Connection, lifeline_fd: int, spared: set[int]) -> bytes:
    reader, status = conn.fileno(), None
    while status is None:
        ready, _, _ = select.select([reader, lifeline_fd], [], [], POLL_SECONDS)
        if lifeline_fd in ready:
            os._exit(0)
        if reader in ready:
            answer = receive(conn)
            if answer is not None:
                os.kill(pid, signal.SIGKILL)  # it answered: whatever it does now does not count
                os.waitpid(pid, 0)
                return answer
        done, status = os.waitpid(pid, os.WNOHANG)
        status = status if done else None
    _kill_others(spared)  # a descendant may hold the pipe open
    if conn.poll(0):
        answer = receive(conn)
        if answer is not None:
            return answer
    return failed(death(status))


def _kill_others(spared: set[int] = frozenset()) -> None:
    """Kill every process of this pid namespace but the worker (its first) and the process groups
    ``spared`` (its episodes'), and reap them."""
    me, killed = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            if os.getpgid(pid) not in spared:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        except ProcessLookupError:
            pass
    while killed:  # reap the killed (each is the worker's child, or becomes one when its parent dies)
        try:  # with no episode alive every child left is a killed one: wait for the next to die
            pid, _ = os.waitpid(-1, os.WNOHANG if spared else 0)
        except ChildProcessError:
            return
        if pid:
            killed.discard(pid)
            continue
        killed = {pid for pid in killed if _running(pid)}
        time.sleep(0.001)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (one a spared episode's process will reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _sweep(scratch: str, spared: set[int] = frozenset()) -> None:
    """After a call: no process it started and no file it wrote is left (the episodes' are)."""
    _kill_others(spared)
    for entry in os.listdir(scratch):
        if entry.startswith(FOLDER_PREFIX):
            continue
        path = os.path.join(scratch, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


@dataclass
class PythonRun:
    """What a fresh interpreter did with a program: its exit code (negative: the signal that
    killed it), its output, and whether it ran past its time."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def run_python(source: str, stdin: str = "", timeout: float = 5.0, memory_mb: int = 512) -> PythonRun:
    """Run ``source`` (text: data, written to a file and never evaluated here) in a fresh, isolated
    interpreter (``python -I -S``) started from a sandboxed call, in the call's scratch folder,
    with ``stdin`` as its input, its address space capped at ``memory_mb`` and its reads narrowed
    by Landlock to the Python installation and that folder. It is killed with every process it
    started after ``timeout`` seconds. Only inside a sandbox worker (RuntimeError elsewhere)."""
    if WORKER_MARK not in os.environ:
        raise RuntimeError("run_python runs a program only inside a sandbox worker (sandbox: process)")
    scratch = os.getcwd()
    path = os.path.join(scratch, "program.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    executable = os.path.realpath(sys.executable)
    readable = [sys.base_prefix, os.path.dirname(executable), "/usr/lib", "/lib", "/lib64", "/proc"]

    def confine() -> None:  # in the child, before the program's interpreter starts
        memory = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        restrict(readable, [scratch], DEVICE_FILES)

    process = subprocess.Popen(
        [executable, "-I", "-S", path],
        cwd=scratch,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=confine,
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        out, err = process.communicate(stdin, timeout=timeout)
        return PythonRun(process.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return PythonRun(process.returncode, out, err, True)
