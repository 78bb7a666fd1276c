"""HTTP for rewards that are scored elsewhere (rewards/remote.py's scorer, rewards/judge.py's
OpenAI-compatible judge): one JSON POST with retries, on aiohttp (the package's one HTTP client),
and the running of such a coroutine from the synchronous call a reward is.

A request that fails for the server's sake (no connection, a dropped one, a timeout, an HTTP 5xx)
is tried again after ``backoff`` seconds, doubling each time, up to ``retries`` more times; a 4xx
(the request's fault: trying again gets the same answer) fails at once. Either way the error is a
:class:`RewardServerError` that names the URL and the status or the connection's error.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp

T = TypeVar("T")

# The most of a refusing server's body an error quotes.
_BODY_CHARS = 300


class RewardServerError(RuntimeError):
    """A reward's server did not answer with scores; the message names its URL and why."""


def checked_url(url: str, owner: str) -> str:
    """``url`` when it is an absolute ``http``/``https`` URL with a host; ValueError naming
    ``owner``'s ``url`` setting otherwise (a URL that cannot work is not worth retrying)."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{owner} url must be an http:// or https:// URL with a host, e.g. "
            f"'http://127.0.0.1:8000/score'; got {url!r}"
        )
    return url


def check_retry_settings(owner: str, timeout: float, retries: int, backoff: float) -> None:
    """ValueError naming ``owner``'s setting when a timeout, retry count or backoff is out of range."""
    if not timeout > 0 or retries < 0 or backoff < 0:
        raise ValueError(
            f"{owner} needs timeout > 0 (seconds), retries >= 0 and backoff >= 0 (seconds); got "
            f"{timeout=}, {retries=}, {backoff=}"
        )


def auth_headers(api_key_env: str | None, owner: str) -> dict[str, str]:
    """``Authorization: Bearer <key>`` with the key read from the environment variable
    ``api_key_env`` (a key never sits in a config or a checkpoint); none without one."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(
            f"{owner} api_key_env={api_key_env!r} names an environment variable that is not set: "
            f"export {api_key_env}=<the server's key>, or leave api_key_env unset"
        )
    return {"Authorization": f"Bearer {key}"}


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    payload: Any,
    *,
    timeout: float,
    retries: int,
    backoff: float,
    headers: dict[str, str] | None = None,
) -> Any:
    """POST ``payload`` as JSON to ``url`` and return the answer's JSON; each try may take
    ``timeout`` seconds. Retried as the module docstring says; :class:`RewardServerError` after
    the last try, at once on a 4xx, or when a 2xx answer is not JSON."""
    limit = aiohttp.ClientTimeout(total=timeout)
    tries = retries + 1
    why = ""
    for attempt in range(tries):
        if attempt:
            await asyncio.sleep(backoff * 2 ** (attempt - 1))
        try:
            async with session.post(url, json=payload, headers=headers, timeout=limit) as answer:
                body = await answer.text()
                status = f"HTTP {answer.status} {answer.reason or ''}".strip()
                if answer.status < 400:
                    return _json_body(url, status, body)
                if answer.status < 500:
                    raise RewardServerError(
                        f"POST {url} answered {status}: {body[:_BODY_CHARS]!r}. A 4xx is the request's "
                        "fault, so it is not retried: check the URL and what the server expects"
                    )
                why = f"{status}: {body[:_BODY_CHARS]!r}"
        except asyncio.TimeoutError:
            why = f"no answer within timeout={timeout:g}s"
        except aiohttp.ClientError as err:
            why = f"{type(err).__name__}: {err}"
    raise RewardServerError(f"POST {url} failed after {tries} tries (retries={retries}); the last: {why}")


def _json_body(url: str, status: str, body: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise RewardServerError(
            f"POST {url} answered {status} with no JSON: {body[:_BODY_CHARS]!r}"
        ) from None


def run_coroutine(make: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``make()`` to completion on an event loop of its own and return its
    result: in this thread, or where this thread already runs a loop (a notebook's), in a thread
    of its own, since a running loop cannot be waited on from inside."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())  # type: ignore[arg-type]
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = asyncio.run(make())  # type: ignore[arg-type]
        except BaseException as err:  # handed to the caller's thread
            result["error"] = err

    thread = threading.Thread(target=run, name="reward-http", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
