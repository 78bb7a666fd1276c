"""An inline calculator a completion can call mid-sentence, and the stop that hands it the turn.

Two styles of call. ``annotation`` is GSM8K's: the model writes ``<<48/2=``, the round stops, and
the calculator appends ``24>>``. ``plain``: the model writes ``41 + 29 =``, the round stops, and the
calculator appends `` 70``. The expression is text the model sampled: it is parsed with ``ast``
into a small grammar (numbers, ``+ - * /``, parentheses, unary signs) and evaluated by walking the
tree, never by ``eval``.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import StoppingCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.rollout.tools.protocol import Answer

MAX_EXPRESSION_CHARS = 100
MAX_MAGNITUDE = 10**12
# Tokens of a completion's end decoded first to look for a call. A token is at least one character,
# so any call the calculator accepts fits in them (its expression, ``<<`` or a space before it, the
# ``=``); a call whose text fills them may begin further back, and is read again from the
# completion's start: a call is read whole, never cut at a window.
TAIL_TOKENS = MAX_EXPRESSION_CHARS + 8

CalculatorStyle = Literal["annotation", "plain"]


class CalculatorError(ValueError):
    """An expression the calculator refuses: malformed, outside its grammar, or too large."""


# ``x`` or ``×`` between two operands is a multiplication (``12 x 13``, ``2x(3)``).
_TIMES = re.compile(r"(?<=[\d).])\s*[x×]\s*(?=[\d(.])")
# A number whose thousands are grouped with commas (``80,000``, ``1,234,567.5``): one to three digits
# first, then groups of three. safe_eval and a plain call's numbers (``_NUMBER`` below) share it, so
# that ``1234,567`` is refused by both styles rather than read as 1234567 by one.
_GROUPED_DIGITS = r"\d{1,3}(?:,\d{3})+"
_GROUPED = re.compile(rf"(?<![\d.,]){_GROUPED_DIGITS}(?![\d,])")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def safe_eval(expr: str) -> int | float:
    """The value of an arithmetic expression: an int when it is whole, else a float rounded to 6
    decimals. Raises :class:`CalculatorError` for anything outside the grammar, a division by zero,
    an expression over 100 characters, or a number (given or intermediate) over 1e12 in magnitude.
    A number may group its thousands with commas (``80,000 * 1.5``); any other comma is refused."""
    return _number(_value(_parse(expr)))


def operation_values(expr: str) -> list[int | float]:
    """The value of each operation of an expression the calculator accepts, inner ones first:
    ``2 * 3 + 4`` gives ``[6, 10]``; one it refuses gives none."""
    try:
        tree = _parse(expr)
        _value(tree)  # refused whole if any part is
        return [_number(_value(node)) for node in _operations(tree)]
    except CalculatorError:
        return []


def _operations(node: ast.AST) -> list[ast.AST]:
    """The binary operations under ``node``, each after the ones it is made of."""
    if isinstance(node, ast.BinOp):
        return [*_operations(node.left), *_operations(node.right), node]
    if isinstance(node, ast.UnaryOp):
        return _operations(node.operand)
    return []


def _parse(expr: str) -> ast.AST:
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        ungrouped = _GROUPED.sub(lambda m: m.group().replace(",", ""), _TIMES.sub("*", expr.strip()))
        return ast.parse(ungrouped, mode="eval").body
    except SyntaxError:
        raise CalculatorError("malformed expression") from None


def _number(value: Fraction) -> int | float:
    """An int when it is whole, else a float rounded to 6 decimals."""
    if value.denominator == 1:
        return int(value)
    return round(float(value), 6)


def _value(node: ast.AST) -> Fraction:
    """Exact rational arithmetic, so that ``6/3`` stays the integer 2 and ``0.1+0.2`` is 0.3."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("number too large")
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_value(node.left), _value(node.right))
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _value(node.left), _value(node.right)
        if right == 0:
            raise CalculatorError("division by zero")
        value = left / right
    elif isinstance(node, ast.Tuple):
        raise CalculatorError("a comma that groups no thousands (80,000 does; 1234,567 does not)")
    else:
        what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
        raise CalculatorError(f"{what} is not allowed: numbers, + - * / and parentheses only")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return value


def format_number(value: int | float) -> str:
    """A result as the model reads it: ``70``, ``3.5``, ``0.333333`` (no trailing zeros)."""
    if isinstance(value, int):
        return str(value)
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


