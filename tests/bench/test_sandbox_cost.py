"""The sandbox's cost benchmark prints one JSON line of positive figures."""

from __future__ import annotations

import json

import pytest
from helpers.sandbox import skip_unless_sandbox_isolates

from forge_lightning.bench import sandbox_cost


@pytest.mark.integration  # starts sandbox workers
def test_sandbox_cost_prints_one_json_line_of_positive_figures(capsys):
    skip_unless_sandbox_isolates()
    result = sandbox_cost.main(["--calls", "3", "--batch", "2", "--workers", "1"])
    assert json.loads(capsys.readouterr().out) == result
    timed = [key for key in result if key.endswith("_us") or key.endswith("_s")]
    assert len(timed) == 16 and all(result[key] > 0 for key in timed)
