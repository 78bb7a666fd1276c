"""One sandbox worker process as the trainer holds it (run/sandbox.py's pool): started by
``unshare`` in its own namespaces (and, under root, a pids cgroup of its own), its pipes, its
scratch folder, its episodes (run/episode_worker.py), and how it is killed; and what a sandboxed
call's failure is."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from forge_lightning.run.isolation import NAMESPACES, pids_cgroup, remove_cgroup
from forge_lightning.run.sandbox_worker import WORKER_MARK

# Seconds a new worker may take to start and import the prepared functions' modules.
START_TIMEOUT = 120.0
_SERVE = "from forge_lightning.run.sandbox_worker import serve; serve()"


class SandboxCallError(Exception):
    """A sandboxed call failed without an exception of its own: it exited, was killed by a signal,
    ran past its time, or what it returned cannot cross. An Exception: that call's failure, not the run's."""


class SandboxTimeout(SandboxCallError, TimeoutError):
    """A sandboxed call ran past its timeout and was killed with every process it started."""


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

    def __init__(self, limits: SandboxLimits, preload: bytes) -> None:
        self.episodes: set[int] = set()  # the episodes open in it
        self.releases: list[int] = []  # the episodes dropped since its last episode message
        self.gone: str | None = None  # why it was killed
        self.scratch = tempfile.mkdtemp(prefix="forge-sandbox-")
        self.cgroup = pids_cgroup(limits.processes) if os.geteuid() == 0 else None
        task_r, task_w = os.pipe()
        answer_r, answer_w = os.pipe()
        self.lifeline_r, self.lifeline_w = os.pipe()
        passed = (task_r, answer_w, self.lifeline_r)
        command = [sys.executable, "-c", _SERVE, *map(str, passed), self.scratch, json.dumps(asdict(limits))]
        command = ["unshare", *NAMESPACES, *command]
        if self.cgroup is not None:  # join the cgroup before anything else runs
            command = [
                "sh",
                "-c",
                'echo $$ > "$0" && exec "$@"',
                os.path.join(self.cgroup, "cgroup.procs"),
                *command,
            ]
        self.process = subprocess.Popen(
            command,
            pass_fds=passed,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.scratch,
            env=worker_environment(self.scratch),
        )
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
        """Send one call, and wait at most ``timeout`` s for its answer (TimeoutError)."""
        self.tasks.send_bytes(frame)
        if not self.answers.poll(timeout):
            raise TimeoutError
        return pickle.loads(self.answers.recv_bytes())

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


def worker_environment(scratch: str) -> dict[str, str]:
    """The worker's environment: the trainer's, with its ``sys.path`` (so that the user's modules
    import there as here) and the scratch folder as home and temporary folder."""
    paths = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "TMPDIR": scratch,
        "HOME": scratch,
        "PYTHONDONTWRITEBYTECODE": "1",
        WORKER_MARK: "1",
    }
