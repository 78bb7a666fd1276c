"""notebooks/quickstart.ipynb runs top to bottom on the tiny model, so it cannot rot unnoticed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test here builds a Trainer or starts a process

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_trains_and_plots(tmp_path, monkeypatch):
    out = tmp_path / "quickstart"
    monkeypatch.setenv("FORGE_QUICKSTART_OUT", str(out))
    monkeypatch.delenv("FORGE_QUICKSTART_MODEL", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    records = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    rewards = [r["reward"] for r in records]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1  # what the notebook says it shows
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    plot_outputs = next(c for c in notebook.cells if c.get("id") == "plot").outputs
    assert any("image/png" in output.get("data", {}) for output in plot_outputs)
