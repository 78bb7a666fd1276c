"""Where the policy's function calls end, for every call format: with its turn, at the
end-of-turn token (an EOS) it samples; the turn is then read whole, and every call it wrote runs.
A model may write several calls in one turn (``<tool_call>...</tool_call><tool_call>...``), and
only the end of the turn says it has written them all: a turn is never cut at its first call
(TRL's and vLLM's rule). :class:`CallStop` marks the rows of a ``generate`` call whose turn ended
holding calls, so that a round can end once enough rows wait for a tool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import StoppingCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.tools.parsers import CallFormat


class CallEnds:
    """The calls of a turn in ``format``, read from ``tokenizer``'s tokens at the turn's end."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, format: CallFormat) -> None:
        self.tokenizer, self.format = tokenizer, format

    def call_in(self, turn: Sequence[int]) -> str | None:
        """The text of the policy's ``turn`` (its tokens before the end-of-turn token) when it
        holds a call: the whole turn, which holds all of them."""
        turn = list(turn)
        if not turn:
            return None
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        return text if self.format.has_calls(text) else None


class CallStop(StoppingCriteria):
    """Stops each row of a ``generate`` call whose turn ended (its last token one of ``eos_ids``)
    holding calls. ``start``: the input's width; ``prior[i]``: row ``i``'s tokens of the current
    turn in the input already; ``enabled[i]`` False for a row that may make no more calls."""

    def __init__(
        self,
        ends: CallEnds,
        start: int,
        prior: Sequence[int],
        enabled: Sequence[bool],
        eos_ids: Sequence[int],
    ) -> None:
        self.ends, self.start, self.prior, self.enabled = ends, start, list(prior), list(enabled)
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        # Each row's turn is read once, at its end: a finished row's padding may be the EOS again.
        self.read: dict[int, bool] = {}

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> Tensor:
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool)  # (B,)
        ended = torch.isin(input_ids[:, -1].cpu(), self.eos)  # (B,)
        for row in ended.nonzero().flatten().tolist():
            if self.enabled[row] and row not in self.read:
                width = self.prior[row] + input_ids.shape[1] - self.start  # the turn, its EOS included
                turn = input_ids[row, -width:-1].tolist() if width > 1 else []
                self.read[row] = self.ends.call_in(turn) is not None
            stop[row] = self.read.get(row, False)
        return stop.to(input_ids.device)
