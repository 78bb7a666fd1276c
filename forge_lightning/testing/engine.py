"""An engine whose completions the test writes: each turn of the policy is text from a script.

It sits where a generation engine sits (rollout/engines/base.py's ``GenerationBackend``), so the
rest is the package's own: the tool sampler (rollout/tool_sampler.py) reads the calls a turn
wrote in its format, runs the tools, appends their answers as the chat template's ``tool`` turn
and asks for the next turn, which is the script's next. Each turn ends with the EOS, where the
sampler reads it whole: every call it wrote runs (up to the cap of calls), as in a real run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.engines.base import Completions, EngineCapabilities, GenerationRequest


@dataclass
class _Row:
    """A completion being written: which it is, its script's turn written last, the input it was
    written after, and what was written."""

    prompt: int
    index: int
    turn: int
    input: list[int]
    written: list[int]

    def kept_in(self, ids: list[int]) -> int:
        """How much of what this row wrote ``ids`` (a later round's input) goes on with after the
        row's input: 0 where it does not start with that input and at least one written token. A
        row that goes on holds its turn, then the answer."""
        n = len(self.input)
        if len(ids) <= n or ids[:n] != self.input:
            return 0
        same = 0
        for mine, theirs in zip(self.written, ids[n:]):
            if mine != theirs:
                break
            same += 1
        return same


class ScriptedEngine:
    """A generation engine that writes ``scripts[p][j][k]``, then the EOS, as turn ``k`` of
    completion ``j`` of prompt ``p`` of a rollout: a round of prompts starts a rollout, the rows of
    a later round are those of the last that called a tool, each with the tool's answer appended."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, scripts: Sequence[Sequence[Sequence[str]]]
    ) -> None:
        self.tokenizer, self.scripts = tokenizer, [[list(turns) for turns in group] for group in scripts]
        self.rows: list[_Row] = []  # the last round's

    # Each turn ends with the EOS, where the tool sampler reads it whole: no stop rule is needed.
    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        """Completion ids ``(N*group_size, Lc)``, right-padded: each row's next scripted turn."""
        self.capabilities.check(request, type(self).__name__)
        prompt_ids, prompt_mask, group_size = request.prompt_ids, request.prompt_mask, request.group_size
        inputs = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        rows = self._continued(inputs) if group_size == 1 else None
        if rows is None:
            rows = self._started(inputs, group_size)
        out = []
        for row in rows:
            row.written = self._turn(row)[: request.params.max_new_tokens]
            out.append(row.written)
        self.rows = rows
        width = max(len(ids) for ids in out)
        padded = [ids + [self.tokenizer.pad_token_id] * (width - len(ids)) for ids in out]
        return Completions(torch.tensor(padded, dtype=torch.long, device=prompt_ids.device))

    def sync_weights(self, model) -> None:
        pass

    def _started(self, inputs: list[list[int]], group_size: int) -> list[_Row]:
        """The first round of a rollout: ``group_size`` rows per prompt, each its script's first turn."""
        sizes = [len(group) for group in self.scripts]
        if len(inputs) != len(self.scripts) or any(size != group_size for size in sizes):
            raise ValueError(
                f"the script has {sizes} completions for its prompts; the rollout asked for "
                f"{group_size} for each of {len(inputs)} prompts"
            )
        return [_Row(p, j, 0, ids, []) for p, ids in enumerate(inputs) for j in range(group_size)]

    def _continued(self, inputs: list[list[int]]) -> list[_Row] | None:
        """The rows of a later round, each matched to the last round's row it continues (None
        where one continues none: a new rollout), at its script's next turn. The rows that go on
        keep their order, and each is the one of the rows left whose writing it keeps most of
        (the first of those that tie: completions that wrote the same after the same input)."""
        rows, at = [], 0
        for ids in inputs:
            kept = [row.kept_in(ids) for row in self.rows[at:]]
            if not kept or max(kept) == 0:
                return None
            at += kept.index(max(kept))
            last = self.rows[at]
            rows.append(_Row(last.prompt, last.index, last.turn + 1, ids, []))
            at += 1
        return rows

    def _turn(self, row: _Row) -> list[int]:
        """The ids of ``row``'s scripted turn and the EOS; ValueError where the script has no such turn."""
        turns = self.scripts[row.prompt][row.index]
        if row.turn >= len(turns):
            raise ValueError(
                f"completion {row.index} of prompt {row.prompt} called a tool in its last scripted "
                f"turn ({turns[-1]!r:.200}), and the rollout asks for the turn after the tool's "
                "answer: add it to the script (a turn without a call ends the completion)"
            )
        # A model writes characters: a special token's text in a turn is text.
        text = self.tokenizer(turns[row.turn], add_special_tokens=False, split_special_tokens=True)
        return [*text["input_ids"], self.tokenizer.eos_token_id]
