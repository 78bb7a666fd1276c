"""Seeded grade-school arithmetic word problems, written as GSM8K-format JSON-lines files.

A task of the same kind as GSM8K that a small model can partly do: word problems of one or two
operations on small numbers, each answer computed from the operands when the problem is made.
Problems are split into three disjoint parts: ``train`` (to train on), ``dev`` (to choose
settings on) and ``heldout`` (measured once, at the end). No ``(template, operand tuple)``
appears in two parts; only the person's name varies on top of it, and it is not part of the key.

:func:`write_task` writes them as GSM8K rows (``question``, ``answer`` ending in ``#### <n>``)::

    <out>/train.jsonl        the train part
    <out>/test.jsonl         the held-out part (PromptDataModule reads "test" as its validation split)
    <out>/dev.jsonl          the dev part
    <out>/dev/train.jsonl    the train part again, and
    <out>/dev/test.jsonl     the dev part: point a run's in-training validation here
    <out>/manifest.json      seed, variant, sizes and the templates used

so that ``PromptDataModule(source="local", path=<out>)`` trains on the train part and validates on
the held-out part, ``path=<out>/dev`` validates on the dev part, and
``load_gsm8k("dev", path=<out>)`` reads the dev part alone. Regenerate with one command::

    python -m forge_lightning.data.arithmetic --out runs/data/arith
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_lightning.data.gsm8k import format_prompt
from forge_lightning.run.fileio import write_atomically

DEFAULT_OUT = "runs/data/arith"
PARTS = ("train", "dev", "heldout")
# File stem each part is written under; "test" is the split PromptDataModule validates on.
_FILE_STEM = {"train": "train", "dev": "dev", "heldout": "test"}

_NAMES = (
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
CALC_SCALE = Scale(max_term=99, max_factor=25, min_term=10, min_factor=3)
"""The calculator variants' operands: two-digit addends, factors 3-25."""
MULTISTEP_SIZES = (("train", 800), ("dev", 200), ("heldout", 200))


@dataclass(frozen=True)
class Variant:
    """A task: which templates, at which operand scale, and its default part sizes."""

    templates: tuple[str, ...]
    scale: Scale = Scale()
    sizes: tuple[tuple[str, int], ...] = (("train", 500), ("dev", 200), ("heldout", 300))
    train_extra: tuple[str, ...] = ()
    """templates of the train part alone (a curriculum: easier shapes mixed into training); the
    dev and held-out parts stay those of ``templates`` alone, the same problems as without them."""


VARIANTS: dict[str, Variant] = {
    "add_sub": Variant(("add_more", "add_days", "sub_give", "sub_eat")),
    "one_step": Variant(ONE_STEP),
    "two_step": Variant(TWO_STEP),
    "mixed": Variant(ONE_STEP + TWO_STEP),
    "mixed_small": Variant(ONE_STEP + TWO_STEP, Scale(max_term=10, max_factor=6)),
    # Eight add/subtract stories on numbers up to 12 (744 distinct problems): base greedy dev
    # accuracy about 0.2 at 96 new tokens, where numbers up to 20 give about 0.1.
    "add_sub_small": Variant(ADD_SUB, Scale(max_term=12), (("train", 250), ("dev", 100), ("heldout", 200))),
    # For tool use (a calculator): two-digit addends, factors 3-25, every one-step shape and the
    # two-step ones; a 135M model computes few of these right alone.
    "calc": Variant(
        ONE_STEP + TWO_STEP,
        CALC_SCALE,
        (("train", 600), ("dev", 200), ("heldout", 300)),
    ),
    # The calc variant without its one-step sums and differences: the one-step products and
    # quotients and the two-step shapes (7 templates). Tried as the recipe's first stage with seed 7
    # (notebooks/chains.ipynb, calcprod_seed7), whose calc stage on `calc` leaves it adding the
    # numbers of problems that need a product: no take-off in its first 12 steps (fewer rewards).
    "calc_products": Variant(
        ("mul_boxes", "div_share") + TWO_STEP,
        CALC_SCALE,
        (("train", 600), ("dev", 200), ("heldout", 300)),
    ),
    # Chains for a calculator: every problem takes two or three results (the calc variant's
    # two-step shapes and five three-step ones) on its two-digit addends and factors 3-25.
    "multistep": Variant(
        TWO_STEP + THREE_STEP,
        CALC_SCALE,
        MULTISTEP_SIZES,
    ),
    # multistep's dev and held-out parts, its train part mixed with the calc variant's one-step
    # shapes (6 of its 16 templates): one result is rewarded early, the rest needs chains.
    "multistep_mixed": Variant(
        TWO_STEP + THREE_STEP,
        CALC_SCALE,
        MULTISTEP_SIZES,
        train_extra=ONE_STEP,
    ),
    # The same, its train part mixed with the one-step product and quotient shapes alone (2 of its
    # 12 templates): no one-step sum or difference to reward adding the problem's first numbers,
    # the habit seed 7 fell into on multistep_mixed. Tried as the recipe's chains stage with seed 7
    # (notebooks/chains.ipynb, mul_chains_seed7): fewer rewards, completions ran on to the token cap.
    # The unseen part is drawn apart from multistep's and multistep_mixed's parts, not this train
    # part's: one of its 800 problems has the shape and operands of an unseen problem.
    "multistep_mul": Variant(
        TWO_STEP + THREE_STEP,
        CALC_SCALE,
        MULTISTEP_SIZES,
        train_extra=("mul_boxes", "div_share"),
    ),
}
DEFAULT_VARIANT = "add_sub"


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


