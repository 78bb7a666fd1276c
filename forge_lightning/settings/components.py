"""What GRPOLightningModule is built from, once, in its ``__init__`` (and its sampler in
``configure_model``).

The flat hyperparameters (``--model.<name>``: the CLI's, the config's and the checkpoint's
record) become typed settings groups (settings/groups.py), and the collaborators the module holds
are built from those here: the log-prob scorer, the loss passes, the rollout source, the step
plan, the metrics and their reporter, the sampled evaluation, the prompt format and the tools.
The layers below (rollout/, training/, evaluation/, models/) cannot import the groups
(tests/test_layers.py): each collaborator there takes its own typed settings or values, picked
from the groups here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from transformers import PreTrainedModel

from forge_lightning.evaluation.sampled import AnswerKey, SampledEvaluation, sampled_keys
from forge_lightning.models.lora import LoraSettings, lora_settings
from forge_lightning.reporting.metrics import RunningMetrics
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
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler, max_prompt_length
from forge_lightning.rollout.sources import RolloutSettings, RolloutSource, rollout_source
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools.base import ToolProtocol
from forge_lightning.rollout.tools.calculator import CalculatorTools, InlineCalculator
from forge_lightning.rollout.tools.functions import FunctionTools
from forge_lightning.rollout.tools.stored import StoredTools
from forge_lightning.settings.groups import (
    GRPOSettings,
    PromptSettings,
    SamplingSettings,
    ToolSettings,
    ValidationSettings,
)
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.optim import OptimizerStep
from forge_lightning.training.plan import PlanSettings, StepPlan, step_plan
from forge_lightning.training.step import StepSettings

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
    """The module's collaborators (see GRPOLightningModule.__init__), built from its settings."""

    sampling: SamplingParams  # training's
    greedy: SamplingParams  # validation's and predict's
    scorer: LogProbScorer
    passes: LossPasses
    rollout_source: RolloutSource
    plan: StepPlan
    train_metrics: RunningMetrics
    val_metrics: RunningMetrics
    reporter: StepReporter
    stepper: OptimizerStep
    step_settings: StepSettings  # what a training batch reads itself (training/step.py)


def build_components(settings: GRPOSettings, reward_names: list[str], tool_names: list[str]) -> Components:
    """Everything the module holds that its ``settings`` decide; ``reward_names``: the reward's
    components, and ``tool_names`` the tools, each tracked as a metric."""
    s, loss = settings.sampling, settings.loss
    stop = tuple(s.stop or ())
    sampling = SamplingParams(
        s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        stop=stop,
        extra=s.generation_kwargs,
    )
    memory = settings.memory
    scorer = LogProbScorer(
        temperature=loss.scoring_temperature(s.temperature),
        shared_prefix=memory.prefix_sharing,
        chunk_size=memory.logprob_chunk_size,
        micro_batch_size=memory.train_micro_batch_size,
        micro_batch_tokens=memory.train_micro_batch_tokens,
        head_chunk_size=memory.lm_head_chunk_size,
    )
    train_metrics = RunningMetrics(reward_names, tools=tool_names)
    sampled = sampled_keys(settings.validation.val_num_generations)
    optimizer = settings.optimizer
    return Components(
        sampling=sampling,
        greedy=SamplingParams(s.max_new_tokens, greedy=True, stop=stop),
        scorer=scorer,
        passes=LossPasses(scorer, loss, settings.advantages.mask_truncated_completions),
        rollout_source=rollout_source(rollout_settings(settings, sampling)),
        plan=step_plan(plan_settings(settings)),
        train_metrics=train_metrics,
        val_metrics=RunningMetrics(reward_names, keys=(*VALIDATION_KEYS, *sampled)),
        reporter=StepReporter(train_metrics),  # its cadence handed over by module.report_every
        stepper=OptimizerStep(optimizer.max_grad_norm, optimizer.max_consecutive_bad_steps),
        step_settings=step_settings(settings),
    )


