"""Answer checking with HuggingFace's ``math-verify``: LaTeX, fractions, radicals, intervals.

:class:`~forge_lightning.rewards.GSM8KAnswerReward` compares plain numbers and stays the default.
For answers a number comparison gets wrong (``\\frac{1}{2}`` vs ``0.5`` vs ``2/4``,
``\\frac{\\sqrt2}{2}`` vs ``\\frac{1}{\\sqrt2}``), :class:`MathVerifyReward` parses both sides to
sympy and compares them symbolically. ``math-verify`` is an optional dependency::

    pip install "forge-lightning[math]"
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from forge_lightning.rewards.library import BaseReward, RewardOutput, _require_references


def _math_verify() -> ModuleType:
    try:
        import math_verify
    except ImportError as err:
        raise ImportError(
            'MathVerifyReward needs the math-verify package: pip install "forge-lightning[math]"'
        ) from err
    return math_verify


class MathVerifyReward(BaseReward):
    """1.0 when ``math-verify`` finds the response's final answer equal to the reference, else 0.0.

    The response is searched the way math-verify does (a ``\\boxed{}`` first, then LaTeX and plain
    expressions, last match wins). A reference without ``$`` delimiters or ``\\boxed{}`` is read as
    one LaTeX expression (``"\\frac{1}{2}"``, ``"1/2"`` and ``"0.5"`` all work). Needs
    ``references=`` at call time.

    Args:
        float_rounding: decimal places numbers are rounded to before comparing.
        timeout_seconds: limit on parsing and on comparing one pair, so a pathological expression
            cannot stall training; None for no limit. math-verify enforces it with ``SIGALRM``, which
            only the main thread may use, so off the main thread it is not applied.
    """

    needs = ("references",)

    def __init__(self, float_rounding: int = 6, timeout_seconds: int | None = 5) -> None:
        _math_verify()  # fail when the config is built, not at the first step
        if float_rounding < 0:
            raise ValueError(f"float_rounding must be >= 0, got {float_rounding}")
        self.float_rounding = float_rounding
        self.timeout_seconds = timeout_seconds

    def __call__(
        self, prompts: list[str], responses: list[str], references: list[str] | None = None, **kwargs: Any
    ) -> RewardOutput:
        mv = _math_verify()
        on_main = threading.current_thread() is threading.main_thread()
        timeout = self.timeout_seconds if on_main else None
        scores = []
        for ref, response in zip(_require_references(self, references, responses), responses):
            gold = mv.parse(_as_latex(str(ref)), parsing_timeout=timeout)
            if not gold:
                raise ValueError(f"MathVerifyReward could not parse the reference {ref!r}")
            answer = mv.parse(response, parsing_timeout=timeout)
            same = mv.verify(gold, answer, float_rounding=self.float_rounding, timeout_seconds=timeout)
            scores.append(1.0 if same else 0.0)
        return RewardOutput(scores=scores)


def _as_latex(reference: str) -> str:
    """Delimit a bare reference so math-verify reads it as LaTeX (``\\sqrt{2}/2`` parses only so)."""
    if "$" in reference or "\\boxed" in reference:
        return reference
    return f"${reference.strip()}$"