def generate(
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    variant: str | Variant = DEFAULT_VARIANT,
) -> dict[str, list[Problem]]:
    """Draw ``sizes[part]`` problems for each of :data:`PARTS`, disjoint in ``(template, operands)``.

    Parts are filled in the order heldout, dev, train from one seeded stream, so a larger train
    part leaves the held-out and dev parts unchanged. Templates take turns (round robin, in a
    seeded order), so each part holds them in near-equal numbers.

    Args:
        sizes: problems per part; default the variant's (add_sub: 500 train, 200 dev, 300 held-out).
        seed: the seed of the whole draw.
        variant: a :data:`VARIANTS` name or a :class:`Variant`.
    """
    if isinstance(variant, str) and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {sorted(VARIANTS)}")
    spec = VARIANTS[variant] if isinstance(variant, str) else variant
    sizes = dict(spec.sizes) if sizes is None else dict(sizes)
    if set(sizes) != set(PARTS) or any(n < 0 for n in sizes.values()):
        raise ValueError(f"sizes needs a non-negative count for each of {PARTS}, got {sizes}")
    unknown = [name for name in spec.templates + spec.train_extra if name not in TEMPLATES]
    if unknown or not spec.templates:
        raise ValueError(f"unknown or no templates: {unknown or spec.templates}")
    rng = random.Random(seed)
    order = list(spec.templates)
    rng.shuffle(order)
    seen: set[tuple[str, Operands]] = set()
    parts: dict[str, list[Problem]] = {}
    turn = 0
    for part in ("heldout", "dev", "train"):
        if part == "train" and spec.train_extra:  # drawn after dev: the other parts stay as they were
            extra = list(spec.train_extra)
            rng.shuffle(extra)
            order, turn = order + extra, 0
        problems: list[Problem] = []
        misses = 0
        while len(problems) < sizes[part]:
            template = TEMPLATES[order[turn % len(order)]]
            turn += 1
            operands = template.draw(rng, spec.scale)
            if (template.name, operands) in seen:
                misses += 1
                if misses > 100 * (sizes[part] + 100):
                    raise ValueError(f"the operand space is too small for {sum(sizes.values())} problems")
                continue
            seen.add((template.name, operands))
            problems.append(template.problem(operands, *_NAMES[rng.randrange(len(_NAMES))]))
        parts[part] = problems
    return {part: parts[part] for part in PARTS}


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    write_atomically(path, lambda staging: staging.write_text(text, encoding="utf-8"))


def write_task(
    out: str | Path,
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    variant: str = DEFAULT_VARIANT,
) -> dict[str, Path]:
    """Generate the task and write it under ``out`` (layout in the module docstring).

    Returns the path of each part's file (``train``, ``dev``, ``heldout``). The multistep variants'
    phrasing-held-out part is written by ``python -m forge_lightning.data.arithmetic_unseen``.
    """
    out = Path(out)
    parts = generate(sizes, seed, variant)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dev").mkdir(exist_ok=True)
    files: dict[str, Path] = {}
    for part, problems in parts.items():
        rows = [p.gsm8k_row() for p in problems]
        files[part] = out / f"{_FILE_STEM[part]}.jsonl"
        _write_jsonl(files[part], rows)
    _write_jsonl(out / "dev" / "train.jsonl", [p.gsm8k_row() for p in parts["train"]])
    _write_jsonl(out / "dev" / "test.jsonl", [p.gsm8k_row() for p in parts["dev"]])
    manifest = {
        "seed": seed,
        "variant": variant,
        "scale": vars(VARIANTS[variant].scale),
        "templates": {name: TEMPLATES[name].text for name in VARIANTS[variant].templates},
        "train_extra": {name: TEMPLATES[name].text for name in VARIANTS[variant].train_extra},
        "sizes": {part: len(problems) for part, problems in parts.items()},
        "files": {part: files[part].name for part in PARTS},
        "regenerate": f"python -m forge_lightning.data.arithmetic --out {out} --seed {seed} "
        f"--variant {variant} --train {len(parts['train'])} --dev {len(parts['dev'])} "
        f"--heldout {len(parts['heldout'])}",
    }
    manifest_text = json.dumps(manifest, indent=2) + "\n"
    write_atomically(out / "manifest.json", lambda s: s.write_text(manifest_text, encoding="utf-8"))
    return files


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.data.arithmetic",
        description="Write the seeded arithmetic word-problem task as GSM8K-format JSON-lines files.",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default=DEFAULT_VARIANT)
    parser.add_argument("--train", type=int, default=None, help="train problems (default: the variant's)")
    parser.add_argument("--dev", type=int, default=None, help="dev problems, for choosing settings")
    parser.add_argument("--heldout", type=int, default=None, help="held-out problems (test.jsonl)")
    args = parser.parse_args(argv)
    sizes = dict(VARIANTS[args.variant].sizes)
    given = {"train": args.train, "dev": args.dev, "heldout": args.heldout}
    sizes.update({part: n for part, n in given.items() if n is not None})
    files = write_task(args.out, sizes, args.seed, args.variant)
    for part, path in files.items():
        print(f"{part:8s} {sizes[part]:6d} problems -> {path}")


if __name__ == "__main__":
    main()
