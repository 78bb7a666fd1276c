"""What GRPOLightningModule is built from, once, in its ``__init__``.

The flat hyperparameters (``--model.<name>``: the CLI's, the config's and the checkpoint's
record) become typed settings, and the collaborators the module holds take those: the log-prob
scorer, the loss passes, the rollout source, the step plan, the metrics and their reporter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from forge_lightning.evaluation.sampled import sampled_keys
from forge_lightning.grpo import LossSettings
from forge_lightning.models.lora import LoraSettings, lora_settings
from forge_lightning.reporting.metrics import TrainMetrics
from forge_lightning.reporting.reporter import StepReporter
from forge_lightning.rewards.library import (
    GSM8KAnswerReward,
    RewardArgument,
    RewardFn,
    as_reward,
    load_reward,
    reward_spec,
)
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.sources import SyncRollouts, rollout_settings, rollout_source
from forge_lightning.settings.checks import TrainSettings, loss_settings, train_settings
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.optim import OptimizerStep
from forge_lightning.training.plan import StepPlan, plan_settings, step_plan

VALIDATION_KEYS = ("accuracy", "reward", "completion_length", "truncated_fraction")


@dataclass
class StoredArguments:
    """The constructor's arguments as ``save_hyperparameters`` must see them, and the reward built."""

    peft: dict[str, Any] | None  # the LoRA settings as a dict
    reward: Any  # the reward's spec (plain data), None for one that has none
    reward_object: Any  # the reward, loaded from its spec or given; None for GSM8K's default
    unstored: list[str]  # the arguments given as objects, which no checkpoint can store

    @property
    def reward_fn(self) -> RewardFn:
        """The reward to train with: the one given, as a reward, or GSM8K's answer check."""
        return as_reward(self.reward_object) if self.reward_object is not None else GSM8KAnswerReward()


def stored_arguments(
    model: Any, tokenizer: Any, reward: RewardArgument | None, peft: LoraSettings | None
) -> StoredArguments:
    """Lightning checkpoints load with weights_only=True, which refuses custom classes: the
    hyperparameters keep the LoRA settings as a dict (load_from_checkpoint passes it back), and the
    reward as plain data (run/specs.py) that load_reward turns back into the reward. One with none (a
    lambda) is left out, as a model object is (load_from_checkpoint asks for them)."""
    if not isinstance(model, str) and tokenizer is None:
        raise ValueError("tokenizer is required when model is an already-built model object")
    lora = lora_settings(peft)
    reward_object = load_reward(reward)
    spec = reward_spec(reward_object)
    unstored = ["model"] if model is not None and not isinstance(model, str) else []
    unstored += ["reward"] if reward_object is not None and spec is None else []
    return StoredArguments(None if lora is None else asdict(lora), spec, reward_object, unstored)


@dataclass
class Components:
    """The module's typed settings and collaborators (see GRPOLightningModule.__init__)."""

    settings: TrainSettings
    loss: LossSettings
    sampling: SamplingParams  # training's
    greedy: SamplingParams  # validation's and predict's
    scorer: LogProbScorer
    passes: LossPasses
    rollout_source: SyncRollouts
    plan: StepPlan
    train_metrics: TrainMetrics
    val_metrics: TrainMetrics
    reporter: StepReporter
    stepper: OptimizerStep


def build_components(hp: Mapping[str, Any], reward_names: list[str], tool_names: list[str]) -> Components:
    """Everything the module holds that its hyperparameters ``hp`` decide; ``reward_names``: the
    reward's components, and ``tool_names`` the tools, each tracked as a metric."""
    loss = loss_settings(hp)
    stop = tuple(hp.get("stop") or ())
    sampling = SamplingParams(
        hp["max_new_tokens"],
        temperature=hp["temperature"],
        top_p=hp["top_p"],
        top_k=hp["top_k"],
        min_p=hp.get("min_p", 0.0),
        repetition_penalty=hp.get("repetition_penalty", 1.0),
        stop=stop,
        extra=hp.get("generation_kwargs"),
    )
    scorer = LogProbScorer(
        temperature=loss.scoring_temperature(hp["temperature"]),
        shared_prefix=hp["prefix_sharing"],
        chunk_size=hp["logprob_chunk_size"],
        micro_batch_size=hp["train_micro_batch_size"],
    )
    train_metrics = TrainMetrics(reward_names, tools=tool_names)
    return Components(
        settings=train_settings(hp),
        loss=loss,
        sampling=sampling,
        greedy=SamplingParams(hp["max_new_tokens"], greedy=True, stop=stop),
        scorer=scorer,
        passes=LossPasses(scorer, loss, hp["mask_truncated_completions"]),
        rollout_source=rollout_source(rollout_settings(hp, sampling)),
        plan=step_plan(plan_settings(hp)),
        train_metrics=train_metrics,
        val_metrics=TrainMetrics(
            reward_names, keys=(*VALIDATION_KEYS, *sampled_keys(hp["val_num_generations"]))
        ),
        reporter=StepReporter(train_metrics),  # its cadence handed over by module.report_every
        stepper=OptimizerStep(hp["max_grad_norm"], hp["max_consecutive_bad_steps"]),
    )
