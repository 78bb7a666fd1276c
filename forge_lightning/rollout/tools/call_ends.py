"""Where a function call ends in the policy's tokens, for every call format: at the format's
closing text (``</tool_call>``), whatever the tokenizer merges it with, or, for a format without
one (Llama's JSON), with the policy's turn, at its end-of-turn token. :class:`CallStop` stops a
``generate`` row there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import StoppingCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.tools.parsers import CallFormat

# Tokens of a row's tail decoded to look for the end of a call, beyond the stop string's characters.
TAIL_MARGIN = 8


class CallEnds:
    """The end of a call in ``format`` as ``tokenizer``'s tokens show it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, format: CallFormat) -> None:
        self.tokenizer, self.format = tokenizer, format
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        stop = format.stop
        # Where a call ends with its turn (no stop text), no token ends one mid-turn.
        self.ends_call = torch.tensor([bool(stop) and stop[-1] in piece for piece in pieces])  # (V,)

    def may_end_a_call(self, token: int) -> bool:
        """Whether a call can end at ``token``: only then is the tail looked at."""
        return 0 <= token < len(self.ends_call) and bool(self.ends_call[token])

    def ends_with_call(self, tail: Sequence[int]) -> bool:
        """Whether ``tail`` (a row's last tokens) ends a call: its text ends with the format's stop
        string, or its last token completes one. A tokenizer may merge the stop's last characters
        with the next call's first (``</tool_call><tool_call>`` written with a ``><`` token): the
        call ends there all the same. A format whose calls end with the turn has none mid-turn."""
        stop = self.format.stop
        if stop is None:
            return False
        tail = list(tail[-(len(stop) + TAIL_MARGIN) :])
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        if text.rstrip().endswith(stop):
            return True
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=True)
        return text.count(stop) > before.count(stop)

    def call_in(self, turn: Sequence[int]) -> str | None:
        """The text of the policy's ``turn`` (its tokens so far) when it ends with a call. A call
        that ends with its turn (Llama's JSON) is read at the end-of-turn token, the turn whole."""
        turn = list(turn)
        if not turn:
            return None
        if self.format.stop is None:
            text = self.tokenizer.decode(turn, skip_special_tokens=True)
            return text if self.format.ends_with_call(text) else None
        return self.tokenizer.decode(turn, skip_special_tokens=True) if self.ends_with_call(turn) else None


class CallStop(StoppingCriteria):
    """Stops each row of a ``generate`` call whose turn ends with a call (the format's stop
    string). ``start``: the input's width; ``prior[i]``: row ``i``'s tokens of the current turn in
    the input already; ``enabled[i]`` False for a row that may make no more calls."""

    def __init__(self, ends: CallEnds, start: int, prior: Sequence[int], enabled: Sequence[bool]) -> None:
        self.ends, self.start, self.prior, self.enabled = ends, start, list(prior), list(enabled)

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> Tensor:
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)
        last = input_ids[:, -1].cpu().clamp(0, len(self.ends.ends_call) - 1)
        for row in self.ends.ends_call[last].nonzero().flatten().tolist():
            if self.enabled[row]:
                width = min(
                    len(self.ends.format.stop) + TAIL_MARGIN,
                    self.prior[row] + input_ids.shape[1] - self.start,
                )
                stop[row] = width > 0 and self.ends.ends_with_call(input_ids[row, -width:].tolist())
        return stop
