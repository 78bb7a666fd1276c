"""An agent's episode as the endpoint records it: its calls in token ids, and the chains they make.

Every call the agent makes through its client is recorded with the ids of its prompt and of the
completion the policy sampled. A call's prompt is built from those ids, never from the history
rendered again: where the request's messages begin with an earlier call's messages and the reply
the endpoint gave it (compared as data, the reply as it was sent), the prompt is that call's prompt
and sampled ids, then the tokens the chat template adds for the messages after them (the tool
results, a user turn; :func:`~forge_lightning.rollout.tools.functions.template_delta`). Any other
request is rendered whole, its tools shown as the template shows them, or where it does not, in
the system message as for function tools (``TOOLS_SYSTEM_PROMPT``).

A call *extends* a chain when its prompt ids begin, token for token, with the chain's last call's
prompt + completion ids; the tokens between are what the agent inserted (masked in the loss). A call
that extends no chain starts a new one, and so does one whose chain grew while it was sampled
(another call from the same history answered first): each call of a chain extends the one before.
The episode is the chain with the most calls (the most sampled tokens on a tie, then the first);
the calls of the other chains were served but are not trained: they are counted
(``agent_calls_dropped``) and dropped, since a group holds one completion per episode. So are the
calls answered with an error and those answered empty once the budget was spent: every call the
endpoint answers is in a chain or counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.control_tokens import encode_marked, mark_data
from forge_lightning.rollout.tools.functions import template_delta, tools_system_text, with_system_text
from forge_lightning.rollout.tools.parsers import CallFormat, HermesToolCalls


@dataclass
class Call:
    """One chat completion the endpoint served: the request's messages (compared as data, and as
    the template renders them), its prompt and sampled ids, and the reply it sent."""

    keys: list[tuple]  # the request's messages as message_key gives them
    shown: list[dict[str, Any]]  # the same as the chat template renders them
    prompt_ids: list[int]
    completion_ids: list[int]  # sampled, through the EOS when the policy wrote one
    ended: bool  # the completion ends with an EOS
    text: str  # the completion's text, special tokens removed
    reply: dict[str, Any]  # the assistant message sent back (content, tool_calls)
    messages: list[dict[str, Any]]  # the request's messages as the agent sent them

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class Chain:
    """Calls each of which extends the one before; ``budget_hit``: a call was cut (or refused) at
    the episode's ``max_new_tokens``."""

    calls: list[Call] = field(default_factory=list)
    budget_hit: bool = False

    @property
    def ids(self) -> list[int]:
        return self.calls[-1].ids

    @property
    def sampled(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)

    def tokens(self, start: int) -> tuple[list[int], list[int]]:
        """The chain's ids from position ``start`` of its first prompt on, and 1 where the policy
        sampled the token, 0 where the agent inserted it (its first prompt past ``start``, then
        the turns it added before each later call)."""
        ids, sampled = list(self.calls[0].prompt_ids[start:]), [0] * (len(self.calls[0].prompt_ids) - start)
        done = len(self.calls[0].prompt_ids)
        for call in self.calls:
            inserted = call.prompt_ids[done:]
            ids += inserted + call.completion_ids
            sampled += [0] * len(inserted) + [1] * len(call.completion_ids)
            done = len(call.ids)
        return ids, sampled


