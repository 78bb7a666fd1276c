"""GSM8K number handling, the loaders (local files, hub failure, mock set) and their error messages."""

from __future__ import annotations

import ast
import json
import operator
from fractions import Fraction
from pathlib import Path

import pytest

from forge_lightning.data import gsm8k
from forge_lightning.data.gsm8k import (
    extract_answer,
    format_prompt,
    load_gsm8k,
    load_gsm8k_mock,
    normalize_number,
    parse_reference,
)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def good_row(n: int) -> dict[str, str]:
    return {"question": f"What is {n} + 1?", "answer": f"{n} + 1 = {n + 1}\n#### {n + 1}"}


# Numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", "18"),
        ("18.0", "18"),
        ("18.00", "18"),
        ("$18", "18"),
        (" 18. ", "18"),
        ("1,800", "1800"),
        ("-3.50", "-3.5"),
        ("0.25", "0.25"),
        ("50%", "50"),
        ("100", "100"),
        ("-0", "0"),
        ("abc", None),
        ("", None),
        ("1.2.3", None),
        ("12 apples", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 5\nso \\boxed{7} and 9", "7"),  # boxed beats Answer: and the last number
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last boxed
        ("Answer: 5\nthen 9", "5"),  # Answer: beats the last number
        ("answer: 3\nANSWER: $1,250.00\n7 more", "1250"),  # the last Answer: line, any case
        ("Answer: -4 degrees", "-4"),
        ("10 - 3 = 7 so 7", "7"),
        ("first 3, then 4.50.", "4.5"),  # last number anywhere, sentence period dropped
        ("Answer: unknown\nbut 12", "12"),  # an Answer: line without a number falls through
        ("no numbers at all", None),
    ],
)
def test_extract_answer_order_boxed_then_answer_line_then_last_number(
    text: str, expected: str | None
) -> None:
    assert extract_answer(text) == expected


def test_parse_reference_takes_number_after_marker_without_commas() -> None:
    assert parse_reference("5 * 200 = 1,000 \n#### 1,000") == "1000"
    assert parse_reference("#### -12") == "-12"


@pytest.mark.parametrize("answer", ["the answer is 4", "#### four", "####"])
def test_parse_reference_rejects_missing_marker_or_number(answer: str) -> None:
    with pytest.raises(ValueError):
        parse_reference(answer)


def test_format_prompt_states_the_answer_contract() -> None:
    prompt = format_prompt("  How many legs do 2 cats have?  ")
    assert "Answer: <number>" in prompt
    assert "How many legs do 2 cats have?\n" in prompt


# Real GSM8K files


def test_every_real_train_row_parses_and_comma_references_are_79(gsm8k_dir: Path) -> None:
    samples = load_gsm8k("train", max_samples=None, path=gsm8k_dir)
    raw = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()]
    assert len(samples) == len(raw) == 7473
    with_comma = [row for row in raw if "," in row["answer"].rsplit("####", 1)[1]]
    assert len(with_comma) == 79
    for row, sample in zip(raw, samples):
        assert sample["reference"] == normalize_number(row["answer"].rsplit("####", 1)[1])
        assert "," not in sample["reference"]


def test_load_gsm8k_keeps_first_rows_in_file_order(gsm8k_dir: Path) -> None:
    samples = load_gsm8k("test", max_samples=3, path=gsm8k_dir)
    first = json.loads((gsm8k_dir / "test.jsonl").read_text().splitlines()[0])
    assert len(samples) == 3
    assert samples[0] == {
        "prompt": format_prompt(first["question"]),
        "reference": parse_reference(first["answer"]),
    }


# Local files and errors


def test_load_gsm8k_reads_a_single_jsonl_file(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "mine.jsonl", [good_row(1), good_row(2)])
    assert [s["reference"] for s in load_gsm8k(path=file)] == ["2", "3"]


