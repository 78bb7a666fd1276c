"""What :class:`~forge_lightning.rollout.tool_sampler.ToolRolloutSampler` asks of a kind of tool.

The sampler runs the turns (generate, find a call, append the answer's tokens, generate again) the
same way for every kind; a :class:`ToolProtocol` says how a call looks and what answers it: the
inline calculator (tools/calculator.py) and typed functions or an environment's methods
(tools/functions.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor
from transformers import StoppingCriteria

from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.rollout.types import Prompt


@dataclass
class Episode:
    """One completion's tokens so far, whether the policy sampled each (1) or a tool wrote it (0),
    its counts, and what the tools keep of it: ``segment`` (where the policy's current turn began,
    after the latest answer), ``context`` (the protocol's own: the conversation; its
    ``environment``, if any, is the ``environments`` fact), ``messages`` (the finished assistant
    and tool turns) and ``log`` (one entry per call). ``max_calls``: the calls it may make in all
    (the sampler's cap), which a turn of several calls must not run past."""

    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    turns: int = 0
    done: bool = False
    ended_with_eos: bool = False
    segment: int = 0
    context: Any = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)
    max_calls: int | None = None
    # The engine's log-prob of each token when the sampler asked for them (the old policy's, or the
    # rollout correction's): a sampled token's as the engine reported it, 0 for a tool's token.
    logp: list[float] = field(default_factory=list)

    def add(self, ids: list[int], sampled: bool, logp: list[float] | None = None) -> None:
        """Append ``ids``, sampled by the policy (with the engine's ``logp`` of each, if
        reported) or written by a tool."""
        self.ids += ids
        self.model += [int(sampled)] * len(ids)
        self.logp += logp[: len(ids)] if sampled and logp is not None else [0.0] * len(ids)


@dataclass
class Answer:
    """A call's answer: the tokens appended to the completion, whether the call succeeded, its
    log entry ``{name, arguments, result, ok, truncated}`` (the ``tool_calls`` fact; with
    ``"abandoned": True`` where the call ran past its timeout in this process and its thread runs
    on), and whether it ends the
    policy's turn (a ``tool`` message does; the calculator's answer is inline). A turn that wrote
    several calls is answered at once: ``others`` are the entries of the calls after the first."""

    ids: list[int]
    ok: bool
    entry: dict[str, Any]
    ends_turn: bool = False
    others: list[dict[str, Any]] = field(default_factory=list)

    @property
    def entries(self) -> list[dict[str, Any]]:
        """One entry per call answered, in the order written."""
        return [self.entry, *self.others]


class ToolProtocol(Protocol):
    """One kind of tool, as the sampler drives it.

    ``names``: the tools' names (one metric each). ``calls_before_eos``: whether the policy's turn
    is read for calls at its end-of-turn token (function calls: every call of the turn runs
    then); the calculator's calls end mid-turn instead, where ``may_end_a_call`` says.
    """

    names: list[str]
    calls_before_eos: bool

    def begin(
        self,
        sampler: RolloutSampler,
        prompts: list[Prompt],
        rows: dict[str, list[Any]],
        group_size: int,
        device: Any,
    ) -> tuple[Tensor, Tensor, list[Any]]:
        """The prompts as left-padded ``(ids, mask)`` on ``device`` (``sampler``'s settings), and
        each completion's context (``P*G`` of them); ``rows``: the batch's fields."""
        ...

    def may_end_a_call(self, token: int) -> bool:
        """Whether a call can end at ``token``: only then is the tail looked at."""
        ...

    def call_at(self, episode: Episode, completion: Sequence[int]) -> Any | None:
        """The call ``completion`` (``episode``'s tokens and this round's so far) ends with, if any."""
        ...

    def stop(
        self,
        start: int,
        prior: Sequence[int],
        enabled: Sequence[bool],
        segments: Sequence[int],
        eos_ids: Sequence[int],
    ) -> StoppingCriteria:
        """The stop for one ``generate`` call, True for each row that waits for a tool: ``start``
        the input's width, per row ``prior`` completion tokens in the input, whether it may call
        (``enabled``), and its turn's start; ``eos_ids`` the tokens that end a turn."""
        ...

    def answer(self, calls: Sequence[tuple[Episode, Any]]) -> list[Answer]:
        """Run each ``(episode, call)`` (those of every row that waits; they may run at once) and
        say what each completion reads back, in order."""
        ...
