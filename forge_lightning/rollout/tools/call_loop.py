"""Running many tool calls at once: the calls of every row that waits for a tool, and every call
of one turn, at most ``max_parallel`` at a time, each within its time limit; the answers come back
in the order the calls were written. The calls on one environment (its methods, bound to it) run
one at a time in that order, so that its state changes as written.

The calls are tasks of one event loop, in a daemon thread of its own started on first use, which
only schedules them and keeps their time: each call is tools/function_call.py's
:func:`~forge_lightning.rollout.tools.function_call.invoke` (the one place a tool is called), under the
semaphore and the time limit, and runs elsewhere: a sync tool in a thread of its own, an ``async
def`` one on an event loop of its own (tools/event_loops.py: calls one after another share one,
calls at once never do). So a tool that blocks (a ``time.sleep`` in a coroutine too) holds only
its own call. The caller's thread only waits, so a signal (Ctrl-C, a preemption's SIGTERM) still
stops the run while tools run. A call past its time limit is abandoned and answered with an error:
an async tool is cancelled where it awaits; a thread cannot be killed, so in this process (``sandbox:
thread``) the call's thread runs on until the tool returns, counted (``tool_threads_abandoned``)
and warned about once per process; ``sandbox: process`` kills such a call with its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from forge_lightning.rollout.tools.event_loops import EventLoops
from forge_lightning.rollout.tools.function_call import Job, Outcome, failure, invoke
from forge_lightning.run.user_code import warn_thread_abandoned

T = TypeVar("T")
# The calls that run at once where nothing says otherwise (the module's max_parallel_tool_calls).
MAX_PARALLEL_CALLS = 16


class CallLoop:
    """Runs batches of :class:`~forge_lightning.rollout.tools.function_call.Job` on its event loop.

    Args:
        max_parallel: the calls that run at once; the others wait their turn.
        timeout: seconds one call may take once it runs (None: no limit).
        max_chars: the characters of a result the model reads.
    """

    def __init__(
        self, max_parallel: int = MAX_PARALLEL_CALLS, timeout: float | None = 10.0, max_chars: int = 10_000
    ):
        if not isinstance(max_parallel, int) or max_parallel < 1:
            raise ValueError(f"max_parallel_tool_calls must be an integer >= 1, got {max_parallel!r}")
        self.max_parallel, self.timeout, self.max_chars = max_parallel, timeout, max_chars
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._tool_loops = EventLoops()

    def run(self, jobs: Sequence[Job]) -> list[Outcome]:
        """Each job's answer (text, ok, cut, abandoned), in the order given."""
        return self.wait(self._all(jobs)) if jobs else []

    def awaited(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s value (an environment's async reset), awaited where the async tools
        await (so that what it starts is on the loop its environment's calls one after another
        share) while this thread waits."""
        return self.wait(self._tool_loops.run(awaitable))

    def wait(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s value, awaited on the loop while this thread waits."""
        future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._started())
        try:
            return future.result()
        finally:
            future.cancel()  # a signal stopped the wait: what has not started never does

    async def _all(self, jobs: Sequence[Job]) -> list[Outcome]:
        semaphore = asyncio.Semaphore(self.max_parallel)
        # One lock per environment: its calls take it in the order written (asyncio.Lock is FIFO).
        locks = {id(job.owner): asyncio.Lock() for job in jobs if job.owner is not None}
        own = [locks[id(job.owner)] if job.owner is not None else contextlib.nullcontext() for job in jobs]
        return list(await asyncio.gather(*(self._one(job, semaphore, lock) for job, lock in zip(jobs, own))))

    async def _one(self, job: Job, semaphore: asyncio.Semaphore, lock: Any) -> Outcome:
        """One call's answer; its time limit runs from when it starts, not while it waits its turn
        (behind the calls on its environment, then for a free place)."""
        async with lock, semaphore:
            task = asyncio.ensure_future(invoke(job, self.max_chars, self._tool_loops))
            try:
                # asyncio.wait, not wait_for: a TimeoutError the tool raises is its own failure.
                done, _ = await asyncio.wait({task}, timeout=self.timeout)
            finally:
                if not task.done():  # past its time, or the whole batch was cancelled
                    task.cancel()
            if not done:
                return self._abandoned(job)
            try:
                text, cut = task.result()
            except Exception as err:  # the tool's own failure: the model reads it, the run goes on
                return failure(job.name, err, self.max_chars)
            return Outcome(text, True, cut)

    def _abandoned(self, job: Job) -> Outcome:
        """The answer of ``job``, abandoned at its time limit: where it ran in this process, its
        thread runs on (counted, and warned about once per process)."""
        text = f"error: {job.name} took longer than {self.timeout:g}s"
        if job.isolated:  # its worker kills it
            return Outcome(text, False, False)
        warn_thread_abandoned("tool", "tool_timeout", "each is counted in tool_threads_abandoned")
        return Outcome(text, False, False, abandoned=True)

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tool calls", daemon=True).start()
                self._loop = loop
            return self._loop

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a deepcopy of the sampler, a pickle) starts loops of its own when it first runs.
        return {**self.__dict__, "_loop": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable
