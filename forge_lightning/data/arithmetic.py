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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_lightning.data.arithmetic_templates import (
    ADD_SUB,
    NAMES,
    ONE_STEP,
    TEMPLATES,
    THREE_STEP,
    TWO_STEP,
    Operands,
    Problem,
    Scale,
)
from forge_lightning.run.fileio import write_atomically

DEFAULT_OUT = "runs/data/arith"
PARTS = ("train", "dev", "heldout")
# File stem each part is written under; "test" is the split PromptDataModule validates on.
_FILE_STEM = {"train": "train", "dev": "dev", "heldout": "test"}

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
            problems.append(template.problem(operands, *NAMES[rng.randrange(len(NAMES))]))
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
