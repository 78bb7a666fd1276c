"""Event loops for ``async def`` tools: each call that runs at once awaits on a loop of its own, in
a daemon thread of its own, so that a coroutine that blocks its loop (a ``time.sleep`` inside it)
holds only its own call, which times out like a blocked sync call.

A call takes a loop no other call is using, the one given back last (calls one after another
share a loop, as an environment's do, its reset's among them), or a new one where every loop is
busy: there are as many loops as calls ran at once. A call abandoned at its timeout takes its loop
with it: the call is cancelled there and the loop stops once the call lets it (at once where it
awaits, when the blocking code returns where it blocks), never to be taken again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

from forge_lightning.run.user_code import UserCodeExit

T = TypeVar("T")


class EventLoops:
    """The loops async tool calls await on (module docstring)."""

    def __init__(self) -> None:
        self._free: list[asyncio.AbstractEventLoop] = []
        self._lock = threading.Lock()

    async def run(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s value, awaited on a loop of its own while the caller's loop goes on. A
        SystemExit or KeyboardInterrupt it raises is its own (:class:`UserCodeExit`): no signal
        reaches a thread but the main one. Cancelled (a timeout), it abandons its loop."""
        loop = self._take()
        future = asyncio.run_coroutine_threadsafe(_own_exits(awaitable), loop)
        try:
            value = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # the call is cancelled on its loop, which stops after it
            if not loop.is_closed():
                loop.call_soon_threadsafe(loop.stop)
            raise
        except BaseException:
            self._give_back(loop)
            raise
        self._give_back(loop)
        return value

    def _take(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            while self._free:
                loop = self._free.pop()
                if loop.is_running():  # not one whose thread ended (a task left on it raised SystemExit)
                    return loop
        loop = asyncio.new_event_loop()
        threading.Thread(target=_serve, args=(loop,), name="async tool calls", daemon=True).start()
        return loop

    def _give_back(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._free.append(loop)

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a deepcopy of the sampler, a pickle) starts loops of its own when it first runs.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """Run ``loop`` until it is stopped, then cancel what still runs on it and close it."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _own_exits(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as err:  # raised out of run_forever, they would end the loop
        raise UserCodeExit(f"raised {err!r} from its own code (no signal did)") from err
