"""Talking to a rollout server in a test: one JSON call through the door, and driving a decode
loop step by step until a request is answered."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Future
from typing import Any

from forge_lightning.serving.decode import DecodeLoop
from forge_lightning.serving.wire import GenerateAnswer, auth_header

SECRET = "test-secret"


def call(
    url: str, path: str, body: Any = None, secret: str | None = SECRET, timeout: float = 30
) -> tuple[int, Any]:
    """(HTTP status, decoded JSON body) of a GET (``body`` None) or POST to ``url + path``."""
    headers = {"Content-Type": "application/json", **(auth_header(secret) if secret is not None else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def run_until(loop: DecodeLoop, *futures: Future[GenerateAnswer], max_steps: int = 1000) -> None:
    """Step ``loop`` (on this thread) until every future is answered."""
    for _ in range(max_steps):
        if all(f.done() for f in futures):
            return
        loop.step()
    raise AssertionError(f"the loop did not answer within {max_steps} steps")
