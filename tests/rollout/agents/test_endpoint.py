"""The agent endpoint with the real openai client: chat completions and tool calls over HTTP, and
the chain rule (a call extends its episode's chain token for token, from the sampled ids, or
starts a chain of its own that is not trained)."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from helpers.agents import TEMPLATE, USER, Script, chat_tokenizer, serve

from forge_lightning.rollout.agents.endpoint import AgentEndpoint

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_the_openai_client_gets_the_completion_and_its_tool_calls():
    tok = chat_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    async def agent(client):
        plain = await client.chat.completions.create(model="policy", messages=[USER])
        tooled = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS
        )
        return plain, tooled

    (plain, tooled), log, prompts = serve(tok, ["hello", f"Let me add. {call}"], agent)
    assert plain.choices[0].message.content == "hello"
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == len("hello") + 1  # and the EOS
    message = tooled.choices[0].message
    assert tooled.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me add."
    (tool_call,) = message.tool_calls
    assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {"a": 2, "b": 3}
    assert tok.decode(prompts[1]).startswith("<|im_start|>system\nTools: add")  # the schemas were rendered


def test_a_bad_request_is_refused_with_the_reason_and_counted():
    tok = chat_tokenizer()

    async def agent(client):
        with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], n=2)

    _, log, prompts = serve(tok, [], agent)
    assert prompts == [] and log.refused == 1 and log.dropped() == 1


def test_a_call_that_extends_the_last_call_continues_its_sampled_ids_not_a_retemplated_history():
    tok = chat_tokenizer()
    # The policy writes the characters of a control token: re-encoding its text would make the
    # token itself, so a history rendered again would not be what was sampled.
    first = "I think <|im_end|> is 5"

    async def agent(client):
        messages = [{"role": "user", "content": "2+3?"}]
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="p", messages=messages)

    _, log, prompts = serve(tok, [first, "yes"], agent)
    (chain,) = log.chains
    one, two = chain.calls
    written = tok(first, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    sampled = [*written, tok.eos_token_id]
    assert one.completion_ids == sampled
    assert prompts[1][: len(one.ids)] == one.prompt_ids + sampled  # token for token
    inserted = tok.decode(prompts[1][len(one.ids) :])
    assert inserted == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    assert log.dropped() == 0 and log.episode() is chain


def test_a_call_that_does_not_extend_the_chain_starts_another_which_is_dropped():
    tok = chat_tokenizer()

    async def agent(client):
        messages = [{"role": "user", "content": "2+3?"}]
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="p", messages=messages)
        # The agent rewrites the history: the policy never said this.
        edited = [messages[0], {"role": "assistant", "content": "It is 6"}, messages[2]]
        await client.chat.completions.create(model="p", messages=edited)

    _, log, _ = serve(tok, ["5", "yes", "no"], agent)
    assert [len(c.calls) for c in log.chains] == [2, 1]
    assert log.episode() is log.chains[0]
    assert log.dropped() == 1


def test_a_call_past_the_episodes_budget_is_answered_empty_and_the_episode_is_cut():
    tok = chat_tokenizer()

    async def agent(client):
        messages = [{"role": "user", "content": "2+3?"}]
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "sure?"}]
        return await client.chat.completions.create(model="p", messages=messages)

    last, log, prompts = serve(tok, ["it is five"], agent, budget=12)
    assert len(prompts) == 1  # the second call was not sampled: its turn alone is past the budget
    assert last.choices[0].finish_reason == "length" and last.choices[0].message.content == ""
    assert log.chains[0].budget_hit


def test_an_edited_reply_that_spends_the_budget_leaves_its_call_answered_empty_and_counted():
    tok = chat_tokenizer()

    async def agent(client):
        messages = [{"role": "user", "content": "2+3?"}]
        cut = await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
        # The agent writes on where the policy's reply was cut: its words, not the policy's, and
        # more of them than the episode's budget has left.
        edited = {
            "role": "assistant",
            "content": cut.choices[0].message.content + "is 5, as I checked twice.",
        }
        return await client.chat.completions.create(model="p", messages=[*messages, edited, USER])

    last, log, prompts = serve(tok, ["It is 5"], agent, budget=30)
    assert len(prompts) == 1 and last.choices[0].message.content == ""
    assert [len(c.calls) for c in log.chains] == [1] and log.chains[0].budget_hit
    assert log.dropped() == 1  # answered, in no chain: counted


def test_calls_sent_at_once_from_one_history_fork_the_chain_and_the_later_is_counted():
    tok = chat_tokenizer()
    script = Script(tok, ["5", "yes", "no"])

    def generate(batch):
        # The second call is sampled only once the third came too (in its batch, or waiting): both
        # were read against the chain as the first call left it.
        deadline = time.monotonic() + 10
        while (
            len(script.prompts) + len(batch) == 2
            and endpoint.requests.empty()
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        return script(batch)

    async def agent(client):
        messages = [{"role": "user", "content": "2+3?"}]
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "sure?"}]
        await asyncio.gather(
            *(client.chat.completions.create(model="p", messages=messages) for _ in range(2))
        )

    with AgentEndpoint(tok) as endpoint:
        log = endpoint.open("e", 400)

        async def run():
            async with openai.AsyncOpenAI(
                base_url=endpoint.base_url("e"), api_key=endpoint.api_key
            ) as client:
                await agent(client)

        endpoint.serve(endpoint.run(run()), generate)
    assert [len(c.calls) for c in log.chains] == [2, 1]
    for chain in log.chains:  # each call extends the one before it, never a sibling
        assert all(b.prompt_ids[: len(a.ids)] == a.ids for a, b in zip(chain.calls, chain.calls[1:]))
    ids, sampled = log.episode().tokens(0)
    assert tok.decode([t for t, s in zip(ids, sampled) if s]) in (
        "5<|im_end|>yes<|im_end|>",
        "5<|im_end|>no<|im_end|>",
    )
    assert log.dropped() == 1


def test_the_requests_of_every_running_episode_are_sampled_in_one_batch():
    tok = chat_tokenizer()
    batches = []

    def generate(batch):
        batches.append(len(batch))
        return [([tok.eos_token_id], True) for _ in batch]

    with AgentEndpoint(tok) as endpoint:
        for k in range(4):
            endpoint.open(str(k), 10)

        async def one(k):
            client = openai.AsyncOpenAI(
                base_url=endpoint.base_url(str(k)), api_key=endpoint.api_key, max_retries=0
            )
            try:
                return await client.chat.completions.create(model="p", messages=[USER])
            finally:
                await client.close()

        async def every():
            return await asyncio.gather(*(one(k) for k in range(4)))

        # The first request does not go alone: the batch waits for every running episode's.
        endpoint.serve(endpoint.run(every()), generate)
    assert batches == [4]


def test_a_reply_with_tool_calls_sent_back_as_the_sdk_message_continues_the_chain():
    tok = chat_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    async def agent(client):
        messages = [{"role": "user", "content": "2+3?"}]
        reply = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        message = reply.choices[0].message  # the SDK's object, with its tool call, as it is
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
        await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)

    _, log, prompts = serve(tok, [call, "It is 5."], agent)
    (chain,) = log.chains
    first = chain.calls[0]
    assert prompts[1][: len(first.ids)] == first.ids
    inserted = tok.decode(prompts[1][len(first.ids) :])
    assert inserted == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_tools_a_template_does_not_render_are_shown_in_the_system_message():
    tok = chat_tokenizer(TEMPLATE[TEMPLATE.index("{%- for") :])  # ChatML that ignores tools

    async def agent(client):
        await client.chat.completions.create(model="p", messages=[USER], tools=TOOLS)

    _, _, prompts = serve(tok, ["ok"], agent)
    shown = tok.decode(prompts[0])
    assert shown.startswith("<|im_start|>system\nYou can call these tools")
    assert json.dumps(TOOLS[0]) in shown and "<tool_call>" in shown  # the schema, and how to call
