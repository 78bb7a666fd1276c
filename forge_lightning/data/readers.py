"""Prompt files and datasets read as rows: local JSON-lines, parquet and CSV files (a file, or a
folder holding ``{split}.jsonl``/``.parquet``/``.csv``), a hub dataset by name, or a
``datasets.Dataset``/``DatasetDict`` in memory; and :func:`load_prompts`, which turns any of them
into ``[{"prompt", ...}]``. GSM8K's own parsing is in :mod:`forge_lightning.data.gsm8k`.

A reader yields ``(where, row)`` pairs, ``where`` naming the row in messages ("line 3", "row 7"),
and yields a ValueError as the row where one cannot be read, so that the caller reports or skips it
like any other malformed row.
"""

from __future__ import annotations

import csv
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# A CSV cell that is a number (no thousands separators, no "nan"/"inf": those stay text).
_CSV_INT = re.compile(r"[-+]?[0-9]+")
_CSV_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:  # decoded line by line, so that a bad byte names its line
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield f"line {number}", ValueError(f"not UTF-8 (byte {err.start + 1} of the line)")
                continue
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as err:
                # Yield the error so the caller reports or skips it like any other bad row.
                yield f"line {number}", ValueError(f"invalid JSON ({err.msg})")


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for number, row in enumerate(_typed_columns(rows), start=2):  # line 1 is the header
        yield f"line {number}", row


def _typed_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CSV cells are all text: a column whose every filled cell is a number becomes ints (or floats),
    as JSON-lines and parquet give it (and as pandas reads CSV); its empty cells become None."""
    columns = {key for row in rows for key in row if key is not None}
    converters: dict[str, Callable[[str], Any]] = {}
    for column in columns:
        filled = [row[column] for row in rows if isinstance(row.get(column), str) and row[column] != ""]
        if filled and all(_CSV_INT.fullmatch(cell) for cell in filled):
            converters[column] = int
        elif filled and all(_CSV_FLOAT.fullmatch(cell) for cell in filled):
            converters[column] = float
    if not converters:
        return rows
    return [{key: _convert(converters.get(key), value) for key, value in row.items()} for row in rows]


def _convert(converter: Callable[[str], Any] | None, value: Any) -> Any:
    if converter is None or not isinstance(value, str):
        return value  # text columns, and csv's None/list for a row with too few/many cells
    return converter(value) if value != "" else None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"row {number}", row


def resolve_local_file(path: str | Path, split: str) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in (path / f"{split}.jsonl", path / f"{split}.parquet", path / f"{split}.csv"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"folder {path} has no {split}.jsonl, {split}.parquet or {split}.csv")
    raise FileNotFoundError(f"data path does not exist: {path}")


def file_rows(file: Path) -> Iterator[tuple[str, Any]]:
    readers = {".parquet": _parquet_rows, ".csv": _csv_rows}
    return readers.get(file.suffix, _jsonl_rows)(file)


def local_prompt_field(path: str | Path, split: str) -> str | None:
    """The field that is the prompt of a local file's rows where no ``prompt_field`` is set, read
    from its first row: None (GSM8K's ``question``, with ``answer``) where it has a ``question``,
    ``"prompt"`` where it has a ``prompt`` field instead; with both, None and a warning that says
    so. None too where the first row cannot be read (the GSM8K reader then says why)."""
    file = resolve_local_file(path, split)
    first = next((row for _, row in file_rows(file)), None)
    if not isinstance(first, dict) or "prompt" not in first:
        return None
    if "question" in first:
        warnings.warn(
            f"{file}: its rows have both a 'question' and a 'prompt' field; reading 'question' (GSM8K's, "
            "with 'answer'). To read 'prompt' instead, set data.prompt_field to prompt",
            stacklevel=2,
        )
        return None
    return "prompt"


def hub_rows(name: str, config: str | None, split: str, what: str, offline: str) -> Iterator[tuple[str, Any]]:
    """Rows of a hub dataset; a failure to load says ``what`` could not be, and ``offline`` what to do."""
    try:
        import datasets

        table = datasets.load_dataset(name, config, split=split)
    except Exception as err:
        raise RuntimeError(
            f"could not load {what} from the Hugging Face Hub: {err}. Without network access, {offline}"
        ) from err
    yield from _table_rows(table)


def _table_rows(table: Any) -> Iterator[tuple[str, Any]]:
    for number, row in enumerate(table, start=1):
        yield f"row {number}", row


def require_in_memory(data: Any) -> None:
    """TypeError unless ``data`` is a ``datasets.Dataset`` or ``DatasetDict``."""
    import datasets  # only here: importing it costs a second, and most runs never pass an object

    if not isinstance(data, datasets.Dataset | datasets.DatasetDict):
        raise TypeError(
            f"dataset must be a hub dataset's name, a datasets.Dataset or a datasets.DatasetDict, got "
            f"{type(data).__name__}; other rows go to trainer.fit as a DataLoader(rows, batch_size=N, "
            "collate_fn=forge_lightning.data.collate_records)"
        )


def in_memory_rows(data: Any, split: str) -> tuple[str, Iterator[tuple[str, Any]]]:
    """Where rows come from and the rows, of a ``datasets.Dataset`` (every split reads it, as a
    single file serves both) or of a ``datasets.DatasetDict``'s ``split``."""
    import datasets

    require_in_memory(data)
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(
                f"the DatasetDict has no {split!r} split (splits: {sorted(data)}); see data.val_split"
            )
        return f"the DatasetDict's {split!r} split", _table_rows(data[split])
    return "the datasets.Dataset", _table_rows(data)


def collect_samples(
    rows: Iterator[tuple[str, Any]],
    source: str,
    max_samples: int | None,
    skip_malformed: bool,
    parse: Callable[[Any], dict[str, Any]],
    kind: str,
) -> list[dict[str, Any]]:
    """The samples ``parse`` makes of ``rows`` (the first ``max_samples``); a row it refuses
    (ValueError) stops the load naming the row, or with ``skip_malformed`` is skipped with one warning
    for all. ``kind`` names the rows in messages ("GSM8K", "prompt")."""
    samples: list[dict[str, str]] = []
    skipped: list[str] = []
    for where, row in rows:
        if max_samples is not None and len(samples) >= max_samples:
            break
        try:
            if isinstance(row, Exception):
                raise row
            samples.append(parse(row))
        except ValueError as err:
            if not skip_malformed:
                raise ValueError(f"malformed {kind} row in {source}, {where}: {err}") from err
            skipped.append(f"{where}: {err}")
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} malformed {kind} row(s) in {source} (first: {skipped[0]})", stacklevel=3
        )
    if not samples:
        raise ValueError(f"no {kind} samples loaded from {source}")
    return samples


