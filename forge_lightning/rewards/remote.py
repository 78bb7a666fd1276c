"""A reward scored by an HTTP server: :class:`RemoteReward`."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import aiohttp

from forge_lightning.rewards.calls import BaseReward, RewardOutput
from forge_lightning.rewards.http import (
    RewardServerError,
    auth_headers,
    check_retry_settings,
    checked_url,
    post_json,
    run_coroutine,
)


class RemoteReward(BaseReward):
    """Scores completions on an HTTP server: each batch of ``batch_size`` completions is one POST
    of JSON to ``url``,

    ``{"prompts": [...], "completions": [...], "fields": {name: [...], ...}}``

    with one entry per completion in every list (a prompt is its text, or its conversation as a
    list of ``{"role", "content"}`` messages), and the answer is a JSON list of as many numbers
    (a ``null`` means "not applicable", as a reward's None does in a CompositeReward). ``fields``
    holds each keyword argument the reward is given that is a list with one JSON value per
    completion: the batch's columns (``references``, any other field of the data) and the
    rollout's facts (``completion_lengths``, ``truncated``, ...); objects (``trainer_state``,
    ``log_metric``, an environment) stay out.

    A connection error, a timeout or an HTTP 5xx is tried again ``retries`` times, after
    ``backoff`` seconds doubling each time; a 4xx is not. A batch that still fails raises a
    :class:`~forge_lightning.rewards.http.RewardServerError` naming the URL and the status, which
    the module's rule for reward errors handles like any reward's error. A checkpoint stores the reward's
    arguments; a resume may change every one of them (:attr:`changeable_on_resume`, warned
    about: servers move).

    Args:
        url: the scorer's URL (``http://`` or ``https://``), e.g. ``http://127.0.0.1:8000/score``.
        batch_size: completions per request.
        timeout: seconds one request may take.
        retries: how many times a failed request is tried again.
        backoff: seconds before the first retry; each later one waits twice as long as the one before.
        api_key_env: an environment variable holding a key sent as ``Authorization: Bearer <key>``
            (the key itself stays out of configs and checkpoints); None sends none.
    """

    #: Arguments a resumed run may change (rewards/resume_changes.py): they move the server or pace
    #: the requests, not the scores.
    changeable_on_resume: ClassVar[tuple[str, ...]] = (
        "url", "batch_size", "timeout", "retries", "backoff", "api_key_env",
    )  # fmt: skip

    def __init__(
        self,
        url: str,
        batch_size: int = 64,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        api_key_env: str | None = None,
    ) -> None:
        self.url = checked_url(url, "RemoteReward")
        if batch_size < 1:
            raise ValueError(f"RemoteReward batch_size must be >= 1, got {batch_size}")
        check_retry_settings("RemoteReward", timeout, retries, backoff)
        self.batch_size, self.timeout, self.retries, self.backoff = batch_size, timeout, retries, backoff
        self.api_key_env = api_key_env

    def __call__(self, prompts: list[Any], responses: list[str], **kwargs: Any) -> RewardOutput:
        fields = _json_fields(kwargs, len(responses))
        headers = auth_headers(self.api_key_env, "RemoteReward")
        return RewardOutput(scores=run_coroutine(lambda: self._score(prompts, responses, fields, headers)))

    async def _score(
        self, prompts: list[Any], responses: list[str], fields: dict[str, list[Any]], headers: dict[str, str]
    ) -> list[Any]:
        scores: list[Any] = []
        async with aiohttp.ClientSession() as session:
            for start in range(0, len(responses), self.batch_size):
                end = start + self.batch_size
                payload = {
                    "prompts": prompts[start:end],
                    "completions": responses[start:end],
                    "fields": {name: values[start:end] for name, values in fields.items()},
                }
                answer = await post_json(
                    session, self.url, payload, timeout=self.timeout, retries=self.retries,
                    backoff=self.backoff, headers=headers,
                )  # fmt: skip
                scores += self._checked(answer, len(payload["completions"]))
        return scores

    def _checked(self, answer: Any, size: int) -> list[Any]:
        """The answer as scores: a list of ``size`` entries (checked_scores checks each value)."""
        if not isinstance(answer, list):
            raise RewardServerError(
                f"POST {self.url} answered {json.dumps(answer)[:200]}, not a JSON list of scores"
            )
        if len(answer) != size:
            raise RewardServerError(
                f"POST {self.url} answered {len(answer)} scores for {size} completions; it must answer "
                "one per completion, in order"
            )
        return answer


def _json_fields(kwargs: dict[str, Any], size: int) -> dict[str, list[Any]]:
    """The keyword arguments that are lists of ``size`` JSON values (RemoteReward's ``fields``)."""
    fields = {}
    for name, values in kwargs.items():
        if not isinstance(values, (list, tuple)) or len(values) != size:
            continue
        try:
            json.dumps(values, allow_nan=False)
        except (TypeError, ValueError):  # objects, NaN: no JSON for them
            continue
        fields[name] = list(values)
    return fields
