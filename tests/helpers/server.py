"""A real local HTTP server for rewards scored over HTTP: aiohttp on 127.0.0.1, an ephemeral port,
its event loop in a thread of the test."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

# A handler gets the request's JSON body and the number of the request (0 for the first) and
# returns the answer: a JSON-able value (HTTP 200), or a web.Response of its own.
Handler = Callable[[Any, int], Awaitable[Any]]


class LocalServer:
    """One aiohttp app answering POSTs to ``path`` with ``handler``; ``requests`` holds each
    request's JSON body and ``headers`` its headers, in order."""

    def __init__(self, handler: Handler, path: str) -> None:
        self.handler, self.requests, self.headers = handler, [], []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}{path}"
        app = web.Application()
        app.router.add_post(path, self._answer)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)  # a stalled handler is cut at stop
        self._run(self._start(sock))

    async def _start(self, sock: socket.socket) -> None:
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        answer = await self.handler(body, len(self.requests) - 1)
        return answer if isinstance(answer, web.StreamResponse) else web.Response(text=json.dumps(answer))

    def _run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    def stop(self) -> None:
        """Close the server (its port then refuses connections) and end its thread; twice is once."""
        if self.thread.is_alive():
            self._run(self.runner.cleanup())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()
