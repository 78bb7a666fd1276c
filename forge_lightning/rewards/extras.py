"""What a reward may be given by name besides the batch's columns: the rollout's facts
(:meth:`~forge_lightning.rollout.types.Rollout.facts`; the tool-using rollout's only where the run has
tools) and TRL's ``trainer_state`` and ``log_metric`` (:class:`RewardExtras`).

TRL's ``log_extra`` (extra columns of its completions table) is not given: a reward that needs it
is refused before the first generation, one that may take it is warned about (it gets None).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from forge_lightning.rollout.types import FACTS

# The facts only a rollout with tools has (Rollout.facts), and the settings that give one.
TOOL_FACTS = ("tool_calls", "completions", "environments")
TOOL_SETTINGS = "model.tools, model.environment_factory or model.calculator"
# TRL's reward arguments the module gives (RewardExtras.arguments).
EXTRAS = ("trainer_state", "log_metric")
# TRL's reward arguments it does not give, and what to do instead.
NOT_GIVEN = {
    "log_extra": (
        "log_extra (TRL's extra columns of the completions table) is not supported yet: log one "
        "number per batch with log_metric(name, value), or keep the values in RewardOutput.metadata"
    ),
}


def reward_arguments(batch_keys: Any, tools: bool, extras: bool = True) -> set[str]:
    """The keyword arguments a reward can be given: the batch's columns (``batch_keys``), the
    rollout's facts (those of a tool-using rollout only with ``tools``) and, with ``extras``,
    TRL's trainer_state and log_metric."""
    facts = [fact for fact in FACTS if tools or fact not in TOOL_FACTS]
    return {*batch_keys, *facts, *(EXTRAS if extras else ())}


def argument_advice(absent: set[str]) -> str:
    """How to give the reward arguments ``absent``: the settings that give the tool facts, why
    log_extra is not given, or how a batch column comes."""
    advice = []
    tools = [key for key in TOOL_FACTS if key in absent]
    if tools:
        advice.append(
            f"{', '.join(tools)} come from a rollout with tools, which only a run with tools has: "
            f"set {TOOL_SETTINGS}, or use a reward that does without them"
        )
    advice += [why for key, why in NOT_GIVEN.items() if key in absent]
    if absent - {*TOOL_FACTS, *NOT_GIVEN}:
        advice.append(
            "Add the field to the data (a 'reference' field arrives as references=, and also as "
            "reference= to a TRL-style reward), or use a reward that does without it"
        )
    return ". ".join(advice)


@dataclass(frozen=True)
class RewardState:
    """TRL's ``trainer_state`` as a reward reads it, by transformers' ``TrainerState`` names:
    ``global_step`` (optimizer steps taken), ``epoch`` (epochs done, a fraction within one: 0.5
    halfway through the first) and ``max_steps`` (the fit's; -1 where none is set)."""

    global_step: int
    epoch: float
    max_steps: int


class RewardExtras:
    """TRL's ``trainer_state`` and ``log_metric`` for the rewards of one scoring call.

    ``log_metric(name, value)`` keeps each value; :meth:`logged` gives each name's mean, which the
    module logs as ``train/<name>`` (``val/<name>`` in validation) beside its own metrics. Every
    rank must log the same names, as in TRL.

    Args:
        global_step: the optimizer steps taken so far.
        epoch: the epoch, with the share of it the batches before this one make.
        max_steps: the run's ``max_steps`` (-1 or None: unbounded).
    """

    def __init__(self, global_step: int, epoch: float, max_steps: int | None) -> None:
        self.state = RewardState(global_step, epoch, max_steps)
        self.values: dict[str, list[Any]] = {}

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments a reward gets by these names."""
        return {"trainer_state": self.state, "log_metric": self.log_metric}

    def log_metric(self, name: str, value: float) -> None:
        """Keep ``value`` under ``name`` (checked by :meth:`logged`, after the rewards ran: a bad
        name is the run's error, not a sample's)."""
        self.values.setdefault(name, []).append(value)

    def logged(self) -> dict[str, float]:
        """Each logged name's mean. ValueError naming the call where a name is not a non-empty
        string or a value not one finite number."""
        means = {}
        for name, values in self.values.items():
            numbers_ = [v.item() if hasattr(v, "item") else v for v in values]
            bad = [v for v in numbers_ if not isinstance(v, numbers.Real) or not math.isfinite(v)]
            if not isinstance(name, str) or not name or bad:
                raise ValueError(
                    f"log_metric({name!r}, {(bad or values)[0]!r}) from a reward: log_metric takes a "
                    "metric's name (a non-empty string) and one finite number"
                )
            means[name] = sum(numbers_) / len(numbers_)
        return means
