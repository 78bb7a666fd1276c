"""The multistep variants' phrasing-held-out part: the trained shapes, told in wordings no part trains on.

The ``multistep`` and ``multistep_mixed`` variants of :mod:`forge_lightning.data.arithmetic` train,
choose settings and are measured on the same ten two- and three-step templates, so their held-out
part says how well a model solves those wordings with new numbers. The ``unseen`` part asks
whether it learned the arithmetic or the sentences: each of its templates is one of the trained
shapes (same operations, same order, same operand draws and worked answer) in a story of its own
that no template of any variant uses. Only the phrasing differs from the shape it retells.

It is drawn from its own stream (seeded by the task seed and the string ``"unseen"``), after and
apart from the other parts, so those stay byte for byte what they were; no ``(shape, operands)``
of theirs is drawn again. ``python -m forge_lightning.data.arithmetic_unseen --out <out> [--seed S]
[--variant multistep]`` (:func:`write_unseen`) writes it beside the files of
:func:`~forge_lightning.data.arithmetic.write_task` as ``<out>/unseen.jsonl`` (GSM8K rows, read
with ``load_gsm8k("unseen", path=<out>)`` or
``PromptDataModule(source="local", path=<out>, val_split="unseen")``), and
``PromptDataModule(source="arithmetic", val_part="unseen")`` draws it in memory.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from forge_lightning.data.arithmetic import VARIANTS, generate
from forge_lightning.data.arithmetic_templates import NAMES, TEMPLATES, Problem, Template
from forge_lightning.run.fileio import write_atomically

UNSEEN_VARIANTS = ("multistep", "multistep_mixed")
UNSEEN_SIZE = 200
UNSEEN_FILE = "unseen.jsonl"
Parts = Mapping[str, Sequence[Problem]]

# (trained shape it retells, name, wording): the fields come in the shape's operand order.
_RETOLD = (
    (
        "add_sub",
        "bus_riders",
        "A bus leaves the depot with {a} riders. At the market {b} people climb on, and at the "
        "park {c} people climb off. How many riders are on the bus after the park?",
    ),
    (
        "add_three",
        "library_shelving",
        "{name} shelves {a} history books in the morning, {b} science books at noon and {c} "
        "poetry books in the evening. How many books does {name} shelve that day?",
    ),
    (
        "mul_add",
        "tulip_bulbs",
        "{name} plants {a} rows of tulips with {b} bulbs in every row. {pronoun} also plants {c} "
        "bulbs along the fence. How many bulbs does {name} plant altogether?",
    ),
    (
        "mul_sub",
        "bakery_muffins",
        "A bakery fills {a} trays with {b} muffins on each tray. By closing time {c} muffins have "
        "been sold. How many muffins are still unsold?",
    ),
    (
        "sum_mul",
        "concert_tickets",
        "{name} books concert seats for {a} adults and {b} children. Every seat is priced at {c} "
        "dollars. What is the total price of the seats, in dollars?",
    ),
    (
        "two_products",
        "fruit_crates",
        "A grocer stacks {a} crates holding {b} mangoes each and {c} crates holding {d} peaches "
        "each. How many pieces of fruit has the grocer stacked?",
    ),
    (
        "sum_give_groups",
        "seed_packets",
        "{name} saves {a} seeds from the first harvest and {b} seeds from the second harvest. "
        "{pronoun} then mails {c} seeds to each of {d} neighbours. How many seeds does {name} keep?",
    ),
    (
        "rows_add_take",
        "parking_garage",
        "A parking garage has {a} levels with {b} cars parked on each level. In the morning {c} "
        "more cars drive in, and at noon {d} cars drive out. How many cars are in the garage then?",
    ),
    (
        "sum_price_extra",
        "museum_trip",
        "A school sends {a} pupils from one class and {b} pupils from another class to a museum. "
        "Entry is {c} dollars per pupil, and the coach hire is {d} dollars. What does the trip "
        "cost in dollars?",
    ),
    (
        "left_boxes_loose",
        "crayon_packs",
        "{name} owns {a} packs of crayons and hands out {b} of the packs. Every pack that is kept "
        "holds {c} crayons, and a cup on the desk holds {d} single crayons. How many crayons does "
        "{name} have?",
    ),
)

# The wording of each template, on the operand draws, answer and worked steps of the shape it retells.
UNSEEN_TEMPLATES: dict[str, Template] = {
    name: replace(TEMPLATES[shape], name=name, text=text) for shape, name, text in _RETOLD
}
RETELLS: dict[str, str] = {name: shape for shape, name, _ in _RETOLD}
"""Each unseen template's name -> the name of the trained template (shape) it retells."""


