"""pyproject.toml asks for what the code needs, and CI's floors job installs exactly those floors."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the code uses, and the first release that has it.
NEEDS = {
    "torch": ("2.6", "torch.nn.utils.get_total_norm, torch.distributed.fsdp.fully_shard"),
    "transformers": ("4.56", "from_pretrained(dtype=...)"),
}


def floors() -> dict[str, str]:
    """``name -> floor`` of each ``"name>=floor..."`` requirement in pyproject.toml (tomllib is
    3.11+, and the project runs on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9.]+)', text))


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_floors_admit_nothing_older_than_what_the_code_uses():
    declared = floors()
    for name, (needed, what) in NEEDS.items():
        assert version(declared[name]) >= version(needed), f"{name} {declared[name]} lacks {what}"


def test_the_floors_job_pins_every_floor_it_installs_at_pyprojects_value():
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, pin = line.split("==")
            pins[name.strip()] = pin.strip()
    declared = floors()
    assert pins, "no pins in .ci/floors.txt"
    for name, pin in pins.items():
        assert version(pin)[: len(version(declared[name]))] == version(declared[name]), name
