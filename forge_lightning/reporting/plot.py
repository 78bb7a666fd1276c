"""``forge-lightning plot LOG.jsonl``: training curves from a run's ``training_log.jsonl``, as a PNG.

One panel per quantity the log holds, against the optimizer step: the reward (with a band of one
``reward_std`` around it), the ``rewards/<component>`` curves of a composite reward together, the
KL to the reference, the clip fraction, the completion length, the policy's entropy and the share of
completions cut off at the cap. Drawn on matplotlib's Agg
canvas: no display needed, and pyplot's global state is left alone.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Panels in the order they are drawn: (title, keys plotted in it). The rewards/* keys are found in
# the log itself, since they are named after whatever reward the run used.
_FIXED_PANELS = (
    ("KL to reference", ("kl",)),
    ("clip fraction", ("clip_fraction",)),
    ("completion length (tokens)", ("completion_length",)),
    ("entropy (nats per token)", ("entropy",)),
    ("truncated fraction", ("truncated_fraction",)),
)


def load_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``training_log.jsonl``, in file order.

    A last line that is not valid JSON (a write cut short by a crash) is skipped with a warning;
    anywhere else it is an error, as is a file with no records or a record without ``step``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is empty, or holds a line that is not a JSON object with a ``step``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    text = path.read_text(encoding="utf-8")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if n == lines[-1][0] and records:
                warnings.warn(f"{path}:{n}: skipping a truncated last line", stacklevel=2)
                continue
            raise ValueError(f"{path}:{n} is not JSON ({err.msg}); is this a training_log.jsonl?") from err
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{n} has no 'step' field; is this a training_log.jsonl?")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records; has the run reached its first logging step?")
    return records


def curves_figure(records: list[dict[str, Any]], title: str | None = None) -> Figure:
    """A figure with one panel per plotted quantity found in ``records`` (see :func:`load_log`)."""
    panels = _panels(records)
    if not panels:
        raise ValueError(
            "the log has none of reward, rewards/*, kl, clip_fraction, completion_length to plot"
        )
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5.5 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            steps, values = _series(records, key)
            label = key.removeprefix("rewards/")
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
            if key == "reward":
                _std_band(ax, records)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig


def plot_log(log: str | Path, output: str | Path | None = None, title: str | None = None) -> Path:
    """Write the curves of ``log`` to ``output`` (``<log without suffix>.png`` when None); its path."""
    log = Path(log)
    output = Path(output) if output is not None else log.with_suffix(".png")
    fig = curves_figure(load_log(log), title=title)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return output


def main(argv: list[str] | None = None) -> None:
    """``forge-lightning plot`` / ``python -m forge_lightning.reporting.plot``."""
    parser = argparse.ArgumentParser(
        prog="forge-lightning plot",
        description="Plot reward, KL, clip-fraction and completion-length curves of a run.",
    )
    parser.add_argument("log", help="the run's training_log.jsonl")
    parser.add_argument("-o", "--output", help="PNG to write (default: the log's path with .png)")
    parser.add_argument("--title", help="figure title (default: the log's folder name)")
    args = parser.parse_args(argv)
    title = args.title if args.title is not None else Path(args.log).resolve().parent.name
    try:
        output = plot_log(args.log, args.output, title=title)
    except (OSError, ValueError) as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    print(output)


def _panels(records: list[dict[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    present = {key for record in records for key, value in record.items() if _is_number(value)}
    panels: list[tuple[str, tuple[str, ...]]] = []
    if "reward" in present:
        panels.append(("reward (mean, ±1 std)", ("reward",)))
    components = tuple(sorted(k for k in present if k.startswith("rewards/") and not k.endswith("_std")))
    if len(components) > 1:  # a single component is the reward itself
        panels.append(("reward components", components))
    panels += [(name, keys) for name, keys in _FIXED_PANELS if keys[0] in present]
    return panels


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if _is_number(r.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _std_band(ax: Any, records: list[dict[str, Any]]) -> None:
    rows = [r for r in records if _is_number(r.get("reward")) and _is_number(r.get("reward_std"))]
    if rows:
        steps = [r["step"] for r in rows]
        low = [r["reward"] - r["reward_std"] for r in rows]
        high = [r["reward"] + r["reward_std"] for r in rows]
        ax.fill_between(steps, low, high, alpha=0.2, linewidth=0)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


if __name__ == "__main__":
    main()