def step_settings(settings: GRPOSettings) -> StepSettings:
    """What a training batch reads itself: the groups' sizes, the advantages, how rewards fail, mu."""
    advantages, rewards = settings.advantages, settings.rewards
    return StepSettings(
        group_size=settings.sampling.group_size,
        advantage_scale=advantages.advantage_scale,
        mask_truncated_completions=advantages.mask_truncated_completions,
        on_reward_error=rewards.on_reward_error,
        reward_timeout=rewards.reward_timeout,
        num_iterations=settings.off_policy.num_iterations,
    )


def rollout_settings(settings: GRPOSettings, sampling: SamplingParams) -> RolloutSettings:
    """How training batches are sampled: the engine's group, with what the rollouts must carry."""
    engine, off_policy, memory = settings.engine, settings.off_policy, settings.memory
    return RolloutSettings(
        mode=engine.rollout_mode,
        group_size=settings.sampling.group_size,
        sampling=sampling,
        engine_logprobs=off_policy.use_engine_logprobs,
        correction=off_policy.rollout_correction is not None,
        generation_backend=engine.generation_backend,
        vllm_gpu_memory_utilization=engine.vllm_gpu_memory_utilization,
        gradient_accumulation_steps=settings.optimizer.gradient_accumulation_steps,
        max_staleness=engine.max_staleness,
        worker_threads=engine.rollout_worker_threads,
        worker_device=engine.rollout_device,
        worker_memory_fraction=engine.rollout_memory_fraction,
        prefix_sharing=memory.prefix_sharing,
        logprob_chunk_size=memory.logprob_chunk_size,
    )


def plan_settings(settings: GRPOSettings) -> PlanSettings:
    """What the step plan reads: accumulation, the passes over a rollout, dynamic sampling's rounds."""
    off_policy, dynamic = settings.off_policy, settings.dynamic_sampling
    return PlanSettings(
        group_size=settings.sampling.group_size,
        gradient_accumulation_steps=settings.optimizer.gradient_accumulation_steps,
        num_iterations=off_policy.num_iterations,
        dynamic_sampling=dynamic.enabled,
        max_sampling_rounds=dynamic.max_sampling_rounds,
        steps_per_generation=off_policy.steps_per_generation,
    )


def sampled_evaluation(
    validation: ValidationSettings, sampling: SamplingSettings, answer_key: AnswerKey | None
) -> SampledEvaluation:
    """The module's sampled evaluation; a completion ends where training's do (``stop``)."""
    params = SamplingParams(
        validation.max_new_tokens(sampling.max_new_tokens),
        temperature=validation.val_temperature,
        top_p=validation.val_top_p,
        stop=tuple(sampling.stop or ()),
    )
    return SampledEvaluation(validation.val_num_generations, params, answer_key)


def prompt_format(
    model: PreTrainedModel, prompts: PromptSettings, max_new_tokens: int, use_chat_template: bool
) -> PromptFormat:
    """How the module's prompts are encoded for ``model`` (``use_chat_template`` resolved: the
    setting, or whether the tokenizer has one)."""
    longest = max_prompt_length(model, prompts.max_prompt_length, max_new_tokens)
    return PromptFormat(use_chat_template, prompts.system_prompt, longest, prompts.prompt_truncation)


def with_tools(
    sampler: RolloutSampler, tools: ToolSettings, system_prompt: str | None, stored: StoredTools
) -> RolloutSampler | ToolRolloutSampler:
    """The module's episode runner: ``sampler``, or the tools its settings name around it (the
    calculator, or ``stored``'s functions and environment)."""
    if tools.calculator is not None:
        calls: ToolProtocol = CalculatorTools(InlineCalculator(tools.calculator), sampler.tokenizer)
    elif stored.functions or stored.factory is not None:
        calls = FunctionTools(
            sampler.tokenizer,
            stored.functions,
            stored.factory,
            tools.tool_call_format,
            tools.tool_timeout,
            system_prompt,
            tools.max_tool_result_chars,
        )
    else:
        return sampler
    return ToolRolloutSampler(sampler, calls, tools.max_tool_calls)