def require_unseen(variant: str) -> None:
    """Raise the one-line ValueError for a variant that has no unseen part."""
    if variant not in UNSEEN_VARIANTS:
        raise ValueError(
            f"val_part 'unseen' exists for the task variants {', '.join(UNSEEN_VARIANTS)} only, not "
            f"{variant!r}: pick one of them, or val_part 'heldout' or 'dev'"
        )


def generate_unseen(
    seed: int = 0,
    variant: str = "multistep",
    parts: Parts | None = None,
) -> list[Problem]:
    """The :data:`UNSEEN_SIZE` problems of the unseen part, its templates taking turns (round robin).

    Args:
        seed: the task seed (the other parts' seed); the stream is seeded by it and ``"unseen"``.
        variant: one of :data:`UNSEEN_VARIANTS`; its scale gives the operands.
        parts: the variant's other parts, whose ``(shape, operands)`` are not drawn again; None
            draws them at the variant's default sizes (what the datamodule serves).
    """
    require_unseen(variant)
    parts = generate(seed=seed, variant=variant) if parts is None else parts
    taken = {p.key for problems in parts.values() for p in problems}
    rng = random.Random(f"{seed}:unseen")  # a str seed hashes the same in every process
    order = list(UNSEEN_TEMPLATES)
    rng.shuffle(order)
    problems: list[Problem] = []
    turn = misses = 0
    while len(problems) < UNSEEN_SIZE:
        template = UNSEEN_TEMPLATES[order[turn % len(order)]]
        turn += 1
        operands = template.draw(rng, VARIANTS[variant].scale)
        if (RETELLS[template.name], operands) in taken or (template.name, operands) in taken:
            misses += 1  # the operand space is far larger: this guards a scale made too small
            if misses > 100 * UNSEEN_SIZE:
                raise ValueError(f"the operand space of {variant!r} is too small for the unseen part")
            continue
        taken.add((template.name, operands))
        problems.append(template.problem(operands, *NAMES[rng.randrange(len(NAMES))]))
    return problems


def write_unseen(
    out: str | Path, seed: int = 0, variant: str = "multistep", parts: Parts | None = None
) -> Path:
    """Write ``<out>/unseen.jsonl`` (GSM8K rows) for ``variant``'s task seeded ``seed`` (``parts``:
    its other parts, None: at their default sizes), and its entry into ``<out>/manifest.json`` where
    write_task left one; the file's path."""
    require_unseen(variant)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(p.gsm8k_row()) + "\n" for p in generate_unseen(seed, variant, parts))
    write_atomically(out / UNSEEN_FILE, lambda staging: staging.write_text(text, encoding="utf-8"))
    manifest = out / "manifest.json"
    if manifest.is_file():
        templates = {name: {"retells": RETELLS[name], "text": t.text} for name, t in UNSEEN_TEMPLATES.items()}
        entry = {
            "file": UNSEEN_FILE,
            "size": UNSEEN_SIZE,
            "seed": seed,
            "variant": variant,
            "templates": templates,
        }
        updated = json.dumps({**json.loads(manifest.read_text()), "unseen": entry}, indent=2) + "\n"
        write_atomically(manifest, lambda staging: staging.write_text(updated, encoding="utf-8"))
    return out / UNSEEN_FILE


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m forge_lightning.data.arithmetic_unseen",
        description="Write the multistep variants' phrasing-held-out part as <out>/unseen.jsonl.",
    )
    parser.add_argument(
        "--out", required=True, help="the task's folder (python -m forge_lightning.data.arithmetic's --out)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the task seed (default 0)")
    parser.add_argument("--variant", default="multistep", choices=UNSEEN_VARIANTS)
    args = parser.parse_args(argv)
    path = write_unseen(args.out, args.seed, args.variant)
    print(f"unseen   {UNSEEN_SIZE:6d} problems -> {path}")


if __name__ == "__main__":
    main()
