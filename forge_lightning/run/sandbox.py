"""A pool of sandboxed worker processes for user code (``sandbox: process``): each call of a
reward or a tool runs in a worker (run/sandbox_worker.py) under resource limits and a hard time
limit, and a call that hangs is killed with every process it started while the run goes on.

What holds, and by which mechanism (run/isolation.py probes them once, when the first pool is
checked; a machine that lacks one is refused with the reason, never given a weaker sandbox):

- a worker is a fresh interpreter (never a fork of the trainer), started by ``unshare`` in new
  user, pid, network, mount and IPC namespaces: it sees no network, and when it dies every
  process it started dies with it (the kernel ends a pid namespace with its first process);
- Landlock: it reads only the Python installation, ``sys.path`` and the system's folders, and
  writes only its scratch folder (emptied after each call). A folder on ``sys.path`` is readable
  whole (the working directory, where it is on it): a run folder below one is readable by the
  reward's own code, not by the programs ``run_python`` starts (Python's installation only);
- resource limits on each call: address space (``memory_mb``), CPU seconds, open files, file size;
- a bounded number of processes: ``RLIMIT_NPROC`` for a user that is not root; root ignores it,
  so under root each worker gets a ``pids`` cgroup of its own (cgroup v1 or v2) with that bound;
- a call past its timeout (:data:`DEFAULT_TIMEOUT` where none is set: never "wait for ever") is
  killed with its worker's whole process group (``os.killpg``); the next call gets a new worker.

Arguments and results cross as pickles: :meth:`Sandbox.prepare` pickles the functions up front, so
that one which cannot cross (a lambda, a local function) is refused by name at the start.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from forge_lightning.run.isolation import (
    NAMESPACES,
    SandboxUnavailable,
    pids_cgroup,
    probe,
    remove_cgroup,
)
from forge_lightning.run.sandbox_worker import WORKER_MARK

__all__ = ["Sandbox", "SandboxCallError", "SandboxLimits", "SandboxTimeout", "SandboxUnavailable", "probe"]

log = logging.getLogger(__name__)

# Seconds a sandboxed call may take when its reward_timeout / tool_timeout is None.
DEFAULT_TIMEOUT = 60.0
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


class Sandbox:
    """A pool of ``workers`` sandboxed processes (see the module's docstring), started on first use.

    Args:
        workers: processes, so calls that run at once (more wait for a free one).
        limits: what each call may use.
    """

    def __init__(self, workers: int = 2, limits: SandboxLimits | None = None) -> None:
        if workers < 1:
            raise ValueError(f"sandbox_workers must be >= 1, got {workers}")
        self.workers, self.limits = workers, limits or SandboxLimits()
        self._preload = pickle.dumps((_noop, (), {}))
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def check(self) -> str:
        """The mechanism this machine gives (:func:`probe`); SandboxUnavailable naming what is missing."""
        return probe()

    def prepare(self, functions: dict[str, Any]) -> None:
        """Check that each of ``functions`` (by name, as a message would call it) crosses into a
        worker, refusing the first that does not by name; a new worker imports their modules
        before its first call, outside that call's time."""
        self.check()
        for name, fn in functions.items():
            refuse_unpicklable(fn, name)
        self._preload = pickle.dumps((_imported, (list(functions.values()),), {}))

    def call(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout: float | None, name: str
    ) -> Any:
        """``fn(*args, **kwargs)`` in a worker, its value back (awaited where it is a coroutine).
        Raises what the call raised, or :class:`SandboxCallError` / :class:`SandboxTimeout`
        naming ``name`` and the cause; ``timeout`` None is :data:`DEFAULT_TIMEOUT`."""
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        try:
            frame = pickle.dumps((fn, args, kwargs))
        except Exception as err:
            raise TypeError(
                f"{name}: its arguments cannot cross into the sandbox (plain data only): {err}"
            ) from err
        worker = self._acquire()
        try:
            kind, value = worker.ask(frame, timeout)
        except TimeoutError:
            self._discard(worker, f"{name} ran past {timeout:g}s")
            raise SandboxTimeout(
                f"{name} ran past its {timeout:g}s in the sandbox and was killed with every process "
                "it started"
            ) from None
        except (EOFError, OSError) as err:
            self._discard(worker, f"{name}: its worker died")
            raise SandboxCallError(f"{name}: its sandbox worker died ({err!r})") from None
        self._idle.put(worker)
        if kind == "ok":
            return value
        if kind == "raised":
            raise value
        log.warning("sandboxed call %s %s", name, value)
        raise SandboxCallError(f"{name} {value}")

    def worker_pids(self) -> list[int]:
        """The host pids of the workers' ``unshare`` processes (each the leader of its group)."""
        return [worker.process.pid for worker in list(self._all)]

    def close(self) -> None:
        """Kill every worker; a later call starts new ones."""
        with self._lock:
            _kill_all(self._all)
            self._idle = queue.Queue()
            self._started = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (a deep-copied or pickled module's) starts workers of its own, never shares these.
        return (_unstarted, (self.workers, self.limits, self._preload))

    def _acquire(self) -> _Worker:
        """An idle worker, a new one while fewer than ``workers`` run, else the next one freed."""
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                spawn = self._started < self.workers
                self._started += spawn
            if spawn:
                break
            try:  # a short wait: a worker killed meanwhile frees its place instead
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                continue
        try:
            worker = _Worker(self.limits, self._preload)
        except BaseException:
            with self._lock:
                self._started -= 1
            raise
        self._all.add(worker)
        return worker

    def _discard(self, worker: _Worker, why: str) -> None:
        log.warning(
            "sandbox: %s; its worker (pid %d) was killed with its process group", why, worker.process.pid
        )
        worker.kill()
        self._all.discard(worker)
        with self._lock:
            self._started -= 1


def refuse_unpicklable(fn: Any, name: str) -> None:
    """TypeError naming ``name`` where ``fn`` cannot be pickled (a lambda, a function defined in
    another function, an object holding a lock or a model)."""
    try:
        pickle.dumps(fn)
    except Exception as err:
        raise TypeError(
            f"{name} cannot run under sandbox: process: it cannot be pickled into a worker ({err}). "
            "Define it at the top level of a module (a lambda or a function defined inside another "
            "cannot cross), or set sandbox: thread"
        ) from err


def _unstarted(workers: int, limits: SandboxLimits, preload: bytes) -> Sandbox:
    sandbox = Sandbox(workers, limits)
    sandbox._preload = preload
    return sandbox


def _noop() -> None:
    return None


def _imported(functions: list[Any]) -> None:
    """Nothing: unpickling ``functions`` in the worker imported their modules."""
    return None


class _Worker:
    """One worker process: its pipes, scratch folder and (under root) pids cgroup."""

    def __init__(self, limits: SandboxLimits, preload: bytes) -> None:
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
            env=_worker_environment(self.scratch),
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


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()


def _worker_environment(scratch: str) -> dict[str, str]:
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
