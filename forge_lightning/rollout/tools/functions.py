"""Tools a user writes as typed Python functions, or as the public methods of an environment
(tools/environments.py).

A function tool is what TRL and transformers take: type hints and a Google-style docstring, from
which ``transformers.utils.get_json_schema`` builds its schema. The chat template shows the
schemas where it renders ``tools``; where it ignores them, they go into the system message
(:data:`TOOLS_SYSTEM_PROMPT`). The calls are read in a :mod:`tool-call format
<forge_lightning.rollout.tools.parsers>` at the end of the policy's turn (its end-of-turn token):
every call the turn wrote, up to the completion's cap of calls; the calls of every row that
waits for a tool run at once (tools/call_loop.py) and each result goes back as a ``tool``
message, whose tokens are the template's delta: the conversation rendered with those messages
(and the cue for the next assistant turn) less its rendering up to the end of the assistant's
text. Every rendering gets the module's ``chat_template_kwargs``. The template must be
prefix-stable (each message rendered after the earlier ones leaves them unchanged); that is
checked once, when the tools are built.

With several environments (``environment_factory`` a mapping name -> factory), each row's
``environment`` field picks its own (TRL's pattern): its prompt shows the functions and that
environment's tools.

A result is data: it is cut to ``max_result_chars`` before it is rendered, and a control token in
it (or in an environment's reset text) is encoded as plain text (rollout/control_tokens.py), so that it
cannot forge a turn.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from transformers import StoppingCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.control_tokens import encode_marked, mark_data
from forge_lightning.rollout.sampler import RolloutSampler, prompt_messages
from forge_lightning.rollout.tools.call_ends import CallEnds, CallStop
from forge_lightning.rollout.tools.call_loop import MAX_PARALLEL_CALLS, CallLoop
from forge_lightning.rollout.tools.environments import (
    RESET,
    environment_named,
    environment_tools,
    environment_type,
    factories_by_name,
    probe_environment,
    refuse_async,
    sandboxed_environment,
)
from forge_lightning.rollout.tools.function_call import (
    MAX_RESULT_CHARS,
    Job,
    Outcome,
    check_call,
    tool_schema,
)
from forge_lightning.rollout.tools.parsers import CallFormat, ParsedCall, format_named
from forge_lightning.rollout.tools.protocol import Answer, Episode
from forge_lightning.rollout.tools.stored import tool_names
from forge_lightning.rollout.types import Prompt, left_pad
from forge_lightning.run.user_code import accepted_kwargs, trl_kwargs
from forge_lightning.sandbox.pool import Sandbox

# The system message's text where the chat template does not render ``tools`` ({tools}: one JSON
# schema a line; {call}: how the format writes a call). Appended to a system message the prompt has.
TOOLS_SYSTEM_PROMPT = (
    "You can call these tools (JSON schemas, one per line):\n{tools}\n\n"
    "To call one, write {call}; its result comes back in a tool message."
)


@dataclass
class EpisodeTools:
    """One completion's prompt conversation, its environment (or None), its tools by name (the
    environment's methods bound to it) and their schemas as the template renders them (None
    where it does not)."""

    conversation: list[dict[str, Any]]
    environment: Any
    functions: dict[str, Callable[..., Any]]
    shown: list[dict[str, Any]] | None = None


class FunctionTools:
    """Function tools and an environment's as a :class:`~forge_lightning.rollout.tools.protocol.ToolProtocol`.

    Args:
        tokenizer: the policy's, with a chat template (prefix-stable; checked here).
        tools: typed functions with docstrings.
        environment_factory: a class, or a function returning an environment, called (with no
            arguments) once per completion; or a mapping name -> such a factory, each row's picked
            by its ``environment`` field.
        call_format: the tool-call format's name (parsers.CALL_FORMATS).
        timeout: seconds a call may take once it runs, its result made text included; a longer one
            is abandoned and answered with an error (in this process its thread runs on: its log
            entry says ``"abandoned": True`` and it is counted in ``tool_threads_abandoned``).
        system_prompt: the module's, which a prompt without a system message gets.
        max_result_chars: the characters of a result the model reads; a longer one is cut, marked
            (:data:`CUT_MARK`) and counted (``tool_results_cut``).
        max_parallel: the calls (of all rows, and of one turn) that run at once.
        chat_template_kwargs: passed to every rendering of the chat template.
        sandbox: where the function tools run (sandbox/pool.py), and each episode's environment,
            made in one worker's process and called there for the whole episode; None: in this
            process.
    """

    calls_before_eos = True

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
        call_format: str = "hermes",
        timeout: float | None = 10.0,
        system_prompt: str | None = None,
        max_result_chars: int = MAX_RESULT_CHARS,
        max_parallel: int = MAX_PARALLEL_CALLS,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        if not tools and not environment_factory:
            raise ValueError("FunctionTools needs tools or an environment_factory")
        if max_result_chars < 1:
            raise ValueError(f"max_tool_result_chars must be an integer >= 1, got {max_result_chars}")
        self.tokenizer, self.timeout, self.system_prompt = tokenizer, timeout, system_prompt
        self.tools, self.factories = list(tools or []), factories_by_name(environment_factory)
        self.max_result_chars, self.sandbox = max_result_chars, sandbox
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.calls = CallLoop(max_parallel, timeout, max_result_chars)
        refuse_async(list(self.factories.values()), None)
        # One environment made per factory, to read its class: its tools and their schemas.
        probes = {
            name: probe_environment(factory, sandbox is not None) for name, factory in self.factories.items()
        } or {None: None}
        self.environments = {name: type(env) for name, env in probes.items() if env is not None}
        for cls in self.environments.values():
            refuse_async([], cls)
        self.names = tool_names(self.tools, list(self.environments.values()))
        self.schemas = {
            name: [tool_schema(tool, fn) for tool, fn in self._functions(env).items()]
            for name, env in probes.items()
        }
        every = {s["function"]["name"]: s for schemas in self.schemas.values() for s in schemas}
        self.format: CallFormat = format_named(call_format, list(every.values()))
        self.template = tokenizer.name_or_path or type(tokenizer).__name__
        first = next(iter(self.schemas.values()))
        self.renders_tools = self.render([_USER], True, first) != self.render([_USER], True, None)
        check_prefix_stable(self)
        self.ends = CallEnds(tokenizer, self.format)

    def begin(
        self,
        sampler: RolloutSampler,
        prompts: list[Prompt],
        rows: dict[str, list[Any]],
        group_size: int,
        device: Any,
    ) -> tuple[Tensor, Tensor, list[Any]]:
        """Start an environment per completion (of the kind its row names, where there are
        several), add its reset text to the prompt, show the tools."""
        if not sampler.prompts.use_chat_template:
            raise ValueError(
                "tools need the chat template (a tool's result is a 'tool' message): set use_chat_template "
                "to true, with a tokenizer that has one"
            )
        conversations, names, contexts = [], [], []
        for i, prompt in enumerate(prompts):
            row = trl_kwargs({key: values[i] for key, values in rows.items()})
            name = environment_named(self.factories, row)
            envs = [self._reset(name, row) for _ in range(group_size)] if self.factories else []
            texts = {text for _, text in envs}
            if len(texts) > 1:
                raise ValueError(
                    f"the {group_size} environments of prompt {i} returned different texts from reset: "
                    "the completions of a prompt share it, so reset must return the same text for the "
                    f"same row (got {sorted(map(repr, texts))[:2]})"
                )
            conversation = self.conversation(prompt, texts.pop() if texts else None, name)
            conversations.append(conversation)
            names.append(name)
            for k in range(group_size):
                env = envs[k][0] if envs else None
                contexts.append(EpisodeTools(conversation, env, self._functions(env), self._shown(name)))
        prompt_ids, prompt_mask = self._encode(sampler, conversations, names, device)
        return prompt_ids, prompt_mask, contexts

    def _encode(
        self, sampler: RolloutSampler, conversations: list[list[dict]], names: list[str | None], device: Any
    ) -> tuple[Tensor, Tensor]:
        """The prompts as left-padded ``(ids, mask)``, each rendered with its environment's tools."""
        if len(set(names)) == 1:
            return sampler.encode(conversations, device, self._shown(names[0]))
        rows: list[list[int]] = [[] for _ in conversations]
        for name in dict.fromkeys(names):
            at = [i for i, n in enumerate(names) if n == name]
            ids, mask = sampler.encode([conversations[i] for i in at], device, self._shown(name))
            for i, row, real in zip(at, ids, mask):
                rows[i] = row[real.bool()].tolist()
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id)
        return ids.to(device), mask.to(device)

    def may_end_a_call(self, token: int) -> bool:
        return False  # a turn's calls are read at its end, never mid-turn

    def call_at(self, episode: Episode, completion: Sequence[int]) -> str | None:
        """The text of the policy's turn (``completion`` up to its end-of-turn token) when it holds
        calls (every one of them parsed when answered)."""
        return self.ends.call_in(completion[episode.segment :])

    def stop(
        self,
        start: int,
        prior: Sequence[int],
        enabled: Sequence[bool],
        segments: Sequence[int],
        eos_ids: Sequence[int],
    ) -> StoppingCriteria:
        return CallStop(self.ends, start, [p - s for p, s in zip(prior, segments)], enabled, eos_ids)

    def answer(self, turns: Sequence[tuple[Episode, str]]) -> list[Answer]:
        """Run the calls of every turn at once (tools/call_loop.py; those past a completion's
        ``max_calls`` are answered as errors, not run) and answer each turn with the template's
        ``tool`` turns, one message per call, in the order written."""
        planned = [self._planned(episode, text) for episode, text in turns]
        jobs = [step for plan in planned for _, step in plan if isinstance(step, Job)]
        outcomes = iter(self.calls.run(jobs))
        return [
            self._answer(episode, text, [(p, next(outcomes) if isinstance(s, Job) else s) for p, s in plan])
            for (episode, text), plan in zip(turns, planned)
        ]

    def _planned(self, episode: Episode, text: str) -> list[tuple[ParsedCall | str, Job | Outcome]]:
        """Each call of the turn ``text``, and its job, or its answer where it does not run."""
        room = None if episode.max_calls is None else episode.max_calls - episode.calls
        refused = Outcome(
            f"error: not run: a completion makes at most {episode.max_calls} calls", False, False
        )
        functions = episode.context.functions
        return [
            (
                parsed,
                refused
                if room is not None and k >= room
                else check_call(parsed, functions, self.sandbox, self.timeout),
            )
            for k, parsed in enumerate(self.format.parse(text))
        ]

    def _answer(
        self, episode: Episode, call: str, outcomes: list[tuple[ParsedCall | str, Outcome]]
    ) -> Answer:
        """The answer of the turn ``call`` whose calls had ``outcomes``: one ``tool`` message each."""
        context: EpisodeTools = episode.context
        entries, messages = [], []
        for parsed, (result, ok, cut, abandoned) in outcomes:
            name = parsed.name if isinstance(parsed, ParsedCall) else None
            arguments = parsed.arguments if isinstance(parsed, ParsedCall) else None
            entry = {"name": name, "arguments": arguments, "result": result, "ok": ok, "truncated": cut}
            entries.append({**entry, "abandoned": True} if abandoned else entry)
            messages.append({"role": "tool", "name": name or "error", "content": result})
        turn = {"role": "assistant", "content": call}
        eos = self.tokenizer.decode(episode.ids[-1:]) if episode.ended_with_eos else None
        # The results (and a name the model wrote) are data: their control tokens are marked, to
        # be encoded as plain text.
        shown = [{key: mark_data(self.tokenizer, value) for key, value in m.items()} for m in messages]
        delta = self.delta([*context.conversation, *episode.messages], turn, shown, eos, context.shown)
        episode.messages += [turn, *messages]
        ids = encode_marked(self.tokenizer, delta)
        return Answer(ids, all(e["ok"] for e in entries), entries[0], True, entries[1:])

    def delta(
        self, before: list[dict], turn: dict, messages: list[dict], eos: str | None, tools: Any = "shown"
    ) -> str:
        """The text after ``turn``'s content that ``messages`` add, with the next turn's cue;
        without the end-of-turn ``eos`` the policy sampled already. ``tools``: the schemas the
        template renders (:meth:`render`)."""
        text = template_delta(
            lambda m, generation: self.render(m, generation, tools), before, turn, messages, eos
        )
        if text is None:
            raise ValueError(self._unstable("a tool message changes the text before it"))
        return text

    def _reset(self, name: str | None, row: dict[str, Any]) -> tuple[Any, str | None]:
        """A new environment of the factory ``name``, reset for ``row`` (an async reset awaited):
        in a sandbox worker's process for the whole episode where there is a sandbox."""
        if self.sandbox is not None:
            return sandboxed_environment(
                self.sandbox, self.factories[name], self.environments[name], row, self.timeout
            )
        env = self.factories[name]()
        reset = getattr(env, RESET, None)
        text = reset(**accepted_kwargs(reset, row)) if reset is not None else None
        return env, self.calls.awaited(text) if inspect.isawaitable(text) else text

    def _functions(self, env: Any) -> dict[str, Callable[..., Any]]:
        """The tools by name: the functions, and ``env``'s methods bound to it."""
        functions = {fn.__name__: fn for fn in self.tools}
        if env is not None:
            functions.update({name: getattr(env, name) for name in environment_tools(environment_type(env))})
        return functions

    def conversation(
        self, prompt: Prompt, reset_text: str | None, environment: str | None = None
    ) -> list[dict[str, Any]]:
        """The prompt's messages, with the reset text on its last user message and, where the
        template does not render tools, their schemas (the functions' and ``environment``'s) in the
        system message. The reset text is data: its control tokens are marked, to be encoded as
        plain text."""
        messages = [dict(m) for m in prompt_messages(prompt, self.system_prompt)]
        if reset_text:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            last = users[-1] if users else len(messages) - 1
            text = mark_data(self.tokenizer, reset_text)
            messages[last]["content"] = f"{messages[last]['content']}\n\n{text}"
        return messages if self.renders_tools else with_system_text(messages, self.tools_text(environment))

    def tools_text(self, environment: str | None = None) -> str:
        """:data:`TOOLS_SYSTEM_PROMPT` with the tools' schemas and the format's call."""
        return tools_system_text(self.schemas[environment], self.format)

    def _shown(self, environment: str | None = None) -> list[dict[str, Any]] | None:
        """The schemas the template renders for a row of ``environment`` (its name, where there are
        several; else None): the functions' and that environment's tools."""
        return self.schemas[environment] if self.renders_tools else None

    def render(self, messages: list[dict], generation: bool, tools: Any = "shown") -> str:
        """The chat template's text of ``messages`` with ``tools`` (the schemas it renders;
        ``"shown"``: the first environment's) and the module's ``chat_template_kwargs``."""
        tools = self._shown(next(iter(self.schemas))) if tools == "shown" else tools
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation,
                **self.template_kwargs,
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
    call = tools.format.write("add", {"a": 2, "b": 3})
    first, second = {"role": "assistant", "content": call}, {"role": "assistant", "content": "It is 5."}
    message = {"role": "tool", "name": "add", "content": "5"}
    head = tools.conversation(_USER["content"], None, next(iter(tools.schemas)))
    prompt = tools.render(head, True)
    if not tools.render([*head, first], False).startswith(prompt + call):
        raise ValueError(tools._unstable("an assistant turn does not continue the prompt's rendering"))
    after_tool = tools.render([*head, first, message], True)
    if not after_tool.startswith(prompt + call):
        raise ValueError(tools._unstable("a tool message changes the text before it"))
    if not tools.render([*head, first, message, second], False).startswith(after_tool + second["content"]):
        raise ValueError(tools._unstable("a second assistant turn does not continue the first's"))
