"""Tools a user writes as typed Python functions, or as the public methods of an environment.

A function tool is what TRL and transformers take: type hints and a Google-style docstring, from
which ``transformers.utils.get_json_schema`` builds its schema. The chat template shows the
schemas where it renders ``tools``; where it ignores them, they go into the system message
(:data:`TOOLS_SYSTEM_PROMPT`). A call is read from the completion in a :mod:`tool-call format
<forge_lightning.tools.parsers>` and its result goes back as a ``tool`` message, whose tokens are
the template's delta: the conversation rendered with that message (and the cue for the next
assistant turn) less its rendering up to the end of the assistant's text. The template must be
prefix-stable (each message rendered after the earlier ones leaves them unchanged); that is
checked once, when the tools are built.

An environment (``environment_factory``) is a class made once per completion, so no state passes
between samples: ``reset(**row)`` starts the episode with its prompt's batch fields and may return
text appended to the prompt's last user message; its other public methods but ``reward`` are the
tools; ``reward()``, if there, scores the finished episode (:class:`EnvironmentReward`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor
from transformers import StoppingCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from forge_lightning.reward_calls import (
    BaseReward,
    CallTimeout,
    RewardOutput,
    accepted_kwargs,
    call_within,
    trl_kwargs,
)
from forge_lightning.rollout import Prompt, RolloutSampler, prompt_messages
from forge_lightning.specs import from_spec, import_path
from forge_lightning.tools.base import Answer, Episode
from forge_lightning.tools.parsers import CallFormat, ParsedCall, format_named

# The system message's text where the chat template does not render ``tools`` ({tools}: one JSON
# schema a line; {call}: how the format writes a call). Appended to a system message the prompt has.
TOOLS_SYSTEM_PROMPT = (
    "You can call these tools (JSON schemas, one per line):\n{tools}\n\n"
    "To call one, write {call}; its result comes back in a tool message."
)
# The environment methods that are not tools.
RESET, SCORE = "reset", "reward"
# Tokens of a row's tail decoded to look for the end of a call, beyond the stop string's characters.
TAIL_MARGIN = 8


def environment_tools(factory: type) -> list[str]:
    """The tool names of an environment class: its public methods but ``reset`` and ``reward``."""
    return [
        name
        for name, _ in inspect.getmembers(factory, inspect.isfunction)
        if not name.startswith("_") and name not in (RESET, SCORE)
    ]


def tool_names(tools: Sequence[Callable[..., Any]] | None, environment_factory: type | None) -> list[str]:
    """Every tool's name: the functions' own, then the environment's methods."""
    names = [fn.__name__ for fn in tools or []]
    names += environment_tools(environment_factory) if environment_factory is not None else []
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"two tools have the name {', '.join(duplicated)}: each tool needs its own")
    return names


@dataclass
class EpisodeTools:
    """One completion's prompt conversation, its environment (or None) and its tools by name
    (the environment's methods bound to it)."""

    conversation: list[dict[str, Any]]
    environment: Any
    functions: dict[str, Callable[..., Any]]


