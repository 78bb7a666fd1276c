"""One sandbox worker process as the trainer holds it (sandbox/pool.py): started by
``unshare`` in its own namespaces (and, under root, a pids cgroup of its own), its pipes, its
scratch folder, its episodes (sandbox/episode_worker.py), and how it is killed; and what a sandboxed
call's failure is.

Each message carries a new id; the answer names it back. An answer is read as JSON data
(sandbox/frames.py), never unpickled: one that is not the sandbox's form, or that names
another call, means something in the worker spoke for it, and the worker is killed."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from forge_lightning.sandbox.frames import KINDS, MAX_ANSWER_BYTES
from forge_lightning.sandbox.isolation import UNPRIVILEGED, pids_cgroup, remove_cgroup, started
from forge_lightning.sandbox.view import WorkerView
from forge_lightning.sandbox.worker import ID_BYTES, WORKER_MARK

# Seconds a new worker may take to start and import the prepared functions' modules.
START_TIMEOUT = 120.0
_SERVE = "from forge_lightning.sandbox.worker import serve; serve()"


class SandboxCallError(Exception):
    """A sandboxed call failed without an exception of its own: it exited, was killed by a signal,
    ran past its time, or what it returned cannot cross. An Exception: that call's failure, not the run's."""


class SandboxTimeout(SandboxCallError, TimeoutError):
    """A sandboxed call ran past its timeout and was killed with every process it started."""


class ForgedAnswer(SandboxCallError):
    """A worker's answer was not the sandbox's form, or named another call: something in the
    worker wrote on its answer pipe. The worker is killed; the call is an error."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of each sandboxed call."""

    memory_mb: int = 2048  # address space a call may add to its worker's
    cpu_seconds: int = 60  # CPU time of one call
    open_files: int = 256
    file_size_mb: int = 256  # the largest file a call may write
    processes: int = 64  # processes and threads of one worker, the call's among them


class WorkerProcess:
    """One worker process: its pipes, scratch folder and (under root) pids cgroup."""

    def __init__(self, limits: SandboxLimits, preload: bytes, view: WorkerView | None = None) -> None:
        view = view or WorkerView()
        self.episodes: set[int] = set()  # the episodes open in it
        self.releases: list[int] = []  # the episodes dropped since its last episode message
        self.gone: str | None = None  # why it was killed
        self.scratch = tempfile.mkdtemp(prefix="forge-sandbox-")
        root = os.geteuid() == 0
        if root:  # the calls run as nobody, who must write their folder
            os.chown(self.scratch, UNPRIVILEGED, UNPRIVILEGED)
        self.cgroup = pids_cgroup(limits.processes) if root else None
        task_r, task_w = os.pipe()
        answer_r, answer_w = os.pipe()
        self.lifeline_r, self.lifeline_w = os.pipe()
        passed = (task_r, answer_w, self.lifeline_r)
        setup = {
            "limits": asdict(limits),
            "drop_to": UNPRIVILEGED if root else None,
            "read": list(view.read),
            "list_only": list(view.list_only),
        }
        command = [sys.executable, "-c", _SERVE, *map(str, passed), self.scratch, json.dumps(setup)]
        try:
            self.process = started(
                command,
                self.cgroup,
                pass_fds=passed,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                cwd=self.scratch,
                env=worker_environment(self.scratch, view.environment()),
            )
        finally:
            for fd in passed:
                os.close(fd)
        self.tasks = Connection(task_w, readable=False)
        self.answers = Connection(answer_r, writable=False)
        try:
            kind, value = self.ask(preload, START_TIMEOUT)
        except BaseException as err:
            self.kill()
            if isinstance(err, (EOFError, OSError, TimeoutError)):
                raise SandboxCallError(
                    f"a sandbox worker did not start ({err!r}); its stderr says why"
                ) from err
            raise
        if kind != "ok":
            self.kill()
            raise SandboxCallError(f"a sandbox worker could not load the prepared functions: {value}")

    def take_releases(self) -> tuple[int, ...]:
        """The episodes dropped since the last message, to be ended before the next one."""
        taken = []
        while self.releases:
            taken.append(self.releases.pop())  # appended by a finalizer, in any thread
        return tuple(taken)

    def ask(self, frame: bytes, timeout: float) -> tuple[str, Any]:
        """Send one call (a pickle, which the worker reads), and wait at most ``timeout`` s for its
        answer (TimeoutError): ``(kind, value)``, read as JSON. :class:`ForgedAnswer` where the
        answer is not of the sandbox's form or names another call."""
        call = secrets.token_hex(ID_BYTES // 2).encode()
        self.tasks.send_bytes(call + frame)
        if not self.answers.poll(timeout):
            raise TimeoutError
        try:
            answer = self.answers.recv_bytes(MAX_ANSWER_BYTES + 4096)
        except OSError as err:  # longer than any answer the worker writes
            raise ForgedAnswer(f"its worker answered out of form ({err})") from None
        try:
            named, kind, value = json.loads(answer)
        except (ValueError, TypeError):
            raise ForgedAnswer("its worker's answer is not the sandbox's JSON") from None
        if named != call.decode() or kind not in KINDS:
            raise ForgedAnswer(
                "its worker's answer names another call: something in the worker wrote on its pipe"
            )
        return kind, value

    def kill(self) -> None:
        """Kill the worker's process group (``unshare``, the worker and so its pid namespace)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        for conn in (self.tasks, self.answers):
            conn.close()
        os.close(self.lifeline_w)
        remove_cgroup(self.cgroup)
        shutil.rmtree(self.scratch, ignore_errors=True)


def kill_all(workers: set[WorkerProcess]) -> None:
    """Kill each of ``workers``, and forget them."""
    for worker in list(workers):
        worker.kill()
    workers.clear()


# The variables every worker gets, not the trainer's: a locale, a PATH of the system's folders.
BASE_ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def worker_environment(scratch: str, crossing: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: none of the trainer's variables but ``crossing`` (those
    the run lets cross), :data:`BASE_ENVIRONMENT`, the trainer's ``sys.path`` (so that the
    user's modules import there as here) and the scratch folder as home and temporary folder."""
    paths = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    return {
        **BASE_ENVIRONMENT,
        **(crossing or {}),
        "PYTHONPATH": os.pathsep.join(paths),
        "TMPDIR": scratch,
        "HOME": scratch,
        "PYTHONDONTWRITEBYTECODE": "1",
        WORKER_MARK: "1",
    }
