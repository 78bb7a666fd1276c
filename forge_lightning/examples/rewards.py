"""A custom reward written the way a user would write one, and format checks for configs.

Any plain function ``(prompts, responses, **kwargs) -> list[float]`` is a reward: it names the
batch keys it needs (``references`` here) and gets only those. Reference it from a config by its
import path, alone or as one part of a ``CompositeReward`` (see ``configs/custom_reward.yaml``)::

    model:
      reward: forge_lightning.examples.rewards.concise_answer

The format checks are ``str -> bool`` functions for
:class:`~forge_lightning.rewards.FormatReward`'s ``format_fn``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from forge_lightning.data.gsm8k import extract_answer, normalize_number

# Words a solution may use before the correct-answer reward starts shrinking.
WORD_BUDGET = 60

# "Answer: 42" closing the last line ("... so 6 * 7 = 42. Answer: 42." and "Final answer: 42" count).
_ANSWER_LINE = re.compile(r"(?:^|.*\W)answer:\s*(\S+?)\.?", re.IGNORECASE)
# A last line that names the answer or result and gives a number after it: "The answer is 40 minutes."
_STATED_ANSWER = re.compile(r".*\b(?:answer|result)\b.*\d.*", re.IGNORECASE)
_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?"
_CALCULATION = re.compile(rf"({_NUM})\s*([-+*/x×÷])\s*({_NUM})\s*=\s*({_NUM})")


def concise_answer(prompts: list[str], responses: list[str], references: list[str]) -> list[float]:
    """1.0 for the right final number in at most :data:`WORD_BUDGET` words, less the longer the
    solution runs past it (``WORD_BUDGET / words``), 0.0 for a wrong or missing answer.

    Correctness alone lets completions grow without bound; this asks for the same answer, sooner.
    """
    scores = []
    for response, reference in zip(responses, references):
        correct = extract_answer(response) == normalize_number(str(reference))
        words = max(len(response.split()), 1)
        scores.append(min(1.0, WORD_BUDGET / words) if correct else 0.0)
    return scores


def has_answer_line(text: str) -> bool:
    """The last non-blank line ends with ``Answer: <number>`` (``Answer: $1,800.`` and ``So the final
    answer: 7`` count), nothing after the number but a full stop."""
    match = _ANSWER_LINE.fullmatch(_last_line(text))
    return match is not None and normalize_number(match.group(1)) is not None


def states_answer(text: str) -> bool:
    """The last non-blank line names the answer or result and gives a number after the word
    (``The answer is 7.``, ``So the final result is 40 minutes.``).

    Looser than :func:`has_answer_line`: a small model phrases its conclusion this way far more
    often than in the exact format, so rewarding it a little gives the format reward a place to
    start from.
    """
    return has_answer_line(text) or _STATED_ANSWER.fullmatch(_last_line(text)) is not None


def gives_answer(text: str) -> bool:
    """Some line, not necessarily the last, ends with ``Answer: <number>``.

    The stepping stone nearest the format: a small model that runs on after its answer line, or
    is cut off at the token cap, still earns this, which points it at the exact words while the
    format reward asks it to stop there.
    """
    return any(has_answer_line(line) for line in text.splitlines())


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else ""


def shows_working(text: str) -> bool:
    """At least one worked calculation ``a op b = c`` whose arithmetic is right (``12 * 3 = 36``).

    Checking the arithmetic keeps the policy from earning this with a made-up equation.
    """
    return any(_is_correct(*match) for match in _CALCULATION.findall(text))


def _is_correct(left: str, op: str, right: str, result: str) -> bool:
    try:
        a, b, c = (Decimal(normalize_number(n) or "nan") for n in (left, right, result))
        value = {
            "+": lambda: a + b,
            "-": lambda: a - b,
            "*": lambda: a * b,
            "x": lambda: a * b,
            "×": lambda: a * b,
            "/": lambda: a / b,
            "÷": lambda: a / b,
        }[op]()
    except (InvalidOperation, ZeroDivisionError):
        return False
    # Right to the precision it is written in: 10 / 3 = 3.33 counts (so does = 3), 10 / 3 = 3.4 not.
    return abs(value - c) <= Decimal("0.5").scaleb(min(c.as_tuple().exponent, 0))
