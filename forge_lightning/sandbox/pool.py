"""A pool of sandboxed worker processes for user code (``sandbox: process``): each call of a
reward or a tool runs in a worker (sandbox/worker.py) under resource limits and a hard time
limit, and a call that hangs is killed with every process it started while the run goes on.

What holds, and by which mechanism (sandbox/isolation.py probes them once, when the first pool is
checked; a machine that lacks one is refused with the reason, never given a weaker sandbox):

- a worker is a fresh interpreter (never a fork of the trainer), started by ``unshare`` in new
  user, pid, network, mount and IPC namespaces: it sees no network, and when it dies every
  process it started dies with it (the kernel ends a pid namespace with its first process);
- Landlock: it reads only the Python installation, the system's folders and the user's modules
  (sandbox/view.py: never a run folder, nor a data file beside a module), and writes only its
  scratch folder (emptied after each call); the programs ``run_python`` starts read Python's
  installation alone;
- a seccomp filter (sandbox/seccomp.py): no socket can be made, connected, bound or sent to, a Unix
  one at a path included (a catchable PermissionError); a socket pair still works (asyncio);
- each call runs in a process that holds no descriptor of its worker's but its own answer pipe
  and, under a root trainer, as nobody (sandbox/isolation.py): a root-only file cannot be read;
- of the trainer's environment variables, only those ``env`` names cross (none by default);
- resource limits on each call: address space (``memory_mb``), CPU seconds, open files, file size;
- a bounded number of processes: ``RLIMIT_NPROC`` for a user that is not root; root ignores it,
  so under root each worker gets a ``pids`` cgroup of its own (cgroup v1 or v2) with that bound;
- a call past its timeout (:data:`DEFAULT_TIMEOUT` where none is set: never "wait for ever") is
  killed with its worker's whole process group (``os.killpg``); the next call gets a new worker.

Arguments cross into a worker as pickles (the trainer's own; :meth:`Sandbox.prepare` pickles the
functions up front, so that one which cannot cross, a lambda or a local function, is refused by
name at the start). What comes back is data (sandbox/frames.py): JSON, never unpickled, each
answer naming its call's id; a result that is not data is that call's error, a raised exception
comes back as its type's name and message (a built-in type as itself), and an answer out of form
or naming another call kills its worker.

A stateful environment's episode is sticky (:meth:`Sandbox.open_episode`, sandbox/episode_worker.py):
its environment is made in a process of one worker when the episode opens, every later call of
it goes to that process, and it ends when the trainer drops its handle. Episodes share the
``workers`` (each opens on the worker holding the fewest, so that a batch of them spreads over
all), and a worker runs one call at a time, its episodes' included: the number of workers is
still how many calls run at once. Each open episode is a process of its worker, within the worker's bound
of ``processes``; a dropped one is ended with the next episode message its worker gets (a step's
episodes end as the next step's open). A worker that dies, or is killed, takes its episodes with
it: their later calls fail with a :class:`SandboxCallError` naming why.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from forge_lightning.sandbox.episode import SandboxEpisode
from forge_lightning.sandbox.episode_worker import EpisodeOp
from forge_lightning.sandbox.frames import SandboxRaised, exception
from forge_lightning.sandbox.isolation import SandboxUnavailable, probe
from forge_lightning.sandbox.process import (
    ForgedAnswer,
    SandboxCallError,
    SandboxLimits,
    SandboxTimeout,
    WorkerProcess,
    kill_all,
)
from forge_lightning.sandbox.view import WorkerView, worker_view

__all__ = [
    "ForgedAnswer",
    "Sandbox",
    "SandboxCallError",
    "SandboxEpisode",
    "SandboxLimits",
    "SandboxRaised",
    "SandboxTimeout",
    "SandboxUnavailable",
    "probe",
]

log = logging.getLogger(__name__)

# Seconds a sandboxed call may take when the run sets no time limit for it.
DEFAULT_TIMEOUT = 60.0
# Seconds past an episode's call's timeout before the trainer kills its worker: the worker kills
# the episode's process itself at the timeout, and answers.
EPISODE_GRACE = 5.0


class Sandbox:
    """A pool of ``workers`` sandboxed processes (see the module's docstring), started on first use.

    Args:
        workers: processes, so calls that run at once (more wait for a free one).
        limits: what each call may use.
        env: the names of the trainer's environment variables that cross into the workers (an
            API key a reward needs); no other does.
    """

    def __init__(
        self, workers: int = 2, limits: SandboxLimits | None = None, env: Sequence[str] = ()
    ) -> None:
        if workers < 1:
            raise ValueError(f"a sandbox needs at least one worker, got {workers}")
        self.workers, self.limits, self.env = workers, limits or SandboxLimits(), tuple(env)
        self._preload = pickle.dumps((_noop, (), {}))
        self._view = worker_view([], self.env)
        self._idle: list[WorkerProcess] = []
        self._started = 0
        self._changed = threading.Condition()  # a worker came back, went, or did not start
        self._all: set[WorkerProcess] = set()
        self._episodes = itertools.count()
        self._finalizer = weakref.finalize(self, kill_all, self._all)

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
        self._view = worker_view(functions.values(), self.env)

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
        return self._ask(self._acquire(), frame, timeout, name)

    def open_episode(
        self,
        factory: Callable[[], Any],
        method: str | None,
        kwargs: dict[str, Any],
        timeout: float | None,
        name: str,
    ) -> tuple[SandboxEpisode, Any]:
        """A new episode, its environment made by ``factory()`` in a process of the worker that
        holds the fewest episodes, and the value of its ``method(**kwargs)`` (``reset``; None:
        none is called). Raises as :meth:`call` does, naming ``name``; ``timeout`` None is
        :data:`DEFAULT_TIMEOUT`."""
        worker = self._acquire(balance=True)
        episode = SandboxEpisode(self, worker, next(self._episodes), name)
        op = EpisodeOp(
            "open", episode.id, (factory, method, kwargs), _seconds(timeout), worker.take_releases()
        )
        return episode, self._ask_episode(worker, op, name)

    def call_episode(
        self, episode: SandboxEpisode, method: str, kwargs: dict[str, Any], timeout: float | None, name: str
    ) -> Any:
        """``method(**kwargs)`` of ``episode``'s environment, in its process; raises as :meth:`call`
        does, naming ``name``, and :class:`SandboxCallError` where the episode has ended."""
        worker = self._acquire(pinned=episode.worker, name=name)
        op = EpisodeOp("call", episode.id, (method, kwargs), _seconds(timeout), worker.take_releases())
        return self._ask_episode(worker, op, name)

    def _ask_episode(self, worker: WorkerProcess, op: EpisodeOp, name: str) -> Any:
        try:
            frame = pickle.dumps(op)
        except Exception as err:
            self._give_back(worker)
            raise TypeError(
                f"{name}: its arguments cannot cross into the sandbox (plain data only): {err}"
            ) from err
        return self._ask(worker, frame, op.timeout, name, EPISODE_GRACE)

    def _ask(self, worker: WorkerProcess, frame: bytes, timeout: float, name: str, grace: float = 0.0) -> Any:
        """Send ``frame`` to ``worker`` (acquired), give it back, and return the value or raise."""
        try:
            kind, value = worker.ask(frame, timeout + grace)
        except TimeoutError:
            self._discard(worker, f"{name} ran past {timeout:g}s")
            raise SandboxTimeout(
                f"{name} ran past its {timeout:g}s in the sandbox and was killed with every process "
                "it started"
            ) from None
        except ForgedAnswer as err:
            self._discard(worker, f"{name}: {err}")
            raise ForgedAnswer(f"{name}: {err}; its worker was killed") from None
        except (EOFError, OSError) as err:
            self._discard(worker, f"{name}: its worker died")
            raise SandboxCallError(f"{name}: its sandbox worker died ({err!r})") from None
        self._give_back(worker)
        if kind == "ok":
            return value
        if kind == "raised":
            raise exception(value)
        log.warning("sandboxed call %s %s", name, value)
        raise (SandboxTimeout if kind == "timeout" else SandboxCallError)(f"{name} {value}")

    def worker_pids(self) -> list[int]:
        """The host pids of the workers' ``unshare`` processes (each the leader of its group)."""
        return [worker.process.pid for worker in list(self._all)]

    def close(self) -> None:
        """Kill every worker; a later call starts new ones."""
        with self._changed:
            for worker in self._all:
                worker.gone = "the sandbox was closed"
            kill_all(self._all)
            self._idle = []
            self._started = 0
            self._changed.notify_all()

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (a deep-copied or pickled module's) starts workers of its own, never shares these.
        return (_unstarted, (self.workers, self.limits, self._preload, self.env, self._view))

    def _acquire(
        self, pinned: WorkerProcess | None = None, balance: bool = False, name: str = ""
    ) -> WorkerProcess:
        """``pinned`` once it is idle (SandboxCallError naming ``name`` where it is gone); else an
        idle worker, a new one while fewer than ``workers`` run, or the next one freed. With
        ``balance``, the worker that holds the fewest episodes (a new one while some hold none)."""
        with self._changed:
            while True:
                target = self._least_loaded() if balance else pinned
                if target is not None and target.gone is not None:
                    raise SandboxCallError(
                        f"{name}: its episode ended: its sandbox worker is gone ({target.gone})"
                    )
                if target is not None and target in self._idle:
                    self._idle.remove(target)
                    return target
                if target is None and self._idle and not balance:
                    return self._idle.pop()
                if target is None and self._started < self.workers:
                    self._started += 1
                    break
                self._changed.wait()
        try:
            worker = WorkerProcess(self.limits, self._preload, self._view)
        except BaseException:
            with self._changed:
                self._started -= 1
                self._changed.notify_all()
            raise
        self._all.add(worker)
        return worker

    def _least_loaded(self) -> WorkerProcess | None:
        """The live worker holding the fewest episodes; None (start one) while there is room and
        each holds some."""
        live = [worker for worker in self._all if worker.gone is None]
        if self._started < self.workers and all(worker.episodes for worker in live):
            return None
        return min(live, key=lambda worker: len(worker.episodes), default=None)

    def _give_back(self, worker: WorkerProcess) -> None:
        with self._changed:
            self._idle.append(worker)
            self._changed.notify_all()

    def _discard(self, worker: WorkerProcess, why: str) -> None:
        log.warning(
            "sandbox: %s; its worker (pid %d) was killed with its process group", why, worker.process.pid
        )
        worker.gone = why
        worker.kill()
        with self._changed:
            self._all.discard(worker)
            self._started -= 1
            self._changed.notify_all()


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


def _unstarted(
    workers: int,
    limits: SandboxLimits,
    preload: bytes,
    env: tuple[str, ...] = (),
    view: WorkerView | None = None,
) -> Sandbox:
    sandbox = Sandbox(workers, limits, env)
    sandbox._preload = preload
    sandbox._view = view or sandbox._view
    return sandbox


def _noop() -> None:
    return None


def _seconds(timeout: float | None) -> float:
    return DEFAULT_TIMEOUT if timeout is None else timeout


def _imported(functions: list[Any]) -> None:
    """Nothing: unpickling ``functions`` in the worker imported their modules."""
    return None
