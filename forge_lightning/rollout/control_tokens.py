"""Text that did not come from the chat template is data: a tool's result, an error message that
echoes a call the model wrote, an environment's reset text. A control token written in it (ChatML's
``<|im_end|>``, ``<|im_start|>assistant``) must not become the token itself, or the data forges
turns: the context would gain an assistant or user turn no one wrote, and the reward would see it.

:func:`mark_data` wraps each control token in a data string with two private-use characters before
the template renders it; :func:`encode_marked` encodes a rendered text with the template's own
control tokens as tokens and the marked ones as plain text. The template renders the data as it
would (a ``trim`` or an escape still applies), and a text with nothing marked encodes exactly as
``tokenizer(text, add_special_tokens=False)``. transformers 5 does the same inside
``apply_chat_template(sanitize_control_tokens=True)``, which needs a whole conversation tokenised at
once; a tool's answer is the template's text after the earlier turns, and transformers 4 has no
such option.
"""

from __future__ import annotations

import re
from functools import lru_cache

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# Private-use code points: no tokenizer's vocabulary or chat template writes them.
START, END = "\ue000", "\ue001"
_MARKED = re.compile(f"{START}([^{START}{END}]+){END}")


def control_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The tokenizer's special tokens, and its other added tokens that its chat template writes
    (Qwen's ``<tool_response>``), longest first."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    added = tokenizer.added_tokens_decoder.values()
    found = {t.content for t in added if t.special or (t.content in template and not t.content.isspace())}
    found |= {t for t in tokenizer.all_special_tokens if t}
    return tuple(sorted(found, key=len, reverse=True))


@lru_cache(maxsize=16)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(map(re.escape, tokens)) or "(?!)")  # (?!) matches nothing


def mark_data(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """``text`` with each control token wrapped in the markers; markers already in it are dropped,
    so that data cannot mark a token of the template's."""
    text = text.replace(START, "").replace(END, "")
    return _pattern(control_tokens(tokenizer)).sub(lambda m: f"{START}{m.group(0)}{END}", text)


def encode_marked(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of ``text`` (a rendered template): marked control tokens as plain text, the rest as
    the tokenizer encodes it (the template's control tokens as themselves)."""
    pieces = _MARKED.split(text)  # [text, marked token, text, ..., text]
    if len(pieces) == 1:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(pieces[0], add_special_tokens=False)["input_ids"] if pieces[0] else []
    for k, piece in enumerate(pieces[1:], start=1):
        if piece:
            ids += _as_plain_text(tokenizer, piece) if k % 2 else _continued(tokenizer, piece, False)
    return ids


def _as_plain_text(tokenizer: PreTrainedTokenizerBase, token: str) -> list[int]:
    """``token``'s text as ordinary characters. ``split_special_tokens`` leaves an added token that
    is not special whole (a fast tokenizer's ``<tool_response>``): that one goes character by
    character."""
    ids = _continued(tokenizer, token, True)
    own = tokenizer.convert_tokens_to_ids(token)
    if own in ids:
        ids = [i for char in token for i in _continued(tokenizer, char, True)]
    return ids


def _continued(tokenizer: PreTrainedTokenizerBase, piece: str, plain: bool) -> list[int]:
    """The ids of ``piece`` in the middle of a text: encoded after a newline that is then removed,
    so that a SentencePiece tokenizer adds no word-start space of its own."""
    kwargs = {"add_special_tokens": False, "split_special_tokens": plain}
    newline = tokenizer("\n", **kwargs)["input_ids"]
    ids = tokenizer("\n" + piece, **kwargs)["input_ids"]
    if newline and ids[: len(newline)] == newline:
        return ids[len(newline) :]
    return tokenizer(piece, **kwargs)["input_ids"]  # the newline merged into the piece