class FunctionTools:
    """Function tools and an environment's as a :class:`~forge_lightning.tools.base.ToolProtocol`.

    Args:
        tokenizer: the policy's, with a chat template (prefix-stable; checked here).
        tools: typed functions with docstrings.
        environment_factory: a class made (with no arguments) once per completion.
        call_format: the tool-call format's name (parsers.CALL_FORMATS).
        timeout: seconds a call may take; a longer one is abandoned and answered with an error.
        system_prompt: the module's, which a prompt without a system message gets.
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
    ) -> None:
        if not tools and environment_factory is None:
            raise ValueError("FunctionTools needs tools or an environment_factory")
        self.tokenizer, self.timeout, self.system_prompt = tokenizer, timeout, system_prompt
        self.tools, self.factory = list(tools or []), environment_factory
        self.names = tool_names(self.tools, environment_factory)
        self.format: CallFormat = format_named(call_format)
        probe = environment_factory() if environment_factory is not None else None
        self.schemas = [get_json_schema(fn) for fn in self._functions(probe).values()]
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
        """Whether the text of ``tail`` (a row's last tokens) ends with the format's stop string."""
        width = len(self.format.stop) + TAIL_MARGIN
        text = self.tokenizer.decode(list(tail[-width:]), skip_special_tokens=True)
        return text.rstrip().endswith(self.format.stop)

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
        """Run the turn's call and answer with the template's ``tool`` turn."""
        context: EpisodeTools = episode.context
        parsed = self.format.parse(call)
        result, ok = self._run(parsed, context.functions)
        name = parsed.name if isinstance(parsed, ParsedCall) else None
        arguments = parsed.arguments if isinstance(parsed, ParsedCall) else None
        turn = {"role": "assistant", "content": call}
        message = {"role": "tool", "name": name or "error", "content": result}
        eos = self.tokenizer.decode(episode.ids[-1:]) if episode.ended_with_eos else None
        delta = self.delta([*context.conversation, *episode.messages], turn, message, eos)
        episode.messages += [turn, message]
        ids = self.tokenizer(delta, add_special_tokens=False)["input_ids"]
        return Answer(ids, ok, {"name": name, "arguments": arguments, "result": result, "ok": ok}, True)

    def delta(self, before: list[dict], turn: dict, message: dict, eos: str | None) -> str:
        """The text after ``turn``'s content that ``message`` adds, with the next turn's cue;
        without the end-of-turn ``eos`` the policy sampled already."""
        base = self.render([*before, turn], False)
        content = turn["content"] if turn["content"] in base else turn["content"].strip()
        end = base.rfind(content) + len(content)
        full = self.render([*before, turn, message], True)
        if content not in base or not full.startswith(base[:end]):
            raise ValueError(self._unstable("a tool message changes the text before it"))
        text = full[end:]
        return text[len(eos) :] if eos and text.startswith(eos) else text

    def _run(self, parsed: ParsedCall | str, functions: dict[str, Callable[..., Any]]) -> tuple[str, bool]:
        """The call's result as text and whether it succeeded; every failure is a message."""
        if isinstance(parsed, str):
            return f"error: {parsed}", False
        fn = functions.get(parsed.name)
        if fn is None:
            return f"error: no tool is named {parsed.name!r}; the tools are {', '.join(functions)}", False
        try:
            inspect.signature(fn).bind(**parsed.arguments)
        except TypeError as err:
            return f"error: wrong arguments for {parsed.name}: {err}", False
        try:
            value = call_within(lambda: fn(**parsed.arguments), self.timeout, f"tool {parsed.name!r}")
        except CallTimeout:
            return f"error: {parsed.name} took longer than {self.timeout:g}s", False
        except Exception as err:  # the tool's own failure: the model reads it, the run goes on
            return f"error: {parsed.name} raised {type(err).__name__}: {err}", False
        return (value if isinstance(value, str) else json.dumps(value, default=str)), True

    def _reset(self, row: dict[str, Any]) -> tuple[Any, str | None]:
        env = self.factory()
        reset = getattr(env, RESET, None)
        text = reset(**accepted_kwargs(reset, row)) if reset is not None else None
        return env, text

    def _functions(self, env: Any) -> dict[str, Callable[..., Any]]:
        """The tools by name: the functions, and ``env``'s methods bound to it."""
        functions = {fn.__name__: fn for fn in self.tools}
        if self.factory is not None:
            functions.update({name: getattr(env, name) for name in environment_tools(self.factory)})
        return functions

    def conversation(self, prompt: Prompt, reset_text: str | None) -> list[dict[str, Any]]:
        """The prompt's messages, with the reset text on its last user message and, where the
        template does not render tools, their schemas in the system message."""
        messages = [dict(m) for m in prompt_messages(prompt, self.system_prompt)]
        if reset_text:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            last = users[-1] if users else len(messages) - 1
            messages[last]["content"] = f"{messages[last]['content']}\n\n{reset_text}"
        if not self.renders_tools:
            shown = self.tools_text()
            if messages[0]["role"] == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{shown}"
            else:
                messages.insert(0, {"role": "system", "content": shown})
        return messages

    def tools_text(self) -> str:
        """:data:`TOOLS_SYSTEM_PROMPT` with the tools' schemas and the format's call."""
        schemas = "\n".join(json.dumps(schema) for schema in self.schemas)
        return TOOLS_SYSTEM_PROMPT.replace("{tools}", schemas).replace("{call}", self.format.example)

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


class EnvironmentReward(BaseReward):
    """Each completion's environment's ``reward()``: the score of its finished episode (needs an
    ``environment_factory`` whose class has a ``reward`` method)."""

    needs = ("environments",)

    def __call__(
        self, prompts: list[str], responses: list[str], environments: list[Any] | None = None, **kwargs: Any
    ) -> RewardOutput:
        if environments is None or any(getattr(env, SCORE, None) is None for env in environments):
            raise ValueError(
                "EnvironmentReward scores each completion's environment with its reward() method: set "
                "environment_factory to a class that has one"
            )
        return RewardOutput(scores=[float(env.reward()) for env in environments])


ToolsArgument: TypeAlias = list[Callable[..., Any]] | None


@dataclass
class StoredTools:
    """The module's ``tools`` and ``environment_factory`` as its hyperparameters keep them (import
    paths: specs.py), and as the rollouts use them (the functions and the class)."""

    tools: list[str] | None
    environment_factory: str | None
    functions: list[Callable[..., Any]]
    factory: type | None

    @property
    def names(self) -> list[str]:
        return tool_names(self.functions, self.factory)


def stored_tools(tools: Sequence[Callable[..., Any] | str] | None, environment_factory: Any) -> StoredTools:
    """``tools`` and ``environment_factory`` (objects or import paths) both ways. One with no
    import path (a lambda, a local function or class, one defined in ``__main__``) is refused: a
    checkpoint, a saved config or another process could not build it back."""
    functions = [from_spec(t, Callable[..., Any]) if isinstance(t, str) else t for t in tools or []]
    factory = (
        from_spec(environment_factory, type) if isinstance(environment_factory, str) else environment_factory
    )
    for name, obj in [*(("tools", fn) for fn in functions), ("environment_factory", factory)]:
        if obj is not None and (not callable(obj) or import_path(obj) is None):
            raise ValueError(
                f"{name} takes importable functions and classes (module.name), so that a checkpoint "
                f"and a saved config can name them; {obj!r} has no import path (a lambda, a local "
                "definition, or one in __main__?): define it in a module"
            )
    if factory is not None and not inspect.isclass(factory):
        raise ValueError(f"environment_factory must be a class, made once per completion; got {factory!r}")
    paths = [import_path(fn) for fn in functions] if tools is not None else None
    return StoredTools(paths, None if factory is None else import_path(factory), functions, factory)
