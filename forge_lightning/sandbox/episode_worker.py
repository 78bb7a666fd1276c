"""A sandbox worker's episodes (``sandbox: process`` with an ``environment_factory``): each
episode's environment lives in a process of its own, forked by the worker (sandbox/worker.py)
when the episode opens and kept until it is released, so that its state lasts from one call to
the next while no two episodes share any.

An episode's process leads a process group of its own (what it starts joins it), works in a folder
of its own in the worker's scratch folder, and may add ``memory_mb`` to the worker's address space
for its whole life; each call gets ``cpu_seconds`` more CPU time. The worker's sweep after a plain
call spares the episodes' groups and folders. A call past its timeout, a crash or an exit of its
process ends the episode (its group killed, its folder removed): its later calls answer with why.
The worker runs one message at a time, so the episodes it holds take turns; the trainer also
kills the whole worker when one does not answer a little after its timeout.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import resource
import select
import shutil
import signal
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any, Literal

from forge_lightning.sandbox.frames import awaited, death, encoded, failed, raised, receive
from forge_lightning.sandbox.isolation import enter_call

# The folder of episode N in the worker's scratch folder (the sweep after a plain call spares it).
FOLDER_PREFIX = ".episode-"


@dataclass(frozen=True)
class EpisodeOp:
    """A message to a worker about one of its episodes: ``open`` it (``payload``: the factory,
    then the method to call on the new environment, or None, and its keyword arguments) or
    ``call`` it (``payload``: the method's name and its keyword arguments), answered within
    ``timeout`` seconds; ``releases``: the episodes to end first (the trainer dropped them)."""

    kind: Literal["open", "call"]
    episode: int
    payload: tuple
    timeout: float
    releases: tuple[int, ...] = ()


@dataclass
class _Live:
    pid: int  # the episode's process, the leader of its group
    conn: Connection


class Episodes:
    """The episodes one worker holds, by id, and why each that failed ended.

    Args:
        scratch: the worker's scratch folder.
        limits: SandboxLimits' fields.
    """

    def __init__(self, scratch: str, limits: dict[str, Any]) -> None:
        self.scratch, self.limits = scratch, limits
        self.live: dict[int, _Live] = {}
        self.ended: dict[int, str] = {}

    def answer(self, op: EpisodeOp, lifeline_fd: int) -> bytes:
        """``op``'s answer frame: the value, the exception raised, or ``failed``/``timeout`` and why."""
        for episode in op.releases:
            self.end(episode)
            self.ended.pop(episode, None)
        if op.kind == "open":
            try:
                self._open(op.episode, op.payload)
            except OSError as err:  # no process to be had: the worker is at its processes' bound
                return failed(
                    f"could not start its episode's process ({err}): each open episode is a process "
                    f"of its worker, within the worker's bound of {self.limits['processes']} "
                    "processes; more sandbox_workers spread the episodes over more",
                )
        elif op.episode in self.ended:
            return failed(f"cannot run: its episode ended when {self.ended[op.episode]}")
        elif op.episode not in self.live:
            return failed("cannot run: its episode is not open in this worker")
        else:
            try:
                self.live[op.episode].conn.send_bytes(pickle.dumps(op.payload))
            except OSError:  # its process is gone: the reply says how
                pass
        return self._reply(op.episode, op.timeout, lifeline_fd)

    def groups(self) -> set[int]:
        """The process groups of the live episodes (the sweep spares them)."""
        return {live.pid for live in self.live.values()}

    def end(self, episode: int, why: str | None = None) -> None:
        """Kill the episode's process group and remove its folder; ``why`` is kept for its later calls."""
        live = self.live.pop(episode, None)
        if live is not None:
            try:
                os.killpg(live.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reaped(live.pid)
            live.conn.close()
        shutil.rmtree(os.path.join(self.scratch, f"{FOLDER_PREFIX}{episode}"), ignore_errors=True)
        if why is not None:
            self.ended[episode] = why

    def _open(self, episode: int, payload: tuple) -> None:
        mine, theirs = Pipe()
        pid = os.fork()
        if pid == 0:  # the episode's process: it never returns into the worker's loop
            try:
                os.setpgid(0, 0)
                enter_call(theirs.fileno(), self.limits["drop_to"])
                folder = os.path.join(self.scratch, f"{FOLDER_PREFIX}{episode}")
                os.makedirs(folder, exist_ok=True)
                os.chdir(folder)
                serve_episode(theirs, payload, self.limits)
            finally:
                os._exit(1)
        theirs.close()
        try:  # set here too: the parent may kill the group before the child has run
            os.setpgid(pid, pid)
        except OSError:
            pass
        self.live[episode] = _Live(pid, mine)

    def _reply(self, episode: int, timeout: float, lifeline_fd: int) -> bytes:
        live = self.live[episode]
        ready, _, _ = select.select([live.conn.fileno(), lifeline_fd], [], [], timeout)
        if lifeline_fd in ready:
            os._exit(0)  # the trainer is gone
        if not ready:
            self.end(episode, f"a call ran past its {timeout:g}s and was killed")
            return encoded("timeout", f"ran past its {timeout:g}s: its episode's process was killed")
        try:
            answer = receive(live.conn)
        except OSError:
            answer = None
        if answer is None:
            status = _reaped(live.pid)
            why = "ended without answering" if status is None else death(status)
            self.end(episode, f"its process {why}")
            return failed(f"ended its episode: its process {why}")
        return answer


def serve_episode(conn: Connection, payload: tuple, limits: dict[str, Any]) -> None:
    """An episode's process: make its environment (and call its first method, e.g. ``reset``),
    then answer each call on ``conn`` until the worker kills it; never returns."""
    used = os.sysconf("SC_PAGE_SIZE") * int(open("/proc/self/statm").read().split()[0])
    memory = used + (limits["memory_mb"] << 20)  # the episode's allowance above the worker's
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    loop = asyncio.new_event_loop()  # one per episode: an async method's client lasts from call to call
    factory, method, kwargs = payload
    environment: Any = None
    while True:
        try:
            _more_cpu(limits["cpu_seconds"])
            if environment is None:  # the first message: make the environment
                environment = factory()
            value = getattr(environment, method)(**kwargs) if method is not None else None
            answer = encoded("ok", awaited(value, loop))
        except (SystemExit, KeyboardInterrupt) as err:
            answer = failed(f"raised {err!r} from its own code")
        except BaseException as err:
            answer = raised(err)
        conn.send_bytes(answer)
        if environment is None:  # its factory failed: the episode is over
            os._exit(0)
        method, kwargs = pickle.loads(conn.recv_bytes())


def _more_cpu(seconds: int) -> None:
    """The CPU time used so far and ``seconds`` more as the soft limit (SIGXCPU past it): each
    call's own allowance, as a plain call's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + seconds
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _reaped(pid: int) -> int | None:
    """The exit status of the worker's child ``pid``, waited for; None where it is not a child
    (the worker's sweep reaped it already)."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None