def message_key(message: dict[str, Any]) -> tuple:
    """A message as data, for comparing it with one the endpoint saw or sent: its role, text,
    tool calls (id, name, arguments), tool_call_id and name. The client's extra fields (refusal,
    audio, ...) and ``None`` vs an empty content do not count."""
    calls = tuple(
        (c.get("id"), c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
        for c in message.get("tool_calls") or []
    )
    return (
        message.get("role"),
        content_text(message.get("content")),
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    )


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


class EpisodeLog:
    """The calls of one episode (one agent run), by chain; see the module docstring.

    ``max_new_tokens``: the tokens a chain may add after its first prompt, the policy's and the
    agent's together. ``call_format``: how the policy writes a call, which a request's tools are
    shown with in the system message where the chat template does not render tools.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, call_format: CallFormat | None = None
    ) -> None:
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.format = call_format or HermesToolCalls()
        self.chains: list[Chain] = []
        self.refused = 0  # calls answered with an error (a bad request, a template that failed)
        self.spent_calls = 0  # calls answered empty: their chain's budget was spent

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], Chain | None, list[dict[str, Any]]]:
        """The prompt ids of a request, the chain it extends (None: it starts one) and its
        messages as the template renders them. ValueError where the template cannot render them."""
        keys = [message_key(m) for m in messages]
        shown, ids = None, None
        earlier = self._continued(keys)
        if earlier is not None:
            later = [self._shown(m) for m in messages[len(earlier.keys) + 1 :]]
            turn = {"role": "assistant", "content": earlier.text}
            eos = self.tokenizer.decode(earlier.completion_ids[-1:]) if earlier.ended else None
            delta = template_delta(self._render(tools), earlier.shown, turn, later, eos)
            if delta is not None:
                shown = [*earlier.shown, turn, *later]
                ids = earlier.ids + encode_marked(self.tokenizer, delta)
        if ids is None:
            shown = [self._shown(m) for m in messages]
            if tools and not self._renders(tools):
                shown = with_system_text(shown, tools_system_text(tools, self.format))
            ids = encode_marked(self.tokenizer, self._render(tools)(shown, True))
        return ids, self._extended(ids), shown

    def room(self, prompt_ids: list[int], chain: Chain | None) -> int:
        """The tokens a call with ``prompt_ids`` that extends ``chain`` may sample."""
        start = len(chain.calls[0].prompt_ids) if chain is not None else len(prompt_ids)
        return self.max_new_tokens - (len(prompt_ids) - start)

    def record(self, call: Call, chain: Chain | None) -> Chain:
        """Add ``call`` to ``chain``, the one its prompt extended when it came (:meth:`prompt`), or to
        a new chain where there was none or ``chain`` has grown since (a call from the same history
        was answered meanwhile: appending this one would train its tokens after that one's); the chain."""
        if chain is None or call.prompt_ids[: len(chain.ids)] != chain.ids:
            chain = Chain()
            self.chains.append(chain)
        chain.calls.append(call)
        return chain

    def spent(self, chain: Chain | None) -> None:
        """A call answered empty, for ``chain``'s budget is spent: the chain is cut; the call is counted."""
        self.spent_calls += 1
        if chain is not None:
            chain.budget_hit = True

    def episode(self) -> Chain | None:
        """The chain trained: the one with the most calls, then the most sampled tokens, then the first."""
        if not self.chains:
            return None
        return max(self.chains, key=lambda c: (len(c.calls), c.sampled))  # max keeps the first of ties

    @property
    def calls(self) -> int:
        return sum(len(c.calls) for c in self.chains)

    def dropped(self) -> int:
        """Calls answered and not trained: outside the episode's chain, refused, or past the budget."""
        episode = self.episode()
        return self.calls - (len(episode.calls) if episode else 0) + self.refused + self.spent_calls

    def _continued(self, keys: list[tuple]) -> Call | None:
        """The latest call with the most messages whose messages and reply begin ``keys``."""
        best = None
        for chain in self.chains:
            for call in chain.calls:
                head = [*call.keys, message_key(call.reply)]
                if len(keys) > len(head) and keys[: len(head)] == head:
                    if best is None or len(call.keys) >= len(best.keys):
                        best = call
        return best

    def _extended(self, ids: list[int]) -> Chain | None:
        """The chain whose last call's prompt + completion ``ids`` begins with (the longest)."""
        fits = [c for c in self.chains if len(ids) >= len(c.ids) and ids[: len(c.ids)] == c.ids]
        return max(fits, key=lambda c: len(c.ids), default=None)

    def _shown(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message the agent sent as the template renders it: its text is data (control tokens
        in it are marked, to be encoded as plain text); a tool call's arguments are JSON read back."""
        shown: dict[str, Any] = {
            "role": message.get("role"),
            "content": mark_data(self.tokenizer, content_text(message.get("content"))),
        }
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                shown[key] = message[key]
        if message.get("tool_calls"):
            shown["tool_calls"] = [_shown_call(c) for c in message["tool_calls"]]
        return shown

    def _renders(self, tools: list[dict[str, Any]]) -> bool:
        """Whether the chat template shows ``tools`` (else they go into the system message)."""
        user = [{"role": "user", "content": "2 + 3?"}]
        return self._render(tools)(user, True) != self._render(None)(user, True)

    def _render(self, tools: list[dict[str, Any]] | None):
        def render(messages: list[dict[str, Any]], generation: bool) -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, tokenize=False, add_generation_prompt=generation
                )
            except Exception as err:  # a template's raise_exception, or a tokenizer without one
                raise ValueError(f"the chat template cannot render the request's messages: {err}") from err

        return render


def _shown_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    try:
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        pass  # the template renders the arguments as the agent wrote them
    return {"type": "function", "id": call.get("id"), "function": function}
