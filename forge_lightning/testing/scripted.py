"""A rollout whose completions the test writes, through the package's own path: the prompts
through the chat template (with the tools' schemas), the tool loop (calls read in their format,
the user's tools or environment run, their answers appended as the template's ``tool`` turn) and
the reward scoring of a training step (the rollout's facts and TRL's arguments given by name,
an environment's ``get_reward`` as the reward where none is given). Only the policy is replaced:
its turns come from the script (engine.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import torch

from forge_lightning.data.datamodule import collate_records, split_batch
from forge_lightning.rewards.batch_scoring import score_groups
from forge_lightning.rewards.environment import EnvironmentReward, with_environment_score
from forge_lightning.rewards.extras import RewardExtras, reward_arguments
from forge_lightning.rewards.library import RewardFn, as_reward, require_arguments
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler, prompt_text
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools.environments import score_name
from forge_lightning.rollout.tools.functions import FunctionTools
from forge_lightning.rollout.types import Prompt, Rollout
from forge_lightning.testing.engine import ScriptedEngine
from forge_lightning.testing.tiny import TinyPolicy, tiny_policy

# One completion: its text, or its turns in order (a turn that calls a tool is followed by the
# turn written after the tool's answer).
Turns: TypeAlias = "str | Sequence[str]"


@dataclass
class ScriptedSample:
    """One completion of a :func:`scripted_rollout`.

    ``completion`` is the text a reward gets as its response; ``transcript`` all the completion's
    tokens as the model read them (special tokens kept), ``sampled`` those the policy wrote (what
    the loss weighs) and ``tool_text`` those the tools wrote (their answers, in the template);
    ``tool_calls`` one ``{name, arguments, result, ok, truncated}`` per call, ``messages`` its
    turns as TRL's messages; ``reward`` its total and ``components`` each component's (None
    without a reward)."""

    prompt: Prompt
    completion: str
    transcript: str
    sampled: str
    tool_text: str
    tool_calls: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    truncated: bool
    environment: Any = None
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class ScriptedRollout:
    """What :func:`scripted_rollout` gives back: ``samples`` in order (G per prompt), their
    ``rewards``, the samples whose reward raised (``reward_errors``, under ``on_reward_error="zero"``),
    the metrics the rewards logged with ``log_metric``, and the :class:`Rollout` itself."""

    samples: list[ScriptedSample]
    rollout: Rollout
    rewards: list[float] | None = None
    reward_errors: int = 0
    logged: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, index: int) -> ScriptedSample:
        return self.samples[index]

    def __len__(self) -> int:
        return len(self.samples)


def scripted_rollout(
    prompts: Sequence[Prompt | dict[str, Any]],
    completions: Sequence[Turns] | Mapping[str, Sequence[Turns]],
    *,
    reward: RewardFn | Sequence[RewardFn] | None = None,
    tools: Sequence[Callable[..., Any]] = (),
    environment_factory: Any = None,
    call_format: str = "hermes",
    system_prompt: str | None = None,
    max_new_tokens: int = 1024,
    max_tool_calls: int = 4,
    tool_timeout: float | None = 10.0,
    on_reward_error: Literal["raise", "zero"] = "raise",
    policy: TinyPolicy | None = None,
) -> ScriptedRollout:
    """Roll out ``completions`` for ``prompts`` as a training step would, and score them.

    Args:
        prompts: each a text, a conversation, or a data row ``{"prompt": ..., **fields}`` whose
            fields reach the reward (``reference`` as ``references=``) and an environment's ``reset``.
        completions: the G completions of every prompt, or a mapping prompt text (a
            conversation's last user message) -> its own; each a text or its turns (:data:`Turns`).
            A turn that calls tools may write several calls: all of them run (up to
            ``max_tool_calls``), and the text the model writes after reading their results is the
            next turn.
        reward: a reward, or a list of them (their CompositeReward), with the environment's
            ``get_reward`` joined as one more where it has one (as in a run); None: that score
            alone, else no scoring.
        tools, environment_factory, call_format, system_prompt, max_new_tokens, max_tool_calls,
        tool_timeout, on_reward_error: as the module's settings of those names.
        policy: the tokenizer (its chat template) and model; None: :func:`tiny_policy`.
    """
    policy = policy or tiny_policy()
    tokenizer = policy.tokenizer
    batch = collate_records([p if isinstance(p, dict) else {"prompt": p} for p in prompts])
    texts, fields = split_batch(batch)
    engine = ScriptedEngine(tokenizer, [_group(completions, p) for p in texts])
    eos = [tokenizer.eos_token_id]
    sampler = RolloutSampler(tokenizer, engine, eos, PromptFormat(True, system_prompt=system_prompt))
    calls = None
    if tools or environment_factory is not None:
        calls = FunctionTools(
            tokenizer, list(tools), environment_factory, call_format, tool_timeout, system_prompt
        )
        sampler = ToolRolloutSampler(sampler, calls, max_tool_calls)
    group_size = len(engine.scripts[0])
    rollout = sampler(policy.model, texts, SamplingParams(max_new_tokens), group_size, rows=fields)
    reward = _reward(reward, calls)
    if reward is None:
        return ScriptedRollout(_samples(tokenizer, texts, rollout), rollout)
    require_arguments(reward, reward_arguments(fields, calls is not None))
    extras = RewardExtras(global_step=0, epoch=0.0, max_steps=None)
    # float64: each score as the reward returned it (a training step's float32 would make 0.2
    # 0.20000000298).
    total, components, errors = score_groups(
        reward, texts, rollout, fields, on_reward_error, extras=extras.arguments(), dtype=torch.float64
    )
    samples = _samples(tokenizer, texts, rollout)
    for i, sample in enumerate(samples):
        sample.reward = float(total[i])
        sample.components = {name: float(scores[i]) for name, scores in components.items()}
    return ScriptedRollout(samples, rollout, total.tolist(), errors, extras.logged())


def _reward(reward: RewardFn | Sequence[RewardFn] | None, calls: FunctionTools | None) -> RewardFn | None:
    """The reward to score with, as in a run: the one given (a list as its CompositeReward), with
    the environments' score joined where each has one (TRL's rule); that score alone where none is
    given; else None."""
    environments = calls.environments.values() if calls is not None else ()
    scored = bool(environments) and all(map(score_name, environments))
    if reward is not None:
        return with_environment_score(as_reward(reward)) if scored else as_reward(reward)
    return EnvironmentReward() if scored else None


def _group(completions: Sequence[Turns] | Mapping[str, Sequence[Turns]], prompt: Prompt) -> list[list[str]]:
    """The scripted turns of each of ``prompt``'s completions."""
    if isinstance(completions, Mapping):
        key = prompt_text(prompt)
        if key not in completions:
            raise KeyError(f"the script has no completions for the prompt {key!r:.200}")
        completions = completions[key]
    if isinstance(completions, str):
        raise TypeError("completions is a list of completions (each a text or its turns), not one text")
    return [[turns] if isinstance(turns, str) else list(turns) for turns in completions]


def _samples(tokenizer: Any, prompts: list[Prompt], rollout: Rollout) -> list[ScriptedSample]:
    """Each completion of ``rollout`` as a :class:`ScriptedSample` (rewards not yet set)."""
    size = len(rollout.completions)
    facts = rollout.facts()
    real, model = rollout.completion_mask.bool(), rollout.loss_mask()
    samples = []
    for i in range(size):
        ids = rollout.completion_ids[i]
        samples.append(
            ScriptedSample(
                prompt=prompts[i // rollout.group_size],
                completion=rollout.completions[i],
                transcript=tokenizer.decode(ids[real[i]]),
                sampled=tokenizer.decode(ids[model[i]]),
                tool_text=tokenizer.decode(ids[real[i] & ~model[i]]),
                tool_calls=facts.get("tool_calls", [[]] * size)[i],
                messages=facts.get(
                    "completions", [[{"role": "assistant", "content": c}] for c in rollout.completions]
                )[i],
                truncated=bool(rollout.truncation[i]),
                environment=facts.get("environments", [None] * size)[i],
            )
        )
    return samples
