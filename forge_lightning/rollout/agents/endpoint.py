"""The policy as an OpenAI-compatible chat completions endpoint, for an agent's own client.

:class:`AgentEndpoint` is an aiohttp server bound to 127.0.0.1 on a free port, on a thread of its
own with its own asyncio loop; the agents run as coroutines on that loop. Any process of the
machine can reach that port, so the endpoint has a door: every request must carry
``Authorization: Bearer <api_key>``, a secret made per endpoint (:attr:`AgentEndpoint.api_key`)
that the agent's ``openai.AsyncOpenAI`` client carries as its ``api_key`` (runner.py); a request
without it, or with another, is answered 401 and touches no episode. Each episode has its own base
URL (:meth:`AgentEndpoint.base_url`, ``/episodes/<token>/v1``) named by a random token, not by its
key, so that knowing the key does not locate the episode (an unknown URL is answered 404); its
calls are recorded in its :class:`~forge_lightning.rollout.agents.episodes.EpisodeLog`. A
request's fields are checked first (chat_request.py): a wrong one is answered 400 naming it, in
OpenAI's error shape. A request becomes prompt ids there and waits in a queue;
:meth:`AgentEndpoint.serve`, run by the caller's thread (the trainer's, where the model lives),
gathers the requests (every running episode's, or those that came before a pause of
``GATHER_S``), samples them in one batch and answers each.

What the policy samples is data: its text goes back as the message's content, and a tool call in
it (in the run's call format, read as JSON by rollout/tools/parsers.py, never run) as the message's
``tool_calls``; the agent runs its tools. A request's sampling settings (temperature, top_p, stop,
...) are not used: the run's are, which the loss assumes. Its ``max_tokens`` (or
``max_completion_tokens``) lowers the episode's remaining budget; ``n`` > 1 and ``stream`` are refused.
A call past the budget is answered empty, cut for length, and counted with the refused ones
(``EpisodeLog.dropped``): every call answered is in a chain or counted.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.agents.chat_request import RequestError, chat_request
from forge_lightning.rollout.agents.episodes import Call, EpisodeLog, message_key
from forge_lightning.rollout.tools.parsers import ParsedCall, format_named

if TYPE_CHECKING:
    from aiohttp import web

MODEL_NAME = "policy"  # what /v1/models lists; a request's model name is not checked
# Seconds serve() waits for a request before it looks whether the agents are done.
POLL_S = 0.005
# Seconds a batch waits for another request while some running episode has none waiting (its agent
# may be between calls, running a tool): a batch goes once every running episode waits, or after
# this long without a new request.
GATHER_S = 0.05


@dataclass
class Pending:
    """A request waiting to be sampled: its prompt ids, the tokens it may sample, and where its
    answer goes (the completion ids and whether they end with an EOS)."""

    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def answer(self, result: tuple[list[int], bool] | BaseException) -> None:
        def put() -> None:
            if self.future.done():  # the request was cancelled: its client went away
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(put)


# Generation of a batch of requests: (prompt ids, max new tokens) each in, (completion ids, ended
# with an EOS) each out.
Generate = Callable[[list[Pending]], list[tuple[list[int], bool]]]


class AgentEndpoint:
    """A chat completions server for the episodes :meth:`open` registers; a context manager that
    starts it and stops it. ``api_key``: the secret every request must carry as a Bearer token.

    Args:
        tokenizer: the policy's, with a chat template.
        call_format: how the policy writes a tool call (a name in rollout/tools/parsers.py).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, call_format: str = "hermes") -> None:
        self.tokenizer = tokenizer
        self.format = format_named(call_format)
        self.api_key = secrets.token_urlsafe(32)
        self.logs: dict[str, EpisodeLog] = {}
        self._tokens: dict[str, str] = {}  # an episode's key -> the random part of its URL
        self._by_token: dict[str, EpisodeLog] = {}
        self.running = 0  # episodes opened and not ended (ended)
        self.requests: queue.Queue[Pending] = queue.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> AgentEndpoint:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-endpoint", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.loop is not None and self._thread is not None
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    async def _start(self) -> None:
        from aiohttp import web  # here: a run without an agent does not import it

        @web.middleware
        async def door(request: web.Request, handler: Callable) -> web.StreamResponse:
            if not self._authorized(request):
                return _error(401, "a request needs the endpoint's key: Authorization: Bearer <api_key>")
            return await handler(request)

        app = web.Application(middlewares=[door])
        app.router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{token}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # a free port, on this machine only
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    def open(self, key: str, max_new_tokens: int) -> EpisodeLog:
        """Register an episode; its calls go to ``base_url(key)``."""
        self.logs[key] = EpisodeLog(self.tokenizer, max_new_tokens, self.format)
        self._tokens[key] = secrets.token_urlsafe(16)
        self._by_token[self._tokens[key]] = self.logs[key]
        self.running += 1
        return self.logs[key]

    def ended(self, key: str) -> None:
        """Episode ``key``'s agent is done: a batch no longer waits for its calls."""
        self.running -= 1

    def base_url(self, key: str) -> str:
        """Episode ``key``'s base URL: a random token in it, not the key, names the episode."""
        return f"http://127.0.0.1:{self.port}/episodes/{self._tokens[key]}/v1"

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Future:
        """Run ``coroutine`` (the agents) on the endpoint's loop."""
        assert self.loop is not None, "use the endpoint as a context manager: with AgentEndpoint(...)"
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def serve(self, until: Future, generate: Generate) -> Any:
        """Sample the requests as they come, each batch every request waiting, in this thread,
        until ``until`` (the agents) is done; its result. An error of ``generate`` answers the
        batch's requests with a server error, stops the agents and is raised here."""
        while True:
            batch = self._waiting()
            if batch:
                try:
                    results = generate(batch)
                except BaseException as err:
                    for pending in batch:
                        pending.answer(err)
                    until.cancel()
                    raise
                for pending, result in zip(batch, results):
                    pending.answer(result)
            elif until.done():
                return until.result()

    def _waiting(self) -> list[Pending]:
        """The next batch: none if no request came within ``POLL_S``; else the requests until every
        running episode has one waiting, or none comes for ``GATHER_S``; and any more waiting."""
        try:
            batch = [self.requests.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        while len(batch) < self.running:
            try:
                batch.append(self.requests.get(timeout=GATHER_S))
            except queue.Empty:
                break
        while not self.requests.empty():
            batch.append(self.requests.get_nowait())
        return batch

    def _authorized(self, request: web.Request) -> bool:
        """Whether ``request`` carries this endpoint's key, compared in constant time."""
        sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(sent, f"Bearer {self.api_key}".encode())

    def _episode(self, request: web.Request) -> EpisodeLog | None:
        """The log of the episode whose URL ``request`` came to; None for an unknown URL."""
        return self._by_token.get(request.match_info["token"])

    async def _models(self, request: web.Request) -> web.Response:
        if self._episode(request) is None:
            return _error(404, "no episode is running at this URL")
        return _json({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        log = self._episode(request)
        if log is None:
            return _error(404, "no episode is running at this URL")
        try:
            ask = chat_request(await request.json())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON", log)
        except RequestError as err:
            return _error(400, str(err), log, err.param)
        try:
            prompt_ids, chain, shown = log.prompt(ask.messages, ask.tools)
        except ValueError as err:
            return _error(400, str(err), log, "messages")
        room = log.room(prompt_ids, chain)
        limit = room if ask.max_tokens is None else min(room, ask.max_tokens)
        if limit <= 0:  # the episode's budget is spent: an empty answer, cut for length (counted)
            log.spent(chain)
            return _json(_completion("", [], "length", len(prompt_ids), 0))
        future = asyncio.get_running_loop().create_future()
        self.requests.put(Pending(prompt_ids, limit, future, asyncio.get_running_loop()))
        try:
            ids, ended = await future
        except Exception as err:  # the model's forward failed: serve() raises it in the trainer
            return _error(500, f"generation failed: {err!r}", log)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        content, calls = self._reply(text, ask.tools)
        reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        keys = [message_key(m) for m in ask.messages]
        chain = log.record(Call(keys, shown, prompt_ids, ids, ended, text, reply, ask.messages), chain)
        if not ended and len(ids) >= room:
            chain.budget_hit = True
        finish = "tool_calls" if calls else ("stop" if ended else "length")
        return _json(_completion(content, calls, finish, len(prompt_ids), len(ids)))

    def _reply(self, text: str, tools: Sequence[dict] | None) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content and tool calls: with tools offered, the calls the text writes in
        the call format (the text before the first is the content); those that do not parse stay text."""
        if not tools or self.format.begins not in text:
            return text, []
        parsed = [c for c in self.format.parse(text) if isinstance(c, ParsedCall)]
        if not parsed:
            return text, []
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in parsed
        ]
        head = text[: text.index(self.format.begins)].strip() if self.format.begins else ""
        return head or None, calls


def _error(
    status: int, message: str, log: EpisodeLog | None = None, param: str | None = None
) -> web.Response:
    """An error in OpenAI's shape; counted in ``log`` (a call of its episode refused) where given."""
    if log is not None:
        log.refused += 1
    return _json({"error": {"message": message, "type": "invalid_request_error", "param": param}}, status)


def _json(data: dict[str, Any], status: int = 200) -> web.Response:
    from aiohttp import web

    return web.json_response(data, status=status)


def _completion(
    content: str | None, calls: list[dict[str, Any]], finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A chat.completion object of one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
