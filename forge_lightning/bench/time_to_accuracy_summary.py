"""What the time-to-accuracy race (bench/time_to_accuracy.py) reports, from each side's
checkpoints: a pure function of two lists of ``(elapsed_s, accuracy)`` points."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Points = Sequence[tuple[float, float]]

# The goal: TRL's final accuracy reached in at most half TRL's time.
GOAL_RATIO = 0.5


def first_reaching(points: Points, accuracy: float) -> float | None:
    """The first elapsed seconds at which ``points`` reach ``accuracy``; None if they never do."""
    return next((elapsed for elapsed, value in sorted(points) if value >= accuracy), None)


def accuracy_at(points: Points, elapsed_s: float) -> float | None:
    """The accuracy of the last checkpoint saved by ``elapsed_s``; None before the first."""
    reached = [value for elapsed, value in sorted(points) if elapsed <= elapsed_s]
    return reached[-1] if reached else None


def summarize(ours: Points, trl: Points) -> dict[str, Any]:
    """The race's numbers from each side's checkpoints (at least one each, the last the final).

    ``ours_time_to_trl_final_s``: our first checkpoint at TRL's final accuracy or above (None if
    none); ``trl_time_s``: TRL's first at its final accuracy; ``ratio`` the first over the second
    (None where either is None or TRL's is 0: the untrained model already scored it) and
    ``goal_met`` whether it is at most ``GOAL_RATIO``. ``lower_final`` is the lower of the two
    final accuracies and ``time_to_lower_final_s`` each side's first time at it (the comparison
    that holds whichever side ends higher). ``equal_time_s`` is the shorter side's last checkpoint
    time and ``*_at_equal_time`` each side's accuracy then.
    """
    if not ours or not trl:
        raise ValueError("summarize needs at least one (elapsed_s, accuracy) point per side")
    ours, trl = sorted(ours), sorted(trl)
    ours_final, trl_final = ours[-1][1], trl[-1][1]
    ours_time = first_reaching(ours, trl_final)
    trl_time = first_reaching(trl, trl_final)
    ratio = ours_time / trl_time if ours_time is not None and trl_time else None
    lower = min(ours_final, trl_final)
    equal_time = min(ours[-1][0], trl[-1][0])
    return {
        "ours_final": ours_final,
        "trl_final": trl_final,
        "ours_time_to_trl_final_s": ours_time,
        "trl_time_s": trl_time,
        "ratio": ratio,
        "goal_met": ratio is not None and ratio <= GOAL_RATIO,
        "lower_final": lower,
        "time_to_lower_final_s": {"ours": first_reaching(ours, lower), "trl": first_reaching(trl, lower)},
        "equal_time_s": equal_time,
        "ours_at_equal_time": accuracy_at(ours, equal_time),
        "trl_at_equal_time": accuracy_at(trl, equal_time),
    }
