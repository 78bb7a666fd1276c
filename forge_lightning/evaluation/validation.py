"""What validation makes of one batch's greedy completions: the scores, and the answers to keep."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from forge_lightning.reporting.metrics import RunningMetrics
from forge_lightning.rewards.batch_scoring import score_groups
from forge_lightning.rewards.calls import RewardCalls
from forge_lightning.rewards.extras import RewardExtras, reward_arguments
from forge_lightning.rewards.library import require_arguments, reward_name
from forge_lightning.rollout.sampler import prompt_text
from forge_lightning.rollout.types import Rollout
from forge_lightning.run.signals import sigterm_interrupts

# Lightning's own refusal (no test_step) says nothing of where the evaluation is.
NO_TEST_STEP = (
    "GRPOLightningModule has no test step: evaluate with trainer.validate (forge-lightning validate), "
    "which scores one greedy completion per prompt, or trainer.predict for the completions alone"
)


def check_validation_arguments(
    reward: Any, accuracy: Any, batch_kwargs: dict[str, list[Any]], tools: bool = False
) -> None:
    """Before the first validation batch is sampled: the reward, and the accuracy check where the
    batch has references, must find every argument they require among the batch's columns and
    the rollout's facts (a tool-using one's with ``tools``); TRL's trainer_state and log_metric
    are the reward's only."""
    require_arguments(reward, reward_arguments(batch_kwargs, tools))
    if "references" in batch_kwargs:
        available = reward_arguments(batch_kwargs, tools, extras=False)
        require_arguments(accuracy, available, role="accuracy check")


def score_validation(
    reward: Any,
    accuracy: Any,
    prompts: list[Any],
    rollout: Rollout,
    batch_kwargs: dict[str, list[Any]],
    calls: RewardCalls,
    metrics: RunningMetrics,
    extras: RewardExtras | None = None,
) -> list[dict[str, Any]]:
    """Score the batch's completions (one per prompt) with the reward, and with the accuracy check
    where the batch has references, into ``metrics``; one answer per prompt (prompt, completion,
    reference, reward, correct, completion_length, truncated; with tools, tool_calls and the
    transcript's messages) for RewardLogger's files. ``extras``: TRL's trainer_state and
    log_metric for the reward, whose metrics are logged as ``val/<name>``."""
    given = extras.arguments() if extras is not None else None
    with sigterm_interrupts():
        rewards, components, _ = score_groups(
            reward, prompts, rollout, batch_kwargs, calls.on_error, calls.timeout, given, calls.sandbox
        )
    if extras is not None:
        metrics.add_logged(extras.logged(), "val")
    metrics.update("reward", rewards)
    for name, values in components.items():
        metrics.update(f"rewards/{name}", values)
    metrics.update("completion_length", rollout.completion_lengths.float())
    metrics.update("truncated_fraction", rollout.truncation.float())
    references = batch_kwargs.get("references")
    if references is not None:
        correct = score_accuracy(accuracy, prompts, rollout, batch_kwargs, calls)
        metrics.update("accuracy", correct)
    samples = []
    for i, prompt in enumerate(prompts):
        sample = {"prompt": prompt_text(prompt), "completion": rollout.completions[i]}
        if references is not None:
            sample["reference"] = references[i]
        sample["reward"] = float(rewards[i])
        if references is not None:
            sample["correct"] = float(correct[i])
        sample.update(answer_facts(rollout, i))
        if rollout.transcripts is not None:  # a tool-using rollout: its turns
            sample["messages"] = rollout.transcripts[i]
        samples.append(sample)
    return samples


def answer_facts(rollout: Rollout, i: int) -> dict[str, Any]:
    """What an answers file records of completion ``i`` besides its text and scores: its length
    (the policy's tokens), whether it was cut off, and with tools its calls."""
    facts: dict[str, Any] = {
        "completion_length": int(rollout.completion_lengths[i]),
        "truncated": bool(rollout.truncation[i]),
    }
    if rollout.tool_calls is not None:
        facts["tool_calls"] = rollout.tool_calls[i]
    return facts


def score_accuracy(
    accuracy: Any,
    prompts: list[Any],
    rollout: Rollout,
    batch_kwargs: dict[str, list[Any]],
    calls: RewardCalls,
) -> Tensor:
    """The accuracy check's scores of a rollout's completions ``(P*G,)``. Its failure names the
    ``accuracy`` setting: the check is GSM8K's number comparison unless one is given, and a
    reference it cannot read (a word, not a number) fails there, not in the reward."""
    try:
        with sigterm_interrupts():
            correct, _, _ = score_groups(
                accuracy, prompts, rollout, batch_kwargs, calls.on_error, calls.timeout,
                sandbox=calls.sandbox,
            )  # fmt: skip
    except Exception as err:
        raise RuntimeError(
            f"validation's accuracy check {reward_name(accuracy)} failed: {err}. It is the module's "
            "`accuracy` setting (GSM8K's answer check, GSM8KAnswerReward, unless set), which scores "
            "val/accuracy against each prompt's reference; set one that fits these references, e.g. "
            "accuracy=ExactMatchReward() (forge_lightning.rewards) in Python, or on the command line "
            "--model.accuracy forge_lightning.rewards.ExactMatchReward"
        ) from err
    return correct
