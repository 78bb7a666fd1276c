"""``forge-lightning plot``: a training log in, a PNG out; a log it cannot read is a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forge_lightning.cli.forge_cli import main
from forge_lightning.reporting.plot import curves_figure, load_log, plot_log

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_log(path, steps=5, components=("correct", "format")):
    with open(path, "w", encoding="utf-8") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "epoch": 0, "loss": 0.1, "reward": step / steps, "reward_std": 0.1}
            record.update({f"rewards/{name}": step / (2 * steps) for name in components})
            record.update({"kl": 0.001 * step, "clip_fraction": 0.0, "completion_length": 40.0 - step})
            f.write(json.dumps(record) + "\n")
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # several drawn panels, not an empty canvas


def test_plot_command_writes_a_png(tmp_path, capsys):
    log = write_log(tmp_path / "training_log.jsonl")
    out = tmp_path / "figs" / "curves.png"
    main(["plot", str(log), "-o", str(out)])
    assert_png(out)
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_defaults_to_a_png_beside_the_log(tmp_path):
    log = write_log(tmp_path / "training_log.jsonl")
    assert plot_log(log) == tmp_path / "training_log.png"
    assert_png(tmp_path / "training_log.png")


def test_one_panel_per_quantity_with_components_overlaid():
    records = load_log_records(components=("correct", "format"))
    titles = [ax.get_title() for ax in curves_figure(records).axes if ax.get_visible()]
    assert titles == [
        "reward (mean, ±1 std)",
        "reward components",
        "KL to reference",
        "clip fraction",
        "completion length (tokens)",
    ]
    component_axis = curves_figure(records).axes[1]
    assert [line.get_label() for line in component_axis.get_lines()] == ["correct", "format"]


def test_entropy_and_truncated_fraction_get_panels_and_component_stds_none():
    records = load_log_records(components=("correct", "format"))
    for record in records:
        record.update({"entropy": 2.0, "truncated_fraction": 0.25, "rewards/correct_std": 0.1})
    figure = curves_figure(records)
    titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert titles[-2:] == ["entropy (nats per token)", "truncated fraction"]
    assert [line.get_label() for line in figure.axes[1].get_lines()] == ["correct", "format"]


def test_a_single_component_gets_no_panel_of_its_own():
    titles = [ax.get_title() for ax in curves_figure(load_log_records(components=("digits",))).axes]
    assert "reward components" not in titles


def load_log_records(components):
    return [
        {
            "step": s,
            "reward": 0.5,
            "kl": 0.0,
            "clip_fraction": 0.0,
            "completion_length": 3.0,
            **{f"rewards/{c}": 0.5 for c in components},
        }
        for s in (1, 2)
    ]


@pytest.mark.integration
def test_python_dash_m_runs_the_plot_command(tmp_path):
    log = write_log(tmp_path / "training_log.jsonl", steps=3)
    result = subprocess.run(
        [sys.executable, "-m", "forge_lightning.reporting.plot", str(log), "-o", str(tmp_path / "m.png")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no records"),
        ("\n\n", "holds no records"),
        ("not json\n" + json.dumps({"step": 1, "reward": 0.5}) + "\n", "is not JSON"),
        (json.dumps({"reward": 0.5}) + "\n", "has no 'step' field"),
        (json.dumps({"step": 1, "loss": 0.5}) + "\n", "none of reward"),
    ],
    ids=["empty", "blank-lines", "garbage", "no-step", "nothing-to-plot"],
)
def test_unreadable_log_is_a_clear_error(tmp_path, capsys, content, message):
    log = tmp_path / "training_log.jsonl"
    log.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(log), "-o", str(tmp_path / "out.png")])
    assert exit_info.value.code == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()


def test_missing_log_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path / "nowhere.jsonl")])
    assert exit_info.value.code == 1
    assert "no training log at" in capsys.readouterr().err


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    log = write_log(tmp_path / "training_log.jsonl", steps=2)
    with open(log, "a", encoding="utf-8") as f:
        f.write('{"step": 3, "rew')
    with pytest.warns(UserWarning, match="truncated last line"):
        records = load_log(log)
    assert [r["step"] for r in records] == [1, 2]
