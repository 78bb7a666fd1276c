"""The score an environment gives its finished episode, as a reward (tools/environments.py in
the rollout layer: what an environment is), and how it joins the run's reward (TRL's rule: an
environment's ``get_reward`` is one more reward beside those set)."""

from __future__ import annotations

from typing import Any

from forge_lightning.rewards.calls import BaseReward, RewardFn, RewardOutput
from forge_lightning.rewards.library import CompositeReward
from forge_lightning.rollout.tools.environments import environment_type, score_name
from forge_lightning.run.user_code import close_unawaited


class EnvironmentReward(BaseReward):
    """Each completion's environment's ``get_reward()`` (or ``reward()``): the score of its
    finished episode. The reward of a run with no reward set whose environment has one, and one
    more component beside a reward that is set (:func:`with_environment_score`); an agent's
    return value the same way (its episodes' ``AgentOutcome``). It runs in the trainer's process
    under ``sandbox: process`` too: there each environment lives in a sandbox worker, and its
    score is read there (a worker that died fails that sample's score).

    Args:
        name: its name as a component, in the metrics (``train/rewards/<name>``).
    """

    needs = ("environments",)
    in_process = True

    def __init__(self, name: str = "EnvironmentReward") -> None:
        self.name = name
        self.__name__ = name  # what reward_name reads: the component's and its metric's name

    def __call__(
        self, prompts: list[str], responses: list[str], environments: list[Any] | None = None, **kwargs: Any
    ) -> RewardOutput:
        names = [score_name(environment_type(env)) for env in environments or []]
        if environments is None or None in names:
            raise ValueError(
                "EnvironmentReward scores each completion's environment with its get_reward() (or "
                "reward()) method: set environment_factory to a class that has one"
            )
        scores = []
        for env, name in zip(environments, names):
            value = getattr(env, name)()
            if close_unawaited(value):
                raise ValueError(
                    f"{type(env).__name__}.{name}() returned a coroutine: write it as a plain def"
                )
            scores.append(float(value))
        return RewardOutput(scores=scores)


def with_environment_score(reward: RewardFn) -> RewardFn:
    """``reward`` (the one a run sets) with its environments' score joined, TRL's rule: the
    :class:`EnvironmentReward` one more component of their :class:`CompositeReward`, weighted as
    the mean of the others' weights (all equal where none is given: a list of rewards). A reward
    that holds an EnvironmentReward already, alone or as a component, is kept as it is: listing
    ``(EnvironmentReward(), w)`` among the rewards gives it weight ``w`` (0 leaves it out)."""
    entries = reward.rewards_and_weights if isinstance(reward, CompositeReward) else [(reward, 1.0)]
    if any(isinstance(entry[0], EnvironmentReward) for entry in entries):
        return reward
    weight = sum(float(entry[1]) for entry in entries) / len(entries)
    return CompositeReward([*entries, (EnvironmentReward(), weight)])
