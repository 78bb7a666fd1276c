"""GSM8K: prompt formatting, number extraction and the loaders (hub, local files, built-in mock set).

The files are read by :mod:`forge_lightning.data.readers`; this module parses GSM8K's rows. Every
loader returns ``list[{"prompt": str, "reference": str}]`` where ``prompt`` is already
formatted by :func:`format_prompt` and ``reference`` is a value-normalised number string.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path
from typing import Any

# The generic readers were first defined here: load_prompts, require_in_memory and in_memory_rows
# stay importable from this module.
from forge_lightning.data.readers import (
    collect_samples,
    file_rows,
    hub_rows,
    in_memory_rows,
    load_prompts,
    require_in_memory,
    resolve_local_file,
)

__all__ = [
    "HUB_CONFIG",
    "HUB_DATASET",
    "NUMBER",
    "extract_answer",
    "format_prompt",
    "in_memory_rows",
    "load_gsm8k",
    "load_gsm8k_mock",
    "load_prompts",
    "normalize_number",
    "parse_reference",
    "require_in_memory",
]

HUB_DATASET = "openai/gsm8k"
HUB_CONFIG = "main"

# One number as it is written in text: optional sign and dollar sign, digits with proper thousands
# groups (so "1,2,3" reads as three numbers, not 123), optional decimals. The look-behind keeps
# the minus of "10-3" from being read as a negative three.
# A number in prose: "1,800", "18.5", "-3", "$4", and ".5" (a leading point, not after a word or digit).
NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_ANSWER_LINE = re.compile(r"answer\s*:(.*)", re.IGNORECASE)
_BOXED = "\\boxed{"

# Hand-written problems: (question, answer, arithmetic that derives the answer from the question).
# The expression lets a test re-derive each answer independently of the number typed beside it.
_MOCK_PROBLEMS: tuple[tuple[str, str, str], ...] = (
    (
        "A baker makes 24 muffins in the morning and 18 in the afternoon, then sells 30 of them. "
        "How many muffins are left?",
        "12",
        "24 + 18 - 30",
    ),
    ("Tom reads 15 pages every day. How many pages does he read in 2 weeks?", "210", "15 * 7 * 2"),
    ("A carton holds 6 eggs. How many cartons are needed to pack 84 eggs?", "14", "84 / 6"),
    (
        "Maria buys 3 notebooks at $4 each and a pen for $2. She pays with a $20 bill. "
        "How many dollars of change does she get?",
        "6",
        "20 - (3 * 4 + 2)",
    ),
    (
        "A train goes 60 miles per hour for 3 hours, then 45 miles per hour for 2 hours. "
        "How many miles does it travel in total?",
        "270",
        "60 * 3 + 45 * 2",
    ),
    (
        "A class has 28 students. Half of them play soccer, and 5 of the soccer players also play "
        "basketball. How many soccer players do not play basketball?",
        "9",
        "28 / 2 - 5",
    ),
    (
        "An orchard has 7 rows of apple trees with 12 trees in each row. Every tree gives 20 apples. "
        "How many apples are harvested?",
        "1680",
        "7 * 12 * 20",
    ),
    ("Lena saves $15 each week. How many weeks does she need to save $165?", "11", "165 / 15"),
    (
        "A rope is 50 meters long. Jake cuts off 3 pieces of 8 meters each. How many meters of rope "
        "are left?",
        "26",
        "50 - 3 * 8",
    ),
    (
        "Four friends share 3 pizzas cut into 8 slices each. They eat every slice and each friend eats "
        "the same amount. How many slices does each friend eat?",
        "6",
        "3 * 8 / 4",
    ),
    (
        "A jacket costs $40 and is sold at 25% off. What is the sale price in dollars?",
        "30",
        "40 * (1 - 25 / 100)",
    ),
    ("Sam is 3 times as old as his sister, who is 7. How old will Sam be in 5 years?", "26", "3 * 7 + 5"),
    ("A garden is 12 meters long and 9 meters wide. What is its area in square meters?", "108", "12 * 9"),
    (
        "A tank holds 500 liters of water and leaks 12 liters every hour. How many liters are left "
        "after 15 hours?",
        "320",
        "500 - 12 * 15",
    ),
    (
        "Emma has 45 stickers. She gives a third of them to her brother, then buys 10 more. "
        "How many stickers does she have now?",
        "40",
        "45 - 45 / 3 + 10",
    ),
    (
        "A school buys 9 packs of 36 pencils and shares them equally among 27 classrooms. "
        "How many pencils does each classroom get?",
        "12",
        "9 * 36 / 27",
    ),
    (
        "A cyclist rides 18 km on Monday, twice as far on Tuesday, and 7 km less than Tuesday on "
        "Wednesday. How many kilometers does she ride over the three days?",
        "83",
        "18 + 2 * 18 + (2 * 18 - 7)",
    ),
    ("Juice costs $2.25 a bottle. How many dollars do 6 bottles cost?", "13.5", "2.25 * 6"),
    (
        "It was 4 degrees at noon and the temperature fell by 11 degrees by midnight. What was the "
        "temperature at midnight, in degrees?",
        "-7",
        "4 - 11",
    ),
    (
        "A car park has 5 levels with 40 spaces on each. On Saturday 137 spaces are taken. "
        "How many spaces are free?",
        "63",
        "5 * 40 - 137",
    ),
)


def format_prompt(question: str) -> str:
    """Wrap a question in the instruction whose ``Answer: <number>`` contract the rewards rely on."""
    return (
        "Solve the math word problem below. Think it through step by step, then write the final "
        "result alone on the last line in the form: Answer: <number>\n\n"
        f"Problem: {question.strip()}\n\n"
        "Solution:"
    )


def normalize_number(text: str) -> str | None:
    """Value-normalise a number string ("$1,800.50" -> "1800.5", "18.00" -> "18"); None if not a number."""
    cleaned = str(text).strip().replace(",", "").replace("$", "").replace("%", "").rstrip(".")
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    # normalize() drops trailing zeros; format "f" stops it from switching to exponent notation.
    result = format(Decimal(cleaned).normalize(), "f")
    return "0" if result == "-0" else result


def _last_number(text: str) -> str | None:
    matches = NUMBER.findall(text)
    return normalize_number(matches[-1]) if matches else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, matching nested braces (``\\boxed{\\text{18}}``)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def extract_answer(text: str) -> str | None:
    """Final numeric answer of a solution, normalised: last ``\\boxed{}``, else last ``Answer:`` line,
    else the last number anywhere. None when the text holds no number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        number = normalize_number(boxed) or _last_number(boxed)
        if number is not None:
            return number
    answer_lines = _ANSWER_LINE.findall(text)
    if answer_lines:
        first = NUMBER.search(answer_lines[-1])
        if first is not None:
            return normalize_number(first.group())
    return _last_number(text)


