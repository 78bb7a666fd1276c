"""The trainer's HTTP calls to its rollout servers: one aiohttp session on an event loop of its own
(a thread), so that the synchronous training step and the asynchronous pipeline both reach every
server at once.

A call that cannot reach its server (refused, reset, timed out, or a server that stops answering
its liveness probe while it samples) is :class:`ServerDown`: the caller marks the server dead and
sends its prompts elsewhere. A server that answers with an error is :class:`ServerError`: the
server is alive and the request is wrong (the door's secret, a malformed message), so nothing is
resent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from forge_lightning.serving.wire import (
    GenerateAnswer,
    GenerateCall,
    Health,
    Info,
    auth_header,
)

T = TypeVar("T")

# What a dead or unreachable server raises at the client: each means its requests go elsewhere.
UNREACHABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError, ConnectionError, OSError)


class ServerDown(Exception):
    """A server that cannot be reached, or stopped answering (what happened, in words)."""


class ServerError(RuntimeError):
    """A live server refused a request: its one-line error, with the server's name."""


@dataclass
class Server:
    """One rollout server as the trainer sees it: where it is, the name a warning uses, whether it
    still counts, and the completion tokens this process has asked of it and not yet received."""

    address: str  # host:port
    name: str  # e.g. "local:1 (127.0.0.1:40123)" or "node7:8000"
    alive: bool = True
    outstanding: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.address}"


class EventLoop:
    """An asyncio loop running in a daemon thread; coroutines are handed to it from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="forge-servers", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.submit(coroutine).result()

    def close(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class Connection:
    """The HTTP calls of the plan's messages (serving/wire.py) to any server, through the door.

    ``probe_timeout_s``: how long a liveness probe (``/health``, ``/info``) may take;
    ``probe_every_s``: how often a server that is sampling for us is probed meanwhile (a request
    itself may rightly take minutes: it waits for its weights, and for its tokens)."""

    def __init__(self, secret: str, probe_timeout_s: float = 5.0, probe_every_s: float = 2.0) -> None:
        self.headers = auth_header(secret)
        self.probe_timeout_s = probe_timeout_s
        self.probe_every_s = probe_every_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use, inside the loop that uses it (aiohttp binds a session to its loop).
        if self._session is None or self._session.closed:
            # No pool limit: every part of a request is its own long call, with probes beside them.
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            self._session = aiohttp.ClientSession(headers=self.headers, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(
        self, server: Server, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        """``method path`` on ``server``, its JSON answer; ServerDown or ServerError."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._client().request(method, server.url + path, json=body, timeout=timeout) as r:
                data = await r.json(content_type=None)
                status = r.status
        except UNREACHABLE as err:
            raise ServerDown(f"{path}: {type(err).__name__}: {err}".rstrip(": ")) from None
        except (aiohttp.ContentTypeError, ValueError) as err:
            raise ServerError(f"rollout server {server.name} answered {path} with no JSON: {err}") from None
        if status >= 400:
            error = data.get("error") if isinstance(data, dict) else data
            raise ServerError(f"rollout server {server.name} refused {method} {path} ({status}): {error}")
        return data

    async def health(self, server: Server) -> Health:
        data = await self.call(server, "GET", "/health", timeout_s=self.probe_timeout_s)
        return Health.from_json(data)

    async def info(self, server: Server) -> Info:
        return Info.from_json(await self.call(server, "GET", "/info", timeout_s=self.probe_timeout_s))

    async def generate(self, server: Server, call: GenerateCall) -> GenerateAnswer:
        """``call`` sampled by ``server``, probed every ``probe_every_s`` while it samples: a
        server that stops answering its probe is ServerDown at once, its call abandoned."""
        task = asyncio.ensure_future(self.call(server, "POST", "/generate", call.to_json()))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.probe_every_s)
                if done:
                    return GenerateAnswer.from_json(task.result())
                await self.health(server)  # ServerDown ends the wait
        finally:
            task.cancel()
