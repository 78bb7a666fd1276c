"""The rollout server's HTTP side: an aiohttp app over one decode loop (serving/decode.py).

Every endpoint is behind the door (``Authorization: Bearer <secret>``, compared in constant time;
401 otherwise); bodies are JSON decoded by serving/wire.py, and every error is ``{"error": "<one
line>"}``. The decode loop runs on a thread of its own and owns the model; the handlers only queue
work for it and await the answer, so requests from several trainers meet in one decode batch.

``RolloutServer(model, tokenizer, secret).start(host, port)`` runs both threads in the background
(tests, or a process that does other things); ``forge-lightning serve`` (cli/serve.py) starts one
and waits.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import torch.distributed as dist
from aiohttp import web
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.serving import weights
from forge_lightning.serving.decode import DecodeLoop, UpdateUnderWay
from forge_lightning.serving.wire import (
    MAX_BODY_BYTES,
    SECRET_ENV,
    GenerateCall,
    GroupCall,
    Health,
    Info,
    UpdateAnswer,
    UpdateCall,
    WireError,
    authorized,
    error_body,
    fingerprint,
    parameter_specs,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def secret_from(environ: dict[str, str] | Any) -> str:
    """The door's secret from ``environ``; ValueError saying what to set where there is none."""
    secret = environ.get(SECRET_ENV, "")
    if not secret:
        raise ValueError(
            f"{SECRET_ENV} is not set: set it to the secret the trainer is given (the same value on both "
            "sides; e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secret


class RolloutServer:
    """The app, its decode loop and the weight group the trainer opens (``POST /weights/group``).

    ``loop``: what samples, when not the decode loop over ``model`` (serving/vllm_loop.py's
    ``VLLMLoop``, built over the same model).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        secret: str,
        version: int = 0,
        loop: DecodeLoop | None = None,
    ) -> None:
        if not secret:
            raise ValueError(f"the rollout server needs a secret: set {SECRET_ENV}")
        self.secret = secret
        self.loop = loop or DecodeLoop(model, tokenizer, version)
        self.fingerprint = fingerprint(model, tokenizer)
        self.parameters = parameter_specs(model.named_parameters())
        self.group: dist.ProcessGroup | None = None
        self.url = ""
        self._stop = threading.Event()
        self._decode_thread = threading.Thread(target=self.loop.run, args=(self._stop,), daemon=True)
        self._events = asyncio.new_event_loop()
        self._http_thread = threading.Thread(target=self._events.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    # --- running --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._door, _errors])
        app.router.add_get("/info", self._info)
        app.router.add_get("/health", self._health)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/weights/group", self._group)
        app.router.add_post("/weights/update", self._update)
        return app

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port) in the background; the server's URL."""
        sock = socket.create_server((host, port))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self._decode_thread.start()
        self._http_thread.start()
        self._runner = web.AppRunner(self.app(), shutdown_timeout=1.0)
        asyncio.run_coroutine_threadsafe(self._listen(sock), self._events).result(timeout=30)
        return self.url

    async def _listen(self, sock: socket.socket) -> None:
        assert self._runner is not None
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop listening and stop the decode loop, giving requests under way and the loop's step
        up to ``grace_s`` each to finish (a request whose client died may never finish)."""
        self._stop.set()
        with self.loop.lock:  # wake the loop if it waits for work
            self.loop.lock.notify_all()
        if self._runner is not None:
            cleanup = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._events)
            try:
                cleanup.result(timeout=grace_s)
            except TimeoutError:
                log.warning("requests still under way after %.0f s: stopping without them", grace_s)
        self._events.call_soon_threadsafe(self._events.stop)
        if self._decode_thread.is_alive():
            self._decode_thread.join(timeout=grace_s)

    def stop_soon(self) -> None:
        """Make :meth:`wait` return (all a signal handler may do)."""
        self._stop.set()

    def wait(self) -> None:
        """Block until :meth:`stop` (from a signal handler, say)."""
        self._stop.wait()

    # --- the door -------------------------------------------------------------------------------

    @web.middleware
    async def _door(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not authorized(request.headers.get("Authorization"), self.secret):
            return web.json_response(
                error_body(f"unauthorized: send Authorization: Bearer <the {SECRET_ENV} secret>"), status=401
            )
        return await handler(request)

    # --- endpoints ------------------------------------------------------------------------------

    async def _info(self, request: web.Request) -> web.Response:
        info = Info(self.fingerprint, self.loop.version, self.parameters, engine=self.loop.name)
        return web.json_response(info.to_json())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(Health(**self.loop.health()).to_json())

    async def _generate(self, request: web.Request) -> web.Response:
        call = GenerateCall.from_json(await _json(request))
        answer = await asyncio.wrap_future(self.loop.submit(call))
        return web.json_response(answer.to_json())

    async def _group(self, request: web.Request) -> web.Response:
        call = GroupCall.from_json(await _json(request))
        # Returns once the trainer's end has joined too (it opens it meanwhile).
        self.group = await asyncio.to_thread(
            weights.open_group,
            call.store_host,
            call.store_port,
            call.prefix,
            weights.SERVER_RANK,
            call.timeout_s,
        )
        return web.json_response({})

    async def _update(self, request: web.Request) -> web.Response:
        call = UpdateCall.from_json(await _json(request))
        future = self.loop.update(call.version, self._loader(call))
        version = await asyncio.wrap_future(future)
        return web.json_response(UpdateAnswer(version).to_json())

    def _loader(self, call: UpdateCall) -> Callable[[PreTrainedModel], Any]:
        """What the decode loop runs, paused, to load ``call``'s weights into the model."""
        if call.via == "disk":
            path = call.path
            assert path is not None  # UpdateCall.from_json checked it
            return lambda model: weights.load_folder(model, path)
        group = self.group
        if group is None:
            raise WireError("no weight group: POST /weights/group before /weights/update via 'group'")
        names = [p.name for p in self.parameters]
        return lambda model: weights.receive_parameters(group, model, names)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise WireError("the body is not JSON") from None


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as ``{"error": ...}``: 400 for a request the server cannot take, 500 else."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        return web.json_response(error_body(f"{err.status} {err.reason}: {request.path}"), status=err.status)
    except (WireError, ValueError) as err:
        return web.json_response(error_body(str(err)), status=400)
    except UpdateUnderWay as err:
        return web.json_response(error_body(str(err)), status=409)
    except Exception as err:
        log.exception("rollout server: %s failed", request.path)
        return web.json_response(error_body(f"{type(err).__name__}: {err}"), status=500)