def parse_reference(answer_field: str) -> str:
    """Normalised number after GSM8K's ``####`` marker; ValueError when missing or not a number."""
    if "####" not in answer_field:
        raise ValueError("answer has no '####' marker")
    tail = answer_field.rsplit("####", 1)[1].strip()
    number = normalize_number(tail)
    if number is None:
        raise ValueError(f"text after '####' is not a number: {tail!r}")
    return number


def _sample_from_row(row: Any) -> dict[str, str]:
    """Turn one raw ``{"question", "answer"}`` row into a sample; ValueError says what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object with 'question' and 'answer', got {type(row).__name__}")
    for field in ("question", "answer"):
        if field not in row:
            # Most often another dataset read as GSM8K: say which fields it has and how to name them.
            raise ValueError(
                f"no {field!r} field (fields: {sorted(row)}); for a dataset other than GSM8K, set "
                "data.prompt_field (and data.reference_field) to the fields of its prompt (and reference)"
            )
        if not isinstance(row[field], str):
            raise ValueError(f"field {field!r} is not text: {row[field]!r:.100}")
    if not row["question"].strip():
        raise ValueError("empty question")
    return {"prompt": format_prompt(row["question"]), "reference": parse_reference(row["answer"])}


def load_gsm8k(
    split: str = "train",
    max_samples: int | None = 500,
    path: str | Path | None = None,
    skip_malformed: bool = False,
    dataset: Any = None,
) -> list[dict[str, str]]:
    """Load GSM8K as ``[{"prompt", "reference"}]``, the first ``max_samples`` rows in file order.

    Args:
        split: "train" or "test"; picks the hub split or the ``{split}.jsonl``/``{split}.parquet``
            file inside a ``path`` folder (ignored when ``path`` is a single file).
        max_samples: how many samples to keep; None keeps all.
        path: local folder or file with GSM8K's ``question``/``answer`` fields; None loads
            ``openai/gsm8k`` (config ``main``) with ``datasets``.
        skip_malformed: skip bad rows with one warning instead of raising on the first.
        dataset: instead of ``path``, GSM8K's rows already loaded: a ``datasets.Dataset`` or
            ``DatasetDict`` (see :func:`in_memory_rows`).
    """
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    if dataset is not None:
        source, rows = in_memory_rows(dataset, split)
    elif path is None:
        what = f"{HUB_DATASET} ({HUB_CONFIG}, split {split!r})"
        offline = "pass path= pointing at local GSM8K JSON-lines or parquet files."
        source, rows = (
            f"{HUB_DATASET} ({HUB_CONFIG}/{split})",
            hub_rows(HUB_DATASET, HUB_CONFIG, split, what, offline),
        )
    else:
        file = resolve_local_file(path, split)
        source, rows = str(file), file_rows(file)
    return collect_samples(rows, source, max_samples, skip_malformed, _sample_from_row, kind="GSM8K")


def load_gsm8k_mock(n: int = 20) -> list[dict[str, str]]:
    """The first ``n`` of 20 hand-verified grade-school problems; no network or files needed."""
    if not 1 <= n <= len(_MOCK_PROBLEMS):
        raise ValueError(f"n must be between 1 and {len(_MOCK_PROBLEMS)}, got {n}")
    return [{"prompt": format_prompt(q), "reference": answer} for q, answer, _ in _MOCK_PROBLEMS[:n]]