def load_prompts(
    split: str,
    max_samples: int | None,
    *,
    prompt_field: str,
    reference_field: str | None = None,
    path: str | Path | None = None,
    dataset: Any = None,
    skip_malformed: bool = False,
) -> list[dict[str, Any]]:
    """Rows of any prompt dataset as ``[{"prompt", ...}]``: a local folder or file (JSON-lines,
    parquet or CSV), a hub dataset by name, or a ``datasets.Dataset``/``DatasetDict`` in memory.

    Each row's ``prompt_field`` is the prompt (text, or a conversation: a list of ``{"role",
    "content"}`` messages); ``reference_field``, when given, becomes ``reference`` (the rewards'
    ``references``); every other field travels with its prompt to the rewards under its own name.
    """
    if path is not None:
        file = resolve_local_file(path, split)
        source, rows = str(file), file_rows(file)
    elif dataset is not None and not isinstance(dataset, str):
        source, rows = in_memory_rows(dataset, split)
    elif dataset is not None:
        what = f"the dataset {dataset!r} (split {split!r})"
        offline = "pass data.path pointing at local JSON-lines, parquet or CSV files."
        source, rows = f"{dataset} (split {split})", hub_rows(dataset, None, split, what, offline)
    else:
        raise ValueError("load_prompts needs a path or a hub dataset name")

    def parse(row: Any) -> dict[str, Any]:
        if not isinstance(row, dict):
            raise ValueError(f"expected an object, got {type(row).__name__}")
        for field in (prompt_field, reference_field):
            if field is not None and field not in row:
                raise ValueError(f"no {field!r} field (fields: {sorted(row)})")
        prompt = row[prompt_field]
        if not (isinstance(prompt, str) and prompt.strip()) and not (isinstance(prompt, list) and prompt):
            raise ValueError(
                f"{prompt_field!r} must be non-empty text or a list of messages, got {prompt!r:.100}"
            )
        sample = {"prompt": prompt}
        if reference_field is not None:
            sample["reference"] = row[reference_field]
        sample.update((k, v) for k, v in row.items() if k not in (prompt_field, reference_field))
        return sample

    return collect_samples(rows, source, max_samples, skip_malformed, parse, kind="prompt")
