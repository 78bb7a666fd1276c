"""RemoteReward against real local HTTP servers (tests/conftest.py): what it posts, its
retries, and each way a server fails."""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest
from aiohttp import web

from forge_lightning.rewards import RemoteReward
from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rewards.http import RewardServerError

PROMPTS = ["2 + 3 =", [{"role": "user", "content": "hi"}], "what is 7?"]
RESPONSES = [" 5", "hello there", "seven"]


async def lengths(body, n):
    """Scores each completion by its length in characters."""
    return [float(len(text)) for text in body["completions"]]


def test_batches_post_prompts_completions_and_the_rows_json_fields(serve):
    server = serve(lengths)
    reward = RemoteReward(server.url, batch_size=2, timeout=2.0)
    scored = score(
        reward,
        PROMPTS,
        RESPONSES,
        references=["5", "hi", "7"],
        completion_lengths=[2, 11, 5],
        log_metric=print,  # an object: no JSON, not posted
        environments=[object()] * 3,  # a list of objects: not posted either
    )
    assert scored.total == [2.0, 11.0, 5.0]
    first, second = server.requests
    assert first == {
        "prompts": PROMPTS[:2],
        "completions": RESPONSES[:2],
        "fields": {"references": ["5", "hi"], "completion_lengths": [2, 11]},
    }
    assert second["completions"] == ["seven"] and second["fields"]["references"] == ["7"]


def test_a_5xx_is_retried_after_a_doubling_backoff(serve):
    async def busy_twice(body, n):
        return web.Response(status=503, text="busy") if n < 2 else await lengths(body, n)

    server = serve(busy_twice)
    reward = RemoteReward(server.url, timeout=2.0, retries=2, backoff=0.1)
    start = time.monotonic()
    assert reward(["p"], ["abc"]).scores == [3.0]
    assert len(server.requests) == 3
    assert time.monotonic() - start >= 0.1 + 0.2  # 0.1 s, then 0.2 s


def test_a_server_still_failing_after_the_last_retry_fails_the_batch_naming_url_and_status(serve):
    async def broken(body, n):
        return web.Response(status=500, text="scorer crashed")

    server = serve(broken)
    reward = RemoteReward(server.url, timeout=2.0, retries=1, backoff=0.0)
    with pytest.raises(
        RewardServerError, match=rf"POST {server.url} failed after 2 tries.*HTTP 500.*crashed"
    ):
        reward(["p"], ["abc"])
    assert len(server.requests) == 2


def test_a_4xx_is_never_retried(serve):
    async def refuses(body, n):
        return web.Response(status=422, text="no 'fields' expected")

    server = serve(refuses)
    reward = RemoteReward(server.url, timeout=2.0, retries=3, backoff=0.0)
    with pytest.raises(RewardServerError, match=rf"POST {server.url} answered HTTP 422.*not retried"):
        reward(["p"], ["abc"])
    assert len(server.requests) == 1


def test_a_server_that_stalls_is_abandoned_after_the_timeout_of_each_try(serve):
    async def stalls(body, n):
        await asyncio.sleep(30)

    server = serve(stalls)
    reward = RemoteReward(server.url, timeout=0.2, retries=1, backoff=0.0)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=r"failed after 2 tries.*no answer within timeout=0.2s"):
        reward(["p"], ["abc"])
    assert time.monotonic() - start < 5
    assert len(server.requests) == 2


def test_an_answer_of_the_wrong_length_fails_its_batch_and_each_sample_is_counted(serve):
    async def one_short(body, n):
        return [1.0] * (len(body["completions"]) - 1)

    server = serve(one_short)
    reward = RemoteReward(server.url, timeout=2.0)
    with pytest.raises(RewardServerError, match=r"answered 2 scores for 3 completions"):
        reward(["p"] * 3, ["a", "b", "c"])
    with pytest.warns(UserWarning, match="raised on 3 of 3 samples"):
        scored = score(reward, ["p"] * 3, ["a", "b", "c"], on_error="zero")
    assert scored.total == [0.0] * 3 and scored.num_errors == 3


def test_a_server_that_dies_mid_run_fails_the_next_batch_naming_its_url(serve):
    server = serve(lengths)
    reward = RemoteReward(server.url, timeout=1.0, retries=1, backoff=0.0)
    assert reward(["p"], ["abc"]).scores == [3.0]
    server.stop()
    with pytest.raises(RewardServerError, match=rf"POST {server.url} failed after 2 tries.*Connect"):
        reward(["p"], ["abc"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scored = score(reward, ["p"] * 2, ["a", "b"], on_error="zero")
    assert scored.num_errors == 2


def test_a_key_from_the_environment_is_sent_as_a_bearer_token(serve, monkeypatch):
    server = serve(lengths)
    monkeypatch.setenv("SCORER_KEY", "s3cret")
    RemoteReward(server.url, api_key_env="SCORER_KEY")(["p"], ["abc"])
    assert server.headers[0]["Authorization"] == "Bearer s3cret"
    monkeypatch.delenv("SCORER_KEY")
    with pytest.raises(
        ValueError, match="api_key_env='SCORER_KEY' names an environment variable that is not set"
    ):
        RemoteReward(server.url, api_key_env="SCORER_KEY")(["p"], ["abc"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "127.0.0.1:8000/score"}, "url must be an http:// or https:// URL"),
        ({"url": "http://h/s", "batch_size": 0}, "batch_size must be >= 1"),
        ({"url": "http://h/s", "timeout": 0}, "timeout > 0"),
        ({"url": "http://h/s", "retries": -1}, "retries >= 0"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RemoteReward(**kwargs)


def test_called_where_an_event_loop_runs_it_scores_on_a_loop_of_its_own(serve):
    server = serve(lengths)
    reward = RemoteReward(server.url, timeout=2.0)

    async def inside_a_notebook():  # Jupyter runs cells inside a running loop
        return reward(["p"], ["abcd"]).scores

    assert asyncio.run(inside_a_notebook()) == [4.0]
