"""The multistep variants' ``unseen`` part: trained shapes in wordings no train part uses, drawn
apart so that the other parts stay byte for byte what they were."""

from __future__ import annotations

import hashlib
import json
import operator
import re
from pathlib import Path

import pytest

from forge_lightning.data import PromptDataModule
from forge_lightning.data.arithmetic import VARIANTS, generate, write_task
from forge_lightning.data.arithmetic_templates import TEMPLATES
from forge_lightning.data.arithmetic_unseen import (
    RETELLS,
    UNSEEN_SIZE,
    UNSEEN_TEMPLATES,
    UNSEEN_VARIANTS,
    generate_unseen,
    main,
    write_unseen,
)

# sha256 of each part's file as write_task wrote it (default seed) before the unseen part existed:
# the runs of notebooks/chains.ipynb were trained and measured on these bytes.
BEFORE = {
    "multistep": {
        "train.jsonl": "b0db0160cd1ed8d1047875512961470ab524c26b6f997937215b89833cd77142",
        "dev.jsonl": "6a7fdb80b661cb45304a1f38e33a018c09d12d9665a2729aae942672e22b216f",
        "test.jsonl": "494796e9bfff97b8f2ca3c44647d9e005b62ba0ba6093492372d4f4bafb6fa7c",
        "dev/train.jsonl": "b0db0160cd1ed8d1047875512961470ab524c26b6f997937215b89833cd77142",
        "dev/test.jsonl": "6a7fdb80b661cb45304a1f38e33a018c09d12d9665a2729aae942672e22b216f",
    },
    "multistep_mixed": {
        "train.jsonl": "f6ac5866d1514d5794fde8fce75f5bb3e05d0db5adf7e5d80e75d96ccb991317",
        "dev.jsonl": "6a7fdb80b661cb45304a1f38e33a018c09d12d9665a2729aae942672e22b216f",
        "test.jsonl": "494796e9bfff97b8f2ca3c44647d9e005b62ba0ba6093492372d4f4bafb6fa7c",
        "dev/train.jsonl": "f6ac5866d1514d5794fde8fce75f5bb3e05d0db5adf7e5d80e75d96ccb991317",
        "dev/test.jsonl": "6a7fdb80b661cb45304a1f38e33a018c09d12d9665a2729aae942672e22b216f",
    },
}
_STEP = re.compile(r"^(\d+) ([-+*]) (\d+) = (\d+)$")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def sentences(text: str) -> set[str]:
    """A template's sentences with its fields as written (``{name} has {a} apples.``)."""
    return {s.strip() for s in re.split(r"(?<=[.?])\s+", text) if s.strip()}


@pytest.mark.parametrize("variant", UNSEEN_VARIANTS)
def test_the_other_parts_are_the_bytes_they_were_and_the_unseen_part_is_written_beside_them(
    variant: str, tmp_path: Path
) -> None:
    write_task(tmp_path, variant=variant)
    digests = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in BEFORE[variant]}
    assert digests == BEFORE[variant]
    main(["--out", str(tmp_path), "--variant", variant])
    rows = [json.loads(line) for line in (tmp_path / "unseen.jsonl").read_text().splitlines()]
    assert [r["question"] for r in rows] == [p.question for p in generate_unseen(0, variant)]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["unseen"]["size"] == UNSEEN_SIZE and manifest["variant"] == variant


def test_other_variants_have_no_unseen_part(tmp_path: Path) -> None:
    write_task(tmp_path, {"train": 20, "dev": 5, "heldout": 5}, variant="two_step")
    assert "unseen" not in json.loads((tmp_path / "manifest.json").read_text())
    with pytest.raises(ValueError, match="exists for the task variants multistep, multistep_mixed only"):
        write_unseen(tmp_path, variant="two_step")
    assert not (tmp_path / "unseen.jsonl").exists()


def test_no_unseen_name_or_wording_is_trained_on_by_any_variant() -> None:
    assert len(UNSEEN_TEMPLATES) >= 8
    assert not set(UNSEEN_TEMPLATES) & set(TEMPLATES)
    trained_sentences = set().union(*(sentences(t.text) for t in TEMPLATES.values()))
    for name, template in UNSEEN_TEMPLATES.items():
        assert not sentences(template.text) & trained_sentences, name
    unseen = {p.question for p in generate_unseen(0, "multistep")}
    for variant in VARIANTS:
        train = generate(seed=0, variant=variant)["train"]
        assert not {p.template for p in train} & set(UNSEEN_TEMPLATES), variant
        assert not {p.question for p in train} & unseen, variant


def test_the_templates_retell_every_trained_multistep_shape() -> None:
    multistep = VARIANTS["multistep"].templates
    assert sorted(RETELLS.values()) == sorted(multistep)  # each two- and three-step shape, once
    assert {UNSEEN_TEMPLATES[name].ops for name in RETELLS} == {2, 3}
    for name, shape in RETELLS.items():  # the same draws (on the variant's scale), answer and steps
        retold, trained = UNSEEN_TEMPLATES[name], TEMPLATES[shape]
        assert (retold.draw, retold.solve, retold.working) == (trained.draw, trained.solve, trained.working)


def test_the_unseen_part_is_fixed_the_same_for_both_variants_and_apart_from_the_others() -> None:
    part = generate_unseen(0, "multistep")
    assert len(part) == UNSEEN_SIZE
    assert part == generate_unseen(0, "multistep") == generate_unseen(0, "multistep_mixed")
    assert [p.key for p in part] != [p.key for p in generate_unseen(1, "multistep")]
    assert {p.template for p in part} == set(UNSEEN_TEMPLATES)  # each wording takes its turns
    assert len({p.key for p in part}) == UNSEEN_SIZE
    parts = generate(seed=0, variant="multistep")
    taken = {p.key for problems in parts.values() for p in problems}
    assert not {(RETELLS[p.template], p.operands) for p in part} & taken  # no trained numbers again


def test_answers_are_the_worked_answers_last_value_on_the_multistep_scale() -> None:
    for p in generate_unseen(0, "multistep"):
        numbers = tuple(int(n) for n in re.findall(r"\d+", p.question))
        assert numbers == p.operands, p.question  # the operands appear in the shape's order
        steps = [_STEP.match(line) for line in p.working.splitlines()]
        assert all(steps) and len(steps) == UNSEEN_TEMPLATES[p.template].ops, p.working
        for step in steps:
            left, op, right, result = step.groups()
            assert _OPS[op](int(left), int(right)) == int(result)
        assert p.answer == int(steps[-1].group(4)) > 0
        assert p.gsm8k_row()["answer"].endswith(f"#### {p.answer}")
        assert min(p.operands) >= 2, p  # no 0 or 1 to make a step trivial


def test_the_datamodule_serves_the_unseen_part_and_refuses_it_for_other_variants() -> None:
    data = PromptDataModule(
        source="arithmetic", task_variant="multistep_mixed", val_part="unseen", val_max_samples=None
    )
    data.setup()
    assert [r["reference"] for r in data._val] == [str(p.answer) for p in generate_unseen(0, "multistep")]
    train_prompts = {r["prompt"] for r in data._train}
    assert len(data._val) == UNSEEN_SIZE and not train_prompts & {r["prompt"] for r in data._val}
    with pytest.raises(ValueError) as refused:
        PromptDataModule(source="arithmetic", task_variant="add_sub", val_part="unseen")
    message = str(refused.value)
    assert "\n" not in message and "multistep, multistep_mixed" in message and "'add_sub'" in message