def test_load_gsm8k_reads_parquet_in_a_folder(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([good_row(4), good_row(5)]), tmp_path / "test.parquet")
    assert [s["reference"] for s in load_gsm8k("test", path=tmp_path)] == ["5", "6"]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"question": "Q?"}', "'answer'"),
        ('{"question": "  ", "answer": "#### 1"}', "empty question"),
        ('{"question": "Q?", "answer": "no marker"}', "####"),
        ('{"question": "Q?", "answer": "#### lots"}', "not a number"),
        ('{"question": "Q?", "answer": ', "invalid JSON"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_malformed_row_error_names_file_line_and_problem(tmp_path: Path, bad_line: str, problem: str) -> None:
    file = write_jsonl(tmp_path / "train.jsonl", [good_row(1), bad_line, good_row(2)])
    with pytest.raises(ValueError, match=problem) as info:
        load_gsm8k(path=tmp_path)
    assert str(file) in str(info.value) and "line 2" in str(info.value)


def test_another_datasets_rows_read_as_gsm8k_name_their_fields_and_prompt_field(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [{"text": "Say cat", "label": "cat"}])
    with pytest.raises(
        ValueError,
        match=r"line 1: no 'question' field \(fields: \['label', 'text'\]\).*"
        r"data\.prompt_field \(and data\.reference_field\)",
    ):
        load_gsm8k(path=tmp_path)


def test_skip_malformed_skips_and_warns_with_count(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [good_row(1), "{oops", {"question": "Q"}, good_row(2)])
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        samples = load_gsm8k(path=tmp_path, skip_malformed=True)
    assert [s["reference"] for s in samples] == ["2", "3"]


def test_max_samples_stops_before_later_malformed_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [good_row(1), good_row(2), "{oops"])
    assert len(load_gsm8k(path=tmp_path, max_samples=2)) == 2


def test_csv_columns_of_numbers_arrive_as_numbers_like_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from forge_lightning.data.gsm8k import load_prompts

    rows = [
        {"prompt": "Say 7", "level": 1, "score": 0.5, "code": "7", "rank": 3},
        {"prompt": "Say x", "level": -2, "score": 2.0, "code": "x", "rank": None},
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    # "code" mixes a number with text, so it stays text; an empty cell of a number column is None.
    (tmp_path / "rows.csv").write_text("prompt,level,score,code,rank\nSay 7,1,0.5,7,3\nSay x,-2,2.0,x,\n")
    read = {
        suffix: load_prompts("train", None, prompt_field="prompt", path=tmp_path / f"rows.{suffix}")
        for suffix in ("jsonl", "parquet", "csv")
    }
    assert read["csv"] == read["jsonl"] == read["parquet"]
    assert read["csv"][0]["level"] == 1 and read["csv"][1]["code"] == "x"


def test_missing_path_or_split_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gsm8k(path=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        load_gsm8k(path=tmp_path)


def test_empty_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no GSM8K samples"):
        load_gsm8k(path=tmp_path)


def test_hub_failure_says_to_pass_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="Hugging Face Hub.*path="):
        load_gsm8k("train", max_samples=2)


# Mock set

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def exact_arithmetic(expression: str) -> Fraction:
    """Evaluate + - * / and parentheses exactly, so 2.25 * 6 is 27/2 and not a rounded float."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant):
            return Fraction(str(node.value))
        raise ValueError(f"unsupported expression: {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize(("question", "answer", "expression"), gsm8k._MOCK_PROBLEMS)
def test_mock_answer_matches_its_independent_arithmetic(question: str, answer: str, expression: str) -> None:
    assert Fraction(answer) == exact_arithmetic(expression)
    assert normalize_number(answer) == answer


def test_mock_set_has_20_formatted_samples() -> None:
    samples = load_gsm8k_mock()
    assert len(samples) == 20 == len({s["prompt"] for s in samples})
    assert all(s["prompt"] == format_prompt(q) for s, (q, _, _) in zip(samples, gsm8k._MOCK_PROBLEMS))
    assert [s["reference"] for s in load_gsm8k_mock(3)] == [a for _, a, _ in gsm8k._MOCK_PROBLEMS[:3]]


@pytest.mark.parametrize("n", [0, 21])
def test_mock_rejects_n_out_of_range(n: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 20"):
        load_gsm8k_mock(n)


def test_a_byte_that_is_not_utf8_names_the_file_and_line_and_can_be_skipped(tmp_path):
    import warnings

    from forge_lightning.data import load_gsm8k

    good = json.dumps({"question": "1+1?", "answer": "#### 2"}).encode()
    (tmp_path / "train.jsonl").write_bytes(
        good + b"\n" + b'{"question": "caf\xe9", "answer": "#### 1"}\n' + good + b"\n"
    )
    with pytest.raises(ValueError, match=r"train\.jsonl, line 2: not UTF-8"):
        load_gsm8k(path=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = load_gsm8k(path=tmp_path, skip_malformed=True)
    assert len(rows) == 2 and any("line 2" in str(w.message) for w in caught)