# Annotation: ``<<`` then the expression up to the first ``=``, at the very end of the text.
_ANNOTATION = re.compile(r"<<([^<>=\n]*)=$")
# An annotation whose ``<<`` may lie before the text: the text is all its expression (and ``=``).
_ANNOTATION_BODY = re.compile(r"<?[^<>=\n]*=")
# Plain: the longest run of arithmetic characters before a final ``=``, matched on the reversed
# text (searched for from the left, it would be tried at each position of every earlier run) ...
_REVERSED_RUN = re.compile(r"[\d.,()+\-*/x×\s]*")
# ... searched whole up to this many characters (20 ms at worst); a longer run is refused whole.
_LONGEST_RUN = 10 * MAX_EXPRESSION_CHARS
# ... of which the longest suffix that is numbers joined by binary operators, matched with its
# spaces taken out (but for one between two digits or a digit and a point, which no expression
# has: "3. 68 / 11 =" in a numbered list is the call "68 / 11"; nor one after a comma: "3, 100 + 5 ="
# is the call "100 + 5", where "3,100 + 5 =" is 3100 + 5): a pattern with a
# ``\s*`` on each side of every operator could match a run of spaces in many ways, and a sampled
# tail like "1 +  1 +  ... x =" would take exponential time to refuse.
_LOOSE_SPACE = re.compile(r"\s+")
_SPACE_NOT_IN_A_NUMBER = re.compile(r"(?<![\d.,]) | (?![\d.])")
_NUMBER = rf"\(*-?(?:{_GROUPED_DIGITS}|\d+)(?:\.\d+)?\)*"  # thousands grouped with commas or not
_PLAIN_EXPRESSION = re.compile(rf"{_NUMBER}(?:[+\-*/x×]{_NUMBER})+")


def _compact(text: str) -> str:
    return _SPACE_NOT_IN_A_NUMBER.sub("", _LOOSE_SPACE.sub(" ", text.strip()))


def _plain_call_start(run: str) -> int | None:
    """Where in ``run`` (arithmetic characters) the longest expression that ends it begins. It
    begins where a number begins: "12345 * 6789" is never read as "2345 * 6789", nor "1.2.3 + 4" as
    "2.3 + 4", nor "80,000 * 2" or "1,2345 * 2" as "000 * 2" or "2345 * 2" (no number begins just after
    a digit and a comma); one over MAX_EXPRESSION_CHARS is still found whole (and refused by ``respond``)."""
    for start in range(len(run)):
        if run[start] not in "0123456789(-" or (start and run[start - 1] in "0123456789."):
            continue
        if start >= 2 and run[start - 1] == "," and run[start - 2].isdigit():
            continue
        if _PLAIN_EXPRESSION.fullmatch(_compact(run[start:])):
            return start
    return None


def _arithmetic_run(text: str) -> str:
    """The longest end of ``text`` made of arithmetic characters (digits, points, operators,
    parentheses, ``x``, spaces)."""
    return text[len(text) - _REVERSED_RUN.match(text[::-1]).end() :]


class InlineCalculator:
    """Finds a calculator call at the end of a completion's text and writes the answer to it."""

    def __init__(self, style: CalculatorStyle) -> None:
        if style not in ("annotation", "plain"):
            raise ValueError(f"calculator style must be 'annotation' or 'plain', got {style!r}")
        self.style = style

    def trigger(self, text: str) -> str | None:
        """The expression when ``text`` ends with a call (``<<EXPR=`` or ``EXPR =``), else None."""
        if not text.endswith("="):
            return None
        if self.style == "annotation":
            found = _ANNOTATION.search(text)
            return None if found is None else found.group(1)
        run = _arithmetic_run(text[:-1]).strip()
        if len(run) > _LONGEST_RUN:
            # Too long to look for where its call begins (the search takes time growing as its
            # square): refused whole when it ends like a call, never read from a start near its end.
            return run if _plain_call_start(run[-MAX_EXPRESSION_CHARS:]) is not None else None
        start = _plain_call_start(run)
        return None if start is None else run[start:]

    def may_begin_before(self, text: str) -> bool:
        """Whether a call that ``text`` ends with could begin before ``text``: its expression (or
        its annotation) reaches ``text``'s first character, so only what comes before says where."""
        if not text.endswith("="):
            return False
        if self.style == "annotation":
            return _ANNOTATION_BODY.fullmatch(text) is not None
        # A character cut in two by where ``text`` begins decodes as U+FFFD: "×" is two bytes.
        body = text[:-1].lstrip("\ufffd")
        return len(_arithmetic_run(body)) == len(body)

    def respond(self, expr: str) -> tuple[str, bool]:
        """The text appended after a call, and whether the expression was evaluated; a refused one
        gets ``?`` (and annotation's closing ``>>``), so the completion can go on."""
        try:
            result, ok = format_number(safe_eval(expr)), True
        except CalculatorError:
            result, ok = "?", False
        return (f"{result}>>", ok) if self.style == "annotation" else (f" {result}", ok)


