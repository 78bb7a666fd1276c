"""Tools a user writes as typed Python functions, or as the public methods of an environment
(tools/environments.py).

A function tool is what TRL and transformers take: type hints and a Google-style docstring, from
which ``transformers.utils.get_json_schema`` builds its schema. The chat template shows the
schemas where it renders ``tools``; where it ignores them, they go into the system message
(:data:`TOOLS_SYSTEM_PROMPT`). The calls are read from the policy's turn in a :mod:`tool-call
format <forge_lightning.rollout.tools.parsers>` (every call a turn wrote, up to the completion's
``max_tool_calls``) and each result goes back as a ``tool`` message, whose tokens are the template's
delta: the conversation rendered with those messages (and the cue for the next assistant turn)
less its rendering up to the end of the assistant's text. The template must be prefix-stable (each
message rendered after the earlier ones leaves them unchanged); that is checked once, when the
tools are built.

A result is data: it is cut to ``max_result_chars`` before it is rendered, and a control token in
it (or in an environment's reset text) is encoded as plain text (rollout/control_tokens.py), so that it
cannot forge a turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import StoppingCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.control_tokens import encode_marked, mark_data
from forge_lightning.rollout.sampler import RolloutSampler, prompt_messages
from forge_lightning.rollout.tools.base import Answer, Episode
from forge_lightning.rollout.tools.calls import MAX_RESULT_CHARS, run_call, tool_schema
from forge_lightning.rollout.tools.environments import (
    RESET,
    environment_tools,
    refuse_async,
)
from forge_lightning.rollout.tools.parsers import CallFormat, ParsedCall, format_named
from forge_lightning.rollout.tools.stored import tool_names
from forge_lightning.rollout.types import Prompt
from forge_lightning.run.user_code import accepted_kwargs, trl_kwargs

# The system message's text where the chat template does not render ``tools`` ({tools}: one JSON
# schema a line; {call}: how the format writes a call). Appended to a system message the prompt has.
TOOLS_SYSTEM_PROMPT = (
    "You can call these tools (JSON schemas, one per line):\n{tools}\n\n"
    "To call one, write {call}; its result comes back in a tool message."
)
# Tokens of a row's tail decoded to look for the end of a call, beyond the stop string's characters.
TAIL_MARGIN = 8


@dataclass
class EpisodeTools:
    """One completion's prompt conversation, its environment (or None) and its tools by name
    (the environment's methods bound to it)."""

    conversation: list[dict[str, Any]]
    environment: Any
    functions: dict[str, Callable[..., Any]]


class FunctionTools:
    """Function tools and an environment's as a :class:`~forge_lightning.rollout.tools.base.ToolProtocol`.

    Args:
        tokenizer: the policy's, with a chat template (prefix-stable; checked here).
        tools: typed functions with docstrings.
        environment_factory: a class, or a function returning an environment, called (with no
            arguments) once per completion.
        call_format: the tool-call format's name (parsers.CALL_FORMATS).
        timeout: seconds a call may take, its result made text included; a longer one is abandoned
            and answered with an error.
        system_prompt: the module's, which a prompt without a system message gets.
        max_result_chars: the characters of a result the model reads; a longer one is cut, marked
            (:data:`CUT_MARK`) and counted (``tool_results_cut``).
    """

    calls_before_eos = True

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: type | None = None,
        call_format: str = "hermes",
        timeout: float | None = 10.0,
        system_prompt: str | None = None,
        max_result_chars: int = MAX_RESULT_CHARS,
    ) -> None:
        if not tools and environment_factory is None:
            raise ValueError("FunctionTools needs tools or an environment_factory")
        if max_result_chars < 1:
            raise ValueError(f"max_tool_result_chars must be an integer >= 1, got {max_result_chars}")
        self.tokenizer, self.timeout, self.system_prompt = tokenizer, timeout, system_prompt
        self.tools, self.factory = list(tools or []), environment_factory
        self.max_result_chars = max_result_chars
        refuse_async([*self.tools, *([environment_factory] if environment_factory else [])], None)
        probe = environment_factory() if environment_factory is not None else None
        self.environment = None if probe is None else type(probe)
        refuse_async([], self.environment)
        self.names = tool_names(self.tools, self.environment)
        self.format: CallFormat = format_named(call_format)
        self.schemas = [tool_schema(name, fn) for name, fn in self._functions(probe).items()]
        self.template = tokenizer.name_or_path or type(tokenizer).__name__
        self.renders_tools = self.render([_USER], True, self.schemas) != self.render([_USER], True, None)
        check_prefix_stable(self)
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        last = self.format.stop[-1]
        self.ends_call = torch.tensor([last in piece for piece in pieces])  # (V,)

    def begin(
        self,
        sampler: RolloutSampler,
        prompts: list[Prompt],
        rows: dict[str, list[Any]],
        group_size: int,
        device: Any,
    ) -> tuple[Tensor, Tensor, list[Any]]:
        """Start an environment per completion, add its reset text to the prompt, show the tools."""
        if not sampler.prompts.use_chat_template:
            raise ValueError(
                "tools need the chat template (a tool's result is a 'tool' message): set use_chat_template "
                "to true, with a tokenizer that has one"
            )
        conversations, contexts = [], []
        for i, prompt in enumerate(prompts):
            row = trl_kwargs({key: values[i] for key, values in rows.items()})
            envs = [self._reset(row) for _ in range(group_size)] if self.factory is not None else []
            texts = {text for _, text in envs}
            if len(texts) > 1:
                raise ValueError(
                    f"the {group_size} environments of prompt {i} returned different texts from reset: "
                    "the completions of a prompt share it, so reset must return the same text for the "
                    f"same row (got {sorted(map(repr, texts))[:2]})"
                )
            conversation = self.conversation(prompt, texts.pop() if texts else None)
            conversations.append(conversation)
            for k in range(group_size):
                env = envs[k][0] if envs else None
                contexts.append(EpisodeTools(conversation, env, self._functions(env)))
        prompt_ids, prompt_mask = sampler.encode(conversations, device, self._shown())
        return prompt_ids, prompt_mask, contexts

    def may_end_a_call(self, token: int) -> bool:
        return 0 <= token < len(self.ends_call) and bool(self.ends_call[token])

    def ends_with_call(self, tail: Sequence[int]) -> bool:
        """Whether ``tail`` (a row's last tokens) ends a call: its text ends with the format's stop
        string, or its last token completes one. A tokenizer may merge the stop's last characters
        with the next call's first (``</tool_call><tool_call>`` written with a ``><`` token): the
        call ends there all the same."""
        tail = list(tail[-(len(self.format.stop) + TAIL_MARGIN) :])
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        if text.rstrip().endswith(self.format.stop):
            return True
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=True)
        return text.count(self.format.stop) > before.count(self.format.stop)

    def call_at(self, episode: Episode, completion: Sequence[int]) -> str | None:
        """The text of the policy's turn when it ends with a call (parsed when answered)."""
        turn = completion[episode.segment :]
        if not turn or not self.ends_with_call(turn):
            return None
        return self.tokenizer.decode(list(turn), skip_special_tokens=True)

    def stop(
        self, start: int, prior: Sequence[int], enabled: Sequence[bool], segments: Sequence[int]
    ) -> StoppingCriteria:
        return CallStop(self, start, [p - s for p, s in zip(prior, segments)], enabled)

    def answer(self, episode: Episode, call: str) -> Answer:
        """Run each call of the turn (those past the completion's ``max_calls`` are answered as
        errors, not run) and answer with the template's ``tool`` turns, one message per call."""
        context: EpisodeTools = episode.context
        room = None if episode.max_calls is None else episode.max_calls - episode.calls
        entries, messages = [], []
        for k, parsed in enumerate(self.format.parse(call)):
            if room is not None and k >= room:
                result, ok, cut = (
                    f"error: not run: a completion makes at most {episode.max_calls} calls",
                    False,
                    False,
                )
            else:
                result, ok, cut = run_call(parsed, context.functions, self.timeout, self.max_result_chars)
            name = parsed.name if isinstance(parsed, ParsedCall) else None
            arguments = parsed.arguments if isinstance(parsed, ParsedCall) else None
            entries.append(
                {"name": name, "arguments": arguments, "result": result, "ok": ok, "truncated": cut}
            )
            messages.append({"role": "tool", "name": name or "error", "content": result})
        turn = {"role": "assistant", "content": call}
        eos = self.tokenizer.decode(episode.ids[-1:]) if episode.ended_with_eos else None
        # The results (and a name the model wrote) are data: their control tokens are marked, to
        # be encoded as plain text.
        shown = [{key: mark_data(self.tokenizer, value) for key, value in m.items()} for m in messages]
        delta = self.delta([*context.conversation, *episode.messages], turn, shown, eos)
        episode.messages += [turn, *messages]
        ids = encode_marked(self.tokenizer, delta)
        return Answer(ids, all(e["ok"] for e in entries), entries[0], True, entries[1:])

    def delta(self, before: list[dict], turn: dict, messages: list[dict], eos: str | None) -> str:
        """The text after ``turn``'s content that ``messages`` add, with the next turn's cue;
        without the end-of-turn ``eos`` the policy sampled already."""
        text = template_delta(self.render, before, turn, messages, eos)
        if text is None:
            raise ValueError(self._unstable("a tool message changes the text before it"))
        return text

    def _reset(self, row: dict[str, Any]) -> tuple[Any, str | None]:
        env = self.factory()
        reset = getattr(env, RESET, None)
        text = reset(**accepted_kwargs(reset, row)) if reset is not None else None
        return env, text

    def _functions(self, env: Any) -> dict[str, Callable[..., Any]]:
        """The tools by name: the functions, and ``env``'s methods bound to it."""
        functions = {fn.__name__: fn for fn in self.tools}
        if self.environment is not None:
            functions.update({name: getattr(env, name) for name in environment_tools(self.environment)})
        return functions

    def conversation(self, prompt: Prompt, reset_text: str | None) -> list[dict[str, Any]]:
        """The prompt's messages, with the reset text on its last user message and, where the
        template does not render tools, their schemas in the system message. The reset text is
        data: its control tokens are marked, to be encoded as plain text."""
        messages = [dict(m) for m in prompt_messages(prompt, self.system_prompt)]
        if reset_text:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            last = users[-1] if users else len(messages) - 1
            text = mark_data(self.tokenizer, reset_text)
            messages[last]["content"] = f"{messages[last]['content']}\n\n{text}"
        return messages if self.renders_tools else with_system_text(messages, self.tools_text())

    def tools_text(self) -> str:
        """:data:`TOOLS_SYSTEM_PROMPT` with the tools' schemas and the format's call."""
        return tools_system_text(self.schemas, self.format)

    def _shown(self) -> list[dict[str, Any]] | None:
        return self.schemas if self.renders_tools else None

    def render(self, messages: list[dict], generation: bool, tools: Any = "shown") -> str:
        tools = self._shown() if tools == "shown" else tools
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation
            )
        except Exception as err:  # a template's raise_exception, or one without a chat template
            raise ValueError(
                f"the chat template of {self.template} cannot render the tool turns: {err}"
            ) from err

    def _unstable(self, why: str) -> str:
        return (
            f"the chat template of {self.template} is not prefix-stable ({why}): a tool's answer is "
            "appended as the tokens its message adds, which needs a template that renders each "
            "message after the earlier ones without changing them"
        )


