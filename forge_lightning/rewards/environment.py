"""The score an environment gives its finished episode, as a reward (tools/environments.py in
the rollout layer: what an environment is)."""

from __future__ import annotations

from typing import Any

from forge_lightning.rewards.calls import BaseReward, RewardOutput
from forge_lightning.rollout.tools.environments import environment_type, score_name
from forge_lightning.run.user_code import close_unawaited


class EnvironmentReward(BaseReward):
    """Each completion's environment's ``get_reward()`` (or ``reward()``): the score of its
    finished episode. The reward of a run with no reward set whose environment has one. It runs
    in the trainer's process under ``sandbox: process`` too: there each environment lives in a
    sandbox worker, and its score is read there (a worker that died fails that sample's score)."""

    needs = ("environments",)
    in_process = True

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
