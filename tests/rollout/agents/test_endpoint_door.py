"""The agent endpoint's door: any local process can reach its port, so a request needs the
endpoint's key (401 without it, no episode touched), an episode's URL is not its key (a guessed one
is 404), and a field of the wrong type is refused 400 by name in OpenAI's error shape. Another
process posting a chain of calls to an episode leaves that episode's training data the agent's."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from helpers.agents import USER, Script, chat_tokenizer, runner

from forge_lightning.rollout.agents.endpoint import AgentEndpoint
from forge_lightning.rollout.engines.base import SamplingParams

KEY = "0-1"  # an episode's key as the runner names them: prompt 0, its second episode
REQUEST = {"model": "p", "messages": [USER]}


@pytest.fixture
def tok():
    return chat_tokenizer()


async def post(url: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON to ``url``: the status and the JSON answer."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, headers=headers) as response:
            return response.status, await response.json(content_type=None)


async def get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """GET ``url``: the status and the JSON answer."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers) as response:
            return response.status, await response.json(content_type=None)


async def both(first, second) -> tuple[Any, Any]:
    return await first, await second


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def answered(endpoint: AgentEndpoint, tok, coroutine, replies: list[str] | None = None):
    """Run ``coroutine`` on the endpoint's loop, its calls sampled from ``replies``; its result and
    the prompts sampled."""
    script = Script(tok, replies or [])
    return endpoint.serve(endpoint.run(coroutine), script), script.prompts


@pytest.mark.parametrize(
    "headers",
    [
        lambda key: {},
        lambda key: bearer("forge-lightning"),  # the key the runner's clients carried before
        lambda key: {"Authorization": key},
        lambda key: {"Authorization": f"Basic {key}"},
        lambda key: bearer(key + "x"),
        lambda key: bearer(key[:-1]),
    ],
    ids=["none", "another key", "no Bearer", "another scheme", "longer", "shorter"],
)
def test_a_request_without_the_key_is_refused_401_and_touches_no_episode(tok, headers):
    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open(KEY, 100)
        url, sent = endpoint.base_url(KEY), headers(endpoint.api_key)
        calls = both(post(f"{url}/chat/completions", REQUEST, sent), get(f"{url}/models", sent))
        (chat, models), prompts = answered(endpoint, tok, calls, ["5"])
    assert chat[0] == 401 and models[0] == 401
    assert "Authorization: Bearer <api_key>" in chat[1]["error"]["message"]
    assert prompts == [] and log.chains == [] and log.refused == 0 and log.dropped() == 0


def test_the_key_as_the_clients_api_key_is_served(tok):
    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open(KEY, 100)

        async def agent():
            async with openai.AsyncOpenAI(
                base_url=endpoint.base_url(KEY), api_key=endpoint.api_key
            ) as client:
                models = await client.models.list()
                reply = await client.chat.completions.create(model="policy", messages=[USER])
                return [m.id for m in models.data], reply.choices[0].message.content

        (models, content), _ = answered(endpoint, tok, agent(), ["5"])
    assert models == ["policy"] and content == "5"
    assert len(log.chains) == 1 and log.dropped() == 0


def test_each_endpoint_has_its_own_key_and_episode_urls():
    first, second = AgentEndpoint(chat_tokenizer()), AgentEndpoint(chat_tokenizer())
    assert first.api_key != second.api_key and len(first.api_key) >= 32
    with first, second:
        first.open(KEY, 100)
        second.open(KEY, 100)
        paths = [e.base_url(KEY).split("/", 3)[3] for e in (first, second)]
    assert paths[0] != paths[1] and f"episodes/{KEY}/v1" not in paths


def test_a_guessed_episode_url_is_answered_404_even_with_the_key(tok):
    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open(KEY, 100)
        guessed = f"http://127.0.0.1:{endpoint.port}/episodes/{KEY}/v1"
        key = bearer(endpoint.api_key)
        calls = both(post(f"{guessed}/chat/completions", REQUEST, key), get(f"{guessed}/models", key))
        (chat, models), prompts = answered(endpoint, tok, calls, ["5"])
    assert chat[0] == 404 and models[0] == 404
    assert chat[1]["error"]["type"] == "invalid_request_error"
    assert prompts == [] and log.chains == [] and log.refused == 0


async def intrude(port: int, key: str, headers: dict[str, str]) -> list[int]:
    """Another local process: a chain of three calls posted to episode ``key``'s URL as the endpoint
    once made it (``/episodes/<key>/v1``), each sending back the last reply; the statuses."""
    url = f"http://127.0.0.1:{port}/episodes/{key}/v1/chat/completions"
    messages, statuses = [{"role": "user", "content": "Say yes."}], []
    for _ in range(3):
        status, body = await post(url, {"model": "p", "messages": messages, "max_tokens": 2}, headers)
        statuses.append(status)
        content = body["choices"][0]["message"]["content"] if status == 200 else "yes"
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "Again."},
        ]
    return statuses


ATTACKS: list[list[int]] = []


async def answer_once_beside_an_intruder(client, row):
    """One call; the first episode to run also starts another process's attack on both episodes."""
    if not ATTACKS:
        ATTACKS.append([])
        port = client.base_url.port
        ATTACKS[0] += await intrude(port, "0-0", {})
        ATTACKS[0] += await intrude(port, "0-1", bearer("forge-lightning"))  # the key clients once carried
    await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    return 1.0


def test_another_process_posting_a_chain_to_an_episode_does_not_become_its_training_data():
    run, tok, model = runner(answer_once_beside_an_intruder)
    ATTACKS.clear()
    rollout = run(model, ["hi"], SamplingParams(max_new_tokens=20), group_size=2)
    assert ATTACKS == [[401] * 6]
    # Each row is its agent's one call on the real question: nothing of the intruder's chain.
    assert tok.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()]).endswith(
        "user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rollout.tool_stats["turns"].tolist() == [1, 1]
    assert rollout.tool_stats["agent_calls_dropped"].tolist() == [0, 0]
    assert not any("Say yes." in text for text in rollout.completions)
    # No turn of anyone else's is read into a row either: every token of each is its agent's sample.
    assert rollout.model_mask.sum(dim=1).tolist() == rollout.completion_mask.sum(dim=1).tolist()


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"max_tokens": "abc"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"n": "2"}, "n"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream": True}, "stream"),
        ({"tools": "add"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [USER, "hi"]}, "messages[1]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": ["a"]}]}, "messages[0].name"),
        (
            {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": "add"}]},
            "messages[1].tool_calls",
        ),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": {}}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [USER, {"role": "tool", "content": "5", "tool_call_id": 7}]},
            "messages[1].tool_call_id",
        ),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_400_naming_it(tok, field, param):
    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open(KEY, 100)
        url = f"{endpoint.base_url(KEY)}/chat/completions"
        (status, body), prompts = answered(
            endpoint, tok, post(url, {**REQUEST, **field}, bearer(endpoint.api_key)), ["5"]
        )
    assert status == 400
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert param in body["error"]["message"]
    assert prompts == [] and log.chains == [] and log.refused == 1 and log.dropped() == 1


def test_a_body_that_is_not_an_object_is_refused_400(tok):
    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open(KEY, 100)
        url = f"{endpoint.base_url(KEY)}/chat/completions"
        (status, body), _ = answered(endpoint, tok, post(url, [REQUEST], bearer(endpoint.api_key)))
    assert status == 400 and "JSON object" in body["error"]["message"] and log.refused == 1