class CalculatorTail:
    """Whether a row's completion so far ends with a call, looking at its last ``TAIL_TOKENS``
    tokens, or at all of it when the call may begin before them. Rows are only decoded when their
    last token's text ends with ``=`` (every call does), so most decoding steps decode nothing."""

    def __init__(self, calculator: InlineCalculator, tokenizer: PreTrainedTokenizerBase) -> None:
        self.calculator = calculator
        self.tokenizer = tokenizer
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
        self.ends_with_equals = torch.tensor([p.endswith("=") for p in pieces])  # (V,)

    def expression(self, completion: Sequence[int]) -> str | None:
        """The expression of the call ``completion`` (all its token ids so far) ends with, if
        any: the whole expression, however many tokens it takes."""
        if not completion or not self.may_end_a_call(completion[-1]):
            return None
        text = self.tokenizer.decode(list(completion[-TAIL_TOKENS:]), skip_special_tokens=True)
        if len(completion) > TAIL_TOKENS and self.calculator.may_begin_before(text):
            # Rare (a long run of arithmetic; for annotations, a long line before an "="): read
            # the completion whole, a few microseconds a thousand tokens.
            text = self.tokenizer.decode(list(completion), skip_special_tokens=True)
        return self.calculator.trigger(text)

    def may_end_a_call(self, token: int) -> bool:
        """Whether the text of ``token`` ends with ``=``: only then can the tail end with a call."""
        return 0 <= token < len(self.ends_with_equals) and bool(self.ends_with_equals[token])


class CalculatorStop(StoppingCriteria):
    """Stops each row of a ``generate`` call whose text ends with a calculator call.

    ``start`` is the input's width (the new tokens begin there); ``prior[i]`` how many of row
    ``i``'s completion tokens are in the input already (an earlier round's), so that the text
    looked at is the completion's, never the prompt's; ``enabled[i]`` False for a row that may make
    no more calls.
    """

    def __init__(
        self, tail: CalculatorTail, start: int, prior: Sequence[int], enabled: Sequence[bool]
    ) -> None:
        self.tail = tail
        self.start = start
        self.prior = list(prior)
        self.enabled = list(enabled)

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs) -> Tensor:
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)
        last = input_ids[:, -1].cpu()
        may = self.tail.ends_with_equals[last.clamp(0, len(self.tail.ends_with_equals) - 1)]
        for row in may.nonzero().flatten().tolist():
            if not self.enabled[row]:
                continue
            width = self.prior[row] + input_ids.shape[1] - self.start  # the whole completion so far
            stop[row] = self.tail.expression(input_ids[row, -width:].tolist()) is not None
        return stop


class CalculatorTools:
    """The inline calculator as a :class:`~forge_lightning.rollout.tools.protocol.ToolProtocol`: a call is
    ``<<EXPR=`` or ``EXPR =`` at the completion's end, the answer its text tokenised alone."""

    names = ["calculator"]
    calls_before_eos = False

    def __init__(self, calculator: InlineCalculator, tokenizer: PreTrainedTokenizerBase) -> None:
        self.calculator = calculator
        self.tokenizer = tokenizer
        self.tail = CalculatorTail(calculator, tokenizer)

    def begin(
        self, sampler: Any, prompts: list[Any], rows: dict[str, list[Any]], group_size: int, device: Any
    ) -> tuple[Tensor, Tensor, list[Any]]:
        prompt_ids, prompt_mask = sampler.encode(prompts, device)
        return prompt_ids, prompt_mask, [None] * (len(prompts) * group_size)

    def may_end_a_call(self, token: int) -> bool:
        return self.tail.may_end_a_call(token)

    def call_at(self, episode: Any, completion: Sequence[int]) -> str | None:
        return self.tail.expression(completion)

    def stop(
        self,
        start: int,
        prior: Sequence[int],
        enabled: Sequence[bool],
        segments: Sequence[int],
        eos_ids: Sequence[int],
    ) -> CalculatorStop:
        return CalculatorStop(self.tail, start, prior, enabled)

    def answer(self, calls: Sequence[tuple[Any, str]]) -> list[Answer]:
        return [self._answer(call) for _, call in calls]

    def _answer(self, call: str) -> Answer:
        text, ok = self.calculator.respond(call)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        # The result as a value ("6"), not as the text written after the call (" 6", "6>>").
        result = text.strip().removesuffix(">>")
        entry = {"name": "calculator", "arguments": {"expression": call}, "result": result, "ok": ok}
        return Answer(ids, ok, entry)
