"""The arithmetic task's problem shapes: the word-problem templates, their operand draws and worked
answers, and the problem one makes (:class:`Problem`). :mod:`forge_lightning.data.arithmetic` groups
them into variants and draws the parts; :mod:`forge_lightning.data.arithmetic_unseen` retells them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from forge_lightning.data.gsm8k import format_prompt

NAMES = (  # the people the problems are told of, with their pronouns
    ("Anna", "She"),
    ("Ben", "He"),
    ("Carla", "She"),
    ("David", "He"),
    ("Emma", "She"),
    ("Farid", "He"),
    ("Grace", "She"),
    ("Hugo", "He"),
    ("Ines", "She"),
    ("Jack", "He"),
    ("Kira", "She"),
    ("Liam", "He"),
)

Operands = tuple[int, ...]


@dataclass(frozen=True)
class Template:
    """One problem shape.

    Args:
        name: unique id; part of the leakage key with the operands.
        ops: number of arithmetic operations the answer takes (1, 2 or 3).
        text: question text with ``{name}``, ``{pronoun}`` and ``{a}``, ``{b}``, ``{c}``, ``{d}`` fields.
        draw: ``(rng, scale) -> operands`` drawing one operand tuple.
        solve: ``operands -> answer`` (an int), computed by construction.
        working: ``operands -> str``, the worked solution written into the GSM8K ``answer`` field.
    """

    name: str
    ops: int
    text: str
    draw: Callable[[random.Random, Scale], Operands]
    solve: Callable[[Operands], int]
    working: Callable[[Operands], str]

    def question(self, operands: Operands, name: str, pronoun: str) -> str:
        fields = dict(zip("abcd", operands))
        return self.text.format(name=name, pronoun=pronoun, **fields)

    def problem(self, operands: Operands, name: str, pronoun: str) -> Problem:
        """The problem these operands make, told of ``name``."""
        q = self.question(operands, name, pronoun)
        return Problem(self.name, operands, q, self.solve(operands), self.working(operands))


@dataclass(frozen=True)
class Scale:
    """Operand ranges: addends in ``[2, max_term]``, factors in ``[2, max_factor]``.

    ``min_term`` / ``min_factor`` raise the lower ends (two-digit operands: 10); a subtrahend is
    then drawn from ``[min_term, a - 1]`` too. Left None, the draws are the original ones, so the
    problems of the variants that predate them stay the same.
    """

    max_term: int = 20
    max_factor: int = 9
    min_term: int | None = None
    min_factor: int | None = None

    @property
    def low_term(self) -> int:
        return 2 if self.min_term is None else self.min_term

    @property
    def low_factor(self) -> int:
        return 2 if self.min_factor is None else self.min_factor

    def least_taken(self, a: int) -> int:
        """The least operand to take away from ``a`` (the most is ``a - 1``)."""
        return 1 if self.min_term is None else min(self.min_term, a - 1)


def _terms(k: int) -> Callable[[random.Random, Scale], Operands]:
    return lambda rng, s: tuple(_term(rng, s) for _ in range(k))


def _term(rng: random.Random, s: Scale) -> int:
    return rng.randint(s.low_term, s.max_term)


def _factor(rng: random.Random, s: Scale) -> int:
    return rng.randint(s.low_factor, s.max_factor)


def _difference(rng: random.Random, s: Scale) -> Operands:
    a = rng.randint(3 if s.min_term is None else s.min_term + 1, s.max_term)
    return a, rng.randint(s.least_taken(a), a - 1)


def _factors(rng: random.Random, s: Scale) -> Operands:
    return _factor(rng, s), _factor(rng, s)


def _add_then_sub(rng: random.Random, s: Scale) -> Operands:
    a, b = _term(rng, s), _term(rng, s)
    return a, b, rng.randint(s.least_taken(a + b), a + b - 1)


def _factors_then_term(rng: random.Random, s: Scale) -> Operands:
    return _factor(rng, s), _factor(rng, s), _term(rng, s)


def _factors_then_less(rng: random.Random, s: Scale) -> Operands:
    a, b = _factor(rng, s), _factor(rng, s)
    return a, b, rng.randint(s.least_taken(a * b), a * b - 1)


def _sum_then_factor(rng: random.Random, s: Scale) -> Operands:
    return _term(rng, s), _term(rng, s), _factor(rng, s)


# Three operations: each answer takes three results, two of them intermediate.


def _two_products(rng: random.Random, s: Scale) -> Operands:
    return _factor(rng, s), _factor(rng, s), _factor(rng, s), _factor(rng, s)


def _sum_less_product(rng: random.Random, s: Scale) -> Operands:
    """``a + b - c * d`` with ``c * d < a + b``: ``c`` a factor up to 9, ``d`` at least 2."""
    a, b = _term(rng, s), _term(rng, s)
    c = rng.randint(s.low_factor, min(s.max_factor, 9, (a + b - 1) // 2))
    return a, b, c, rng.randint(2, min(s.max_factor, (a + b - 1) // c))


def _product_more_less(rng: random.Random, s: Scale) -> Operands:
    a, b, c = _factor(rng, s), _factor(rng, s), _term(rng, s)
    return a, b, c, rng.randint(s.least_taken(a * b + c), a * b + c - 1)


def _sum_times_more(rng: random.Random, s: Scale) -> Operands:
    return _term(rng, s), _term(rng, s), _factor(rng, s), _term(rng, s)


def _difference_times_more(rng: random.Random, s: Scale) -> Operands:
    return (*_difference(rng, s), _factor(rng, s), _term(rng, s))


def _value(expression: str) -> int:
    """The value of ``"a op b"`` (whole numbers; a division here is exact)."""
    left, op, right = expression.split()
    a, b = int(left), int(right)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def _worked(first: str, second: str, op: str) -> str:
    """Two results, then the one that combines them: ``a * b = x``, ``c * d = y``, ``x + y = z``."""
    x, y = _value(first), _value(second)
    return f"{first} = {x}\n{second} = {y}\n{x} {op} {y} = {_value(f'{x} {op} {y}')}"


def _chained(first: str, *steps: tuple[str, int]) -> str:
    """A result carried through ``steps``: ``a * b = x``, ``x + c = y``, ``y - d = z``."""
    lines, value = [f"{first} = {_value(first)}"], _value(first)
    for op, operand in steps:
        result = _value(f"{value} {op} {operand}")
        lines.append(f"{value} {op} {operand} = {result}")
        value = result
    return "\n".join(lines)


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        # One operation.
        Template(
            "add_more",
            1,
            "{name} has {a} apples. {pronoun} picks {b} more apples. How many apples does {name} have now?",
            _terms(2),
            lambda o: o[0] + o[1],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}",
        ),
        Template(
            "add_days",
            1,
            "{name} reads {a} pages on Monday and {b} pages on Tuesday. How many pages does {name} "
            "read in the two days?",
            _terms(2),
            lambda o: o[0] + o[1],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}",
        ),
        Template(
            "sub_give",
            1,
            "{name} has {a} stickers. {pronoun} gives {b} stickers to a friend. How many stickers "
            "does {name} have left?",
            _difference,
            lambda o: o[0] - o[1],
            lambda o: f"{o[0]} - {o[1]} = {o[0] - o[1]}",
        ),
        Template(
            "sub_eat",
            1,
            "There are {a} cookies in a jar. {name} eats {b} of them. How many cookies are left in the jar?",
            _difference,
            lambda o: o[0] - o[1],
            lambda o: f"{o[0]} - {o[1]} = {o[0] - o[1]}",
        ),
        Template(
            "add_class",
            1,
            "A class has {a} boys and {b} girls. How many children are in the class?",
            _terms(2),
            lambda o: o[0] + o[1],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}",
        ),
        Template(
            "add_earn",
            1,
            "{name} has {a} dollars. {pronoun} earns {b} more dollars. How many dollars does {name} "
            "have now?",
            _terms(2),
            lambda o: o[0] + o[1],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}",
        ),
        Template(
            "sub_spend",
            1,
            "{name} has {a} dollars. {pronoun} spends {b} dollars on a book. How many dollars does {name} "
            "have left?",
            _difference,
            lambda o: o[0] - o[1],
            lambda o: f"{o[0]} - {o[1]} = {o[0] - o[1]}",
        ),
        Template(
            "sub_fly",
            1,
            "There are {a} birds in a tree. {b} of them fly away. How many birds are still in the tree?",
            _difference,
            lambda o: o[0] - o[1],
            lambda o: f"{o[0]} - {o[1]} = {o[0] - o[1]}",
        ),
        Template(
            "mul_boxes",
            1,
            "{name} has {a} boxes. Each box holds {b} pencils. How many pencils does {name} have in all?",
            _factors,
            lambda o: o[0] * o[1],
            lambda o: f"{o[0]} * {o[1]} = {o[0] * o[1]}",
        ),
        Template(
            "div_share",
            1,
            "{name} shares {a} candies equally among {b} friends. How many candies does each friend get?",
            # Drawn as (quotient, divisor) and stored as (dividend, divisor): division is exact.
            lambda rng, s: (lambda q, d: (q * d, d))(*_factors(rng, s)),
            lambda o: o[0] // o[1],
            lambda o: f"{o[0]} / {o[1]} = {o[0] // o[1]}",
        ),
        # Two operations.
        Template(
            "add_sub",
            2,
            "{name} has {a} marbles. {pronoun} wins {b} more marbles and then loses {c} marbles. How "
            "many marbles does {name} have now?",
            _add_then_sub,
            lambda o: o[0] + o[1] - o[2],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}\n{o[0] + o[1]} - {o[2]} = {o[0] + o[1] - o[2]}",
        ),
        Template(
            "add_three",
            2,
            "A farm has {a} cows, {b} pigs and {c} sheep. How many animals are on the farm?",
            _terms(3),
            lambda o: o[0] + o[1] + o[2],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}\n{o[0] + o[1]} + {o[2]} = {sum(o)}",
        ),
        Template(
            "mul_add",
            2,
            "{name} buys {a} bags with {b} oranges in each bag. {pronoun} already had {c} oranges. How "
            "many oranges does {name} have now?",
            _factors_then_term,
            lambda o: o[0] * o[1] + o[2],
            lambda o: f"{o[0]} * {o[1]} = {o[0] * o[1]}\n{o[0] * o[1]} + {o[2]} = {o[0] * o[1] + o[2]}",
        ),
        Template(
            "mul_sub",
            2,
            "A tray holds {a} rows of {b} eggs. {name} drops the tray and {c} eggs break. How many "
            "eggs are not broken?",
            _factors_then_less,
            lambda o: o[0] * o[1] - o[2],
            lambda o: f"{o[0]} * {o[1]} = {o[0] * o[1]}\n{o[0] * o[1]} - {o[2]} = {o[0] * o[1] - o[2]}",
        ),
        Template(
            "sum_mul",
            2,
            "{name} buys {a} red pens and {b} blue pens. Each pen costs {c} dollars. How many dollars "
            "does {name} spend?",
            _sum_then_factor,
            lambda o: (o[0] + o[1]) * o[2],
            lambda o: f"{o[0]} + {o[1]} = {o[0] + o[1]}\n{o[0] + o[1]} * {o[2]} = {(o[0] + o[1]) * o[2]}",
        ),
        # Three operations.
        Template(
            "two_products",
            3,
            "{name} buys {a} notebooks that cost {b} dollars each and {c} pens that cost {d} dollars "
            "each. How many dollars does {name} spend?",
            _two_products,
            lambda o: o[0] * o[1] + o[2] * o[3],
            lambda o: _worked(f"{o[0]} * {o[1]}", f"{o[2]} * {o[3]}", "+"),
        ),
        Template(
            "sum_give_groups",
            3,
            "{name} collects {a} shells on Monday and {b} shells on Tuesday. {pronoun} gives {c} "
            "shells to each of {d} friends. How many shells does {name} have left?",
            _sum_less_product,
            lambda o: o[0] + o[1] - o[2] * o[3],
            lambda o: _worked(f"{o[0]} + {o[1]}", f"{o[2]} * {o[3]}", "-"),
        ),
        Template(
            "rows_add_take",
            3,
            "A hall has {a} rows of {b} chairs. Workers bring {c} more chairs, and then {d} chairs are "
            "taken away. How many chairs are in the hall now?",
            _product_more_less,
            lambda o: o[0] * o[1] + o[2] - o[3],
            lambda o: _chained(f"{o[0]} * {o[1]}", ("+", o[2]), ("-", o[3])),
        ),
        Template(
            "sum_price_extra",
            3,
            "{name} buys {a} red pens and {b} blue pens. Each pen costs {c} dollars. {pronoun} also pays "
            "{d} dollars for a bag. How many dollars does {name} spend?",
            _sum_times_more,
            lambda o: (o[0] + o[1]) * o[2] + o[3],
            lambda o: _chained(f"{o[0]} + {o[1]}", ("*", o[2]), ("+", o[3])),
        ),
        Template(
            "left_boxes_loose",
            3,
            "A store has {a} boxes of toys and sells {b} of them. Each box left holds {c} toys, and the "
            "store also has {d} loose toys. How many toys does the store have?",
            _difference_times_more,
            lambda o: (o[0] - o[1]) * o[2] + o[3],
            lambda o: _chained(f"{o[0]} - {o[1]}", ("*", o[2]), ("+", o[3])),
        ),
    )
}

ADD_SUB = ("add_more", "add_days", "sub_give", "sub_eat", "add_class", "add_earn", "sub_spend", "sub_fly")
ONE_STEP = ("add_more", "add_days", "sub_give", "sub_eat", "mul_boxes", "div_share")
TWO_STEP = tuple(name for name, t in TEMPLATES.items() if t.ops == 2)
THREE_STEP = tuple(name for name, t in TEMPLATES.items() if t.ops == 3)


@dataclass(frozen=True)
class Problem:
    template: str
    operands: Operands
    question: str
    answer: int
    working: str

    @property
    def key(self) -> tuple[str, Operands]:
        """What must never repeat across parts: the template and its operand tuple."""
        return self.template, self.operands

    def sample(self, solution: bool = False) -> dict[str, str]:
        """The datamodule's record: the formatted prompt and the reference answer; with
        ``solution``, the worked solution too (``working``)."""
        record = {"prompt": format_prompt(self.question), "reference": str(self.answer)}
        return record | {"solution": self.working} if solution else record

    def gsm8k_row(self) -> dict[str, str]:
        """The GSM8K row format: worked answer ending in ``#### <number>``."""
        return {"question": self.question, "answer": f"{self.working}\n#### {self.answer}"}