def tools_system_text(schemas: Sequence[dict[str, Any]], call_format: CallFormat) -> str:
    """:data:`TOOLS_SYSTEM_PROMPT` with ``schemas`` (one JSON a line) and ``call_format``'s call."""
    shown = "\n".join(json.dumps(schema) for schema in schemas)
    return TOOLS_SYSTEM_PROMPT.replace("{tools}", shown).replace("{call}", call_format.example)


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` after their system message's, or as a system message first."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_delta(
    render: Callable[[list[dict], bool], str],
    before: list[dict],
    turn: dict,
    messages: list[dict],
    eos: str | None,
) -> str | None:
    """The text after ``turn``'s content (an assistant turn, the text the policy sampled) that
    ``messages`` add to the conversation ``before`` + ``turn``, with the next turn's cue; without
    the end-of-turn ``eos`` the policy sampled already. ``render(messages, generation)`` is the
    chat template. None where the template renders the earlier text differently once ``messages``
    follow (not prefix-stable), or ``turn`` has no text to find in its rendering."""
    base = render([*before, turn], False)
    content = turn["content"] if turn["content"] in base else turn["content"].strip()
    full = render([*before, turn, *messages], True)
    end = base.rfind(content) + len(content)
    if not content or content not in base or not full.startswith(base[:end]):
        return None
    text = full[end:]
    return text[len(eos) :] if eos and text.startswith(eos) else text


_USER = {"role": "user", "content": "What is 2 + 3?"}


def check_prefix_stable(tools: FunctionTools) -> None:
    """Refuse a template where a later message changes the text of earlier ones, on a dummy
    conversation of two assistant turns and a tool message between them."""
    call = f'{tools.format.start}{{"name": "add", "arguments": {{"a": 2, "b": 3}}}}{tools.format.stop}'
    first, second = {"role": "assistant", "content": call}, {"role": "assistant", "content": "It is 5."}
    message = {"role": "tool", "name": "add", "content": "5"}
    head = tools.conversation(_USER["content"], None)
    prompt = tools.render(head, True)
    if not tools.render([*head, first], False).startswith(prompt + call):
        raise ValueError(tools._unstable("an assistant turn does not continue the prompt's rendering"))
    after_tool = tools.render([*head, first, message], True)
    if not after_tool.startswith(prompt + call):
        raise ValueError(tools._unstable("a tool message changes the text before it"))
    if not tools.render([*head, first, message, second], False).startswith(after_tool + second["content"]):
        raise ValueError(tools._unstable("a second assistant turn does not continue the first's"))


class CallStop(StoppingCriteria):
    """Stops each row of a ``generate`` call whose turn ends with a call (the format's stop
    string). ``start``: the input's width; ``prior[i]``: row ``i``'s tokens of the current turn in
    the input already; ``enabled[i]`` False for a row that may make no more calls."""

    def __init__(
        self, tools: FunctionTools, start: int, prior: Sequence[int], enabled: Sequence[bool]
    ) -> None:
        self.tools, self.start, self.prior, self.enabled = tools, start, list(prior), list(enabled)

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> Tensor:
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)
        last = input_ids[:, -1].cpu().clamp(0, len(self.tools.ends_call) - 1)
        for row in self.tools.ends_call[last].nonzero().flatten().tolist():
            if self.enabled[row]:
                width = min(
                    len(self.tools.format.stop) + TAIL_MARGIN,
                    self.prior[row] + input_ids.shape[1] - self.start,
                )
                stop[row] = width > 0 and self.tools.ends_with_call(input_ids[row, -width:].tolist())
        return stop
