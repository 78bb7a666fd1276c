"""A small rollout server for the client's tests: a real aiohttp server on 127.0.0.1 (a free port,
its loop in a thread of the test) that speaks serving/wire.py's messages through the door, and
samples without a model.

Each completion row is drawn from the request's own generator (its ``rng_state``, or its
``seed``): a length from 2 to ``max_new_tokens``, then the ids after the first; a row shorter than
``max_new_tokens`` ends with EOS. The first token of every row is its prompt's first token, so a
test can tell which prompt a row answers. Weight pushes are received for real
(serving/weights.py) into ``model``, so a test can compare them with the trainer's.

``fail``: how the next ``/generate`` calls fail: ``"abort"`` cuts the connection mid-request (a
killed server), ``"hang"`` never answers them nor the probes after (a stopped one).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable
from typing import Any

import torch
from aiohttp import web

from forge_lightning.serving.weights import SERVER_RANK, open_group, receive_parameters
from forge_lightning.serving.wire import (
    GenerateAnswer,
    GenerateCall,
    GroupCall,
    Health,
    Info,
    UpdateCall,
    authorized,
    decode_rng_state,
    encode_rng_state,
    error_body,
    fingerprint,
    parameter_specs,
)


class FakeRolloutServer:
    """A started fake server for ``model`` and ``tokenizer``, behind ``secret``."""

    def __init__(self, model: Any, tokenizer: Any, secret: str, version: int = -1) -> None:
        self.model, self.tokenizer, self.secret = model, tokenizer, secret
        self.version = version
        self.calls: list[GenerateCall] = []  # every /generate call, in order
        self.updates: list[int] = []  # the versions pushed, in order
        self.fail: str | None = None
        self._group: Any = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        app = web.Application(middlewares=[self._door])
        app.router.add_get("/info", self._info)
        app.router.add_get("/health", self._health)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/weights/group", self._join)
        app.router.add_post("/weights/update", self._update)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        self._run(self._start(sock))
        self._changed = self._run(self._condition())

    async def _start(self, sock: socket.socket) -> None:
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()

    async def _condition(self) -> asyncio.Condition:
        return asyncio.Condition()

    def _run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    @web.middleware
    async def _door(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not authorized(request.headers.get("Authorization"), self.secret):
            return web.json_response(error_body("wrong or missing secret"), status=401)
        return await handler(request)

    async def _info(self, request: web.Request) -> web.Response:
        specs = parameter_specs(self.model.named_parameters())
        info = Info(fingerprint(self.model, self.tokenizer), self.version, specs)
        return web.json_response(info.to_json())

    async def _health(self, request: web.Request) -> web.Response:
        if self.fail == "hang":
            await asyncio.sleep(3600)
        return web.json_response(Health(self.version).to_json())

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        call = GenerateCall.from_json(await request.json())
        self.calls.append(call)
        if self.fail == "abort":
            request.transport.abort()  # the connection dies mid-request, as with a killed server
            return web.Response()
        if self.fail == "hang":
            await asyncio.sleep(3600)
        async with self._changed:
            await self._changed.wait_for(lambda: self.version >= call.min_version)
        return web.json_response(self.sample(call).to_json())

    def sample(self, call: GenerateCall) -> GenerateAnswer:
        generator = torch.Generator()
        if call.rng_state is not None:
            generator.set_state(decode_rng_state(call.rng_state))
        else:
            generator.manual_seed(call.seed or 0)
        eos, top = self.tokenizer.eos_token_id, len(self.tokenizer)
        most = call.params.max_new_tokens
        rows = []
        for prompt in call.prompts:
            for _ in range(call.group_size):
                length = int(torch.randint(2, most + 1, (), generator=generator))
                row = [prompt[0], *torch.randint(4, top, (length - 1,), generator=generator).tolist()]
                rows.append(row[:-1] + [eos] if length < most else row)
        return GenerateAnswer(
            request_id=call.request_id,
            completions=rows,
            logp=[[-0.5] * len(r) for r in rows] if call.logprobs else None,
            versions=[[self.version] * len(r) for r in rows],
            truncated=[len(r) == most and r[-1] != eos for r in rows],
            rng_state=None if call.rng_state is None else encode_rng_state(generator.get_state()),
        )

    async def _join(self, request: web.Request) -> web.Response:
        call = GroupCall.from_json(await request.json())
        self._group = await asyncio.to_thread(
            open_group, call.store_host, call.store_port, call.prefix, SERVER_RANK, call.timeout_s
        )
        return web.json_response({})

    async def _update(self, request: web.Request) -> web.Response:
        call = UpdateCall.from_json(await request.json())
        names = [name for name, _ in self.model.named_parameters()]
        await asyncio.to_thread(receive_parameters, self._group, self.model, names)
        async with self._changed:
            self.version = call.version
            self.updates.append(call.version)
            self._changed.notify_all()
        return web.json_response({"version": self.version})

    def stop(self) -> None:
        """Close the server (its port then refuses connections) and end its thread; twice is once."""
        if self.thread.is_alive():
            self._run(self.runner.cleanup())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()
