"""What GRPOLightningModule is built from, once, in its ``__init__`` (and its sampler in
``configure_model``, its optimizer in ``configure_optimizers``).

The flat hyperparameters (``--model.<name>``: the CLI's, the config's and the checkpoint's
record) become typed settings groups (settings/groups/), and the collaborators the module holds
are built from those here: the log-prob scorer, the loss passes, the rollout source, the step
plan, the metrics and their reporter, the sampled evaluation, the prompt format and the tools.
The layers below (rollout/, training/, evaluation/, models/) cannot import the groups
(tests/test_layers.py): each collaborator there takes the values it reads as its own arguments,
under its own names, or the small typed objects of its layer (the engine's SamplingParams, the
servers' ServeConfig, how rewards are called: RewardCalls), made from the groups here; no
collaborator re-declares a group's settings.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_lightning.evaluation.evaluator import Evaluator
from forge_lightning.evaluation.sampled import AnswerKey, SampledEvaluation, sampled_keys
from forge_lightning.models.lora import LoraSettings, lora_settings
from forge_lightning.models.policy import training_policy
from forge_lightning.reporting.metrics import RunningMetrics
from forge_lightning.reporting.reporter import StepReporter
from forge_lightning.rewards.calls import RewardCalls, refuse_outside_sandbox, sandboxed
from forge_lightning.rewards.environment import EnvironmentReward, with_environment_score
from forge_lightning.rewards.library import (
    CompositeReward,
    GSM8KAnswerReward,
    PolicyContext,
    RewardArgument,
    RewardFn,
    as_reward,
    component_names,
    load_reward,
    reward_name,
    reward_spec,
    share_policy_context,
)
from forge_lightning.rollout.agents.runner import AgentRunner, load_agent
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.engines.hf import eos_token_ids
from forge_lightning.rollout.engines.registry import generation_backend
from forge_lightning.rollout.in_flight import split_threads
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler, max_prompt_length
from forge_lightning.rollout.sources import RolloutSource, SyncRollouts
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools.environments import factories_by_name
from forge_lightning.rollout.tools.function_call import tool_text
from forge_lightning.rollout.tools.recipe import ToolRecipe
from forge_lightning.rollout.tools.stored import StoredTools
from forge_lightning.sandbox.pool import Sandbox, SandboxLimits
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.devices import devices_of
from forge_lightning.serving.processes import ServeConfig
from forge_lightning.serving.remote_sources import RemoteAsyncRollouts, RemoteSyncRollouts, remote_engine
from forge_lightning.settings.groups import (
    EngineSettings,
    GRPOSettings,
    OptimizerSettings,
    PromptSettings,
    SamplingSettings,
    SandboxSettings,
    ToolSettings,
    ValidationSettings,
)
from forge_lightning.training.loss_passes import LossPasses
from forge_lightning.training.optim import OptimizerStep, policy_optimizer
from forge_lightning.training.plan import StepPlan, step_plan
from forge_lightning.training.step import BatchTrainer

VALIDATION_KEYS = ("accuracy", "reward", "completion_length", "truncated_fraction")


@dataclass
class StoredArguments:
    """The constructor's arguments as ``save_hyperparameters`` must see them, and the reward built."""

    model: Any  # the spec, or the model given
    peft: dict[str, Any] | None  # the LoRA settings as a dict
    reward: Any  # the reward's spec (plain data), None for one that has none
    reward_object: Any  # the reward, loaded from its spec or given; None for GSM8K's default
    unstored: list[str]  # the arguments given as objects, which no checkpoint can store
    tools: StoredTools  # the tools and environment factories, by import path and as objects

    @property
    def hparams(self) -> dict[str, Any]:
        """The objects as the hyperparameters keep them (plain data), by argument name."""
        tools = {"tools": self.tools.tools, "environment_factory": self.tools.environment_factory}
        return {"model": self.model, "reward": self.reward, "peft": self.peft, **tools}

    @property
    def ignored(self) -> list[str]:
        """The arguments the hyperparameters leave out: those no checkpoint can store."""
        return ["tokenizer", "accuracy", "answer_key", *self.unstored]

    @property
    def reward_fn(self) -> RewardFn:
        """The reward to train with: the one given, as a reward, or GSM8K's answer check."""
        return as_reward(self.reward_object) if self.reward_object is not None else GSM8KAnswerReward()


def stored_arguments(
    model: Any, tokenizer: Any, reward: RewardArgument | None, peft: LoraSettings | None, tools: StoredTools
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
    return StoredArguments(
        model, None if lora is None else asdict(lora), spec, reward_object, unstored, tools
    )


@dataclass
class Components:
    """The module's collaborators (see GRPOLightningModule.__init__), built from its settings."""

    reward: RewardFn  # the one given, an environment's score, or GSM8K's answer check
    accuracy: RewardFn  # validation's correctness check
    sandbox: Sandbox | None  # where rewards and tools run: None (this process's threads) or workers
    step: BatchTrainer  # what one training batch does
    evaluator: Evaluator  # what one validation batch does
    sampling: SamplingParams  # training's
    greedy: SamplingParams  # validation's and predict's
    scorer: LogProbScorer
    rollout_source: RolloutSource
    plan: StepPlan
    train_metrics: RunningMetrics
    val_metrics: RunningMetrics
    reporter: StepReporter


def build_components(
    settings: GRPOSettings,
    stored: StoredArguments,
    tools: StoredTools,
    accuracy: RewardFn | None,
    answer_key: AnswerKey | None,
) -> Components:
    """Everything the module holds that its ``settings`` decide, around the reward ``stored``
    holds (an environment that scores its episodes, TRL's ``get_reward``, is the reward when none
    is given, and one more reward beside one that is), the ``tools``, the ``accuracy`` check
    (GSM8K's if None) and sampled evaluation's ``answer_key``. The reward's components and the
    tools are each tracked as a metric."""
    reward = run_reward(stored, tools, settings.tools.agent)
    accuracy = accuracy if accuracy is not None else GSM8KAnswerReward()
    rewards = {"reward": reward, "accuracy check": accuracy}
    sandbox = user_code_sandbox(settings.sandbox, rewards, tools.functions, tools.factory)
    reward_names = component_names(reward)
    tool_names = ["calculator"] if settings.tools.calculator is not None else tools.names
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
    val_metrics = RunningMetrics(
        reward_names, keys=(*VALIDATION_KEYS, *sampled_keys(settings.validation.val_num_generations))
    )
    greedy = SamplingParams(settings.validation.max_new_tokens(s.max_new_tokens), greedy=True, stop=stop)
    passes = LossPasses(scorer, loss, settings.advantages.mask_truncated_completions)
    source, plan = rollout_source(settings, sampling, stored.model), step_plan_of(settings)
    reporter = StepReporter(train_metrics)  # its cadence handed over by module.report_every
    optimizer = settings.optimizer
    stepper = OptimizerStep(optimizer.max_grad_norm, optimizer.max_consecutive_bad_steps)
    calls = RewardCalls(settings.rewards.on_reward_error, settings.rewards.reward_timeout, sandbox)
    advantages = settings.advantages
    step = BatchTrainer(
        reward, calls, passes, plan, stepper, reporter, train_metrics, source,
        scale=advantages.advantage_scale, estimator=advantages.advantage_estimator,
    )  # fmt: skip
    sampled = sampled_evaluation(settings.validation, settings.sampling, answer_key)
    evaluator = Evaluator(reward, accuracy, greedy, sampled, calls, val_metrics)
    return Components(
        reward, accuracy, sandbox, step, evaluator, sampling, greedy, scorer, source, plan,
        train_metrics, val_metrics, reporter,
    )  # fmt: skip


def run_reward(stored: StoredArguments, tools: StoredTools, agent: str | None) -> RewardFn:
    """The run's reward: the one set (GSM8K's answer check where none is), with its environments'
    score joined where each scores its episodes (TRL's rule, rewards/environment.py); with none
    set, that score alone, or an agent's return value (its AgentOutcome), named for the agent's
    function (``train/rewards/<function>``)."""
    if stored.reward_object is None and agent is not None:
        return EnvironmentReward(name=str(agent).rpartition(".")[2])
    if stored.reward_object is None and tools.scored:
        return EnvironmentReward()
    return with_environment_score(stored.reward_fn) if tools.scored else stored.reward_fn


def optimizer_config(
    model: PreTrainedModel, settings: OptimizerSettings, total_steps: int, precision: str, sharded: bool
) -> dict[str, Any]:
    """Lightning's ``configure_optimizers`` answer: AdamW and its per-step schedule over ``total_steps``."""
    optimizer, scheduler = policy_optimizer(
        model,
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        warmup_steps=settings.warmup_steps,
        schedule=settings.lr_schedule,
        total_steps=total_steps,
        precision=precision,
        sharded=sharded,
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def rollout_source(settings: GRPOSettings, sampling: SamplingParams, model: Any) -> RolloutSource:
    """Where and when training batches are sampled: now, by the engine the settings name, or by the
    rollout servers (serving/: those listed, or in async mode without a list one ``local:1``
    server); with what the rollouts must carry (the engine's scores, for the loss). ``model``: the
    module's spec (or object), which servers the trainer starts load."""
    engine, off_policy = settings.engine, settings.off_policy
    group, scores = settings.sampling.group_size, off_policy.use_engine_logprobs
    correction = off_policy.rollout_correction is not None
    if engine.rollout_mode == "async":
        remote = servers_engine(settings, model)
        accumulation = settings.optimizer.gradient_accumulation_steps
        return RemoteAsyncRollouts(
            remote,
            sampling,
            group,
            accumulation=accumulation,
            staleness=engine.max_staleness,
            engine_logprobs=scores,
            correction=correction,
        )
    if engine.rollout_servers:
        remote = servers_engine(settings, model)
        return RemoteSyncRollouts(remote, sampling, group, engine_logprobs=scores, correction=correction)
    backend = functools.partial(
        generation_backend,
        engine.generation_backend,
        vllm_gpu_memory_utilization=engine.vllm_gpu_memory_utilization,
        rollout_precision=engine.rollout_precision,
    )
    return SyncRollouts(sampling, group, backend, engine_logprobs=scores, correction=correction)


def served_entries(settings: EngineSettings) -> list[str]:
    """The rollout servers of a run: those ``rollout_servers`` lists, or with async rollouts and
    none listed, one server the trainer starts on this machine."""
    return list(settings.rollout_servers or ["local:1"])


def servers_engine(settings: GRPOSettings, model: Any) -> RemoteEngine:
    """The engine of a run on rollout servers (what they cannot do is refused with the other
    settings: settings/checks.py): the servers the trainer starts run with the model settings here
    (``model``: the spec, or an object, saved for them to load), on the devices ``rollout_device``
    lists, dealt round-robin, each with ``rollout_worker_threads`` CPU threads (None: in async mode
    half of the trainer's, which keeps the rest; else one)."""
    engine, memory = settings.engine, settings.memory
    loading = {
        "model_dtype": memory.model_dtype,
        "attn_implementation": memory.attn_implementation,
        "rollout_precision": engine.rollout_precision,  # the servers sample with that copy
        "rollout_memory_fraction": engine.rollout_memory_fraction,  # each one's GPU share
    }
    asynchronous = engine.rollout_mode == "async"
    half = split_threads(torch.get_num_threads(), None)[1]
    threads = engine.rollout_worker_threads or (half if asynchronous else 1)
    model_section = {name: value for name, value in loading.items() if value is not None}
    serve = ServeConfig(model_section, threads, tuple(devices_of(engine.rollout_device)))
    spec = model if isinstance(model, str) else None
    lag = engine.max_staleness if asynchronous else 0
    return remote_engine(served_entries(engine), serve, spec, engine.partial_rollouts, lag)


def step_plan_of(settings: GRPOSettings) -> StepPlan:
    """The step plan: accumulation, the passes over a rollout, dynamic sampling's rounds."""
    off_policy, dynamic = settings.off_policy, settings.dynamic_sampling
    return step_plan(
        settings.optimizer.gradient_accumulation_steps,
        off_policy.num_iterations,
        off_policy.steps_per_generation,
        dynamic.max_sampling_rounds if dynamic.enabled else None,
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
    return PromptFormat(
        use_chat_template,
        prompts.system_prompt,
        longest,
        prompts.prompt_truncation,
        prompts.chat_template_kwargs,
    )


def user_code_sandbox(
    settings: SandboxSettings, rewards: dict[str, RewardFn], tools: list[Any], environments: Any = None
) -> Sandbox | None:
    """The sandbox the rewards (by role: ``reward``, ``accuracy check``), the function ``tools``
    and the episodes of the ``environments`` (a factory, or a mapping name -> factory) run in
    under ``sandbox: process``, checked now: a machine that cannot isolate, a reward, tool or
    environment that cannot cross into a worker, is refused by name before any model is loaded.
    None under ``sandbox: thread``."""
    if settings.sandbox != "process":
        return None
    limits = SandboxLimits(memory_mb=settings.sandbox_memory_mb, cpu_seconds=settings.sandbox_cpu_seconds)
    sandbox = Sandbox(settings.sandbox_workers, limits, settings.sandbox_env or ())
    functions: dict[str, Any] = {}
    for role, reward in rewards.items():
        parts = (
            zip(reward.names, reward.rewards)
            if isinstance(reward, CompositeReward)
            else [(reward_name(reward), reward)]
        )
        for name, part in parts:
            if sandboxed(part, sandbox):
                refuse_outside_sandbox(part, f"{role} {name!r}")
                functions[f"{role} {name!r}"] = part
    functions.update({f"tool {getattr(fn, '__name__', fn)!r}": fn for fn in tools})
    if tools:  # each call's text is made and cut in its worker
        functions["tool text"] = tool_text
    for name, factory in factories_by_name(environments).items():
        functions["environment_factory" if name is None else f"environment_factory[{name!r}]"] = factory
    sandbox.prepare(functions)
    return sandbox


def with_tools(
    sampler: RolloutSampler,
    tools: ToolSettings,
    system_prompt: str | None,
    stored: StoredTools,
    sandbox: Sandbox | None = None,
    reward: RewardFn | None = None,
) -> RolloutSampler | ToolRolloutSampler | AgentRunner:
    """The module's episode runner: ``sampler``, or the tools its settings name around it (the
    calculator, or ``stored``'s functions and environment, called in ``sandbox`` where given), or
    the agent they name with it (scored by its return value where ``reward`` reads it:
    :func:`reads_agent_score`)."""
    if tools.agent is not None:
        agent = load_agent(tools.agent)
        scored = reads_agent_score(reward)
        return AgentRunner(sampler, agent, scored, tools.tool_call_format, tools.agent_timeout)
    recipe = tool_recipe(tools, system_prompt, stored)
    return sampler if recipe is None else recipe.runner(sampler, sandbox)


def tool_recipe(tools: ToolSettings, system_prompt: str | None, stored: StoredTools) -> ToolRecipe | None:
    """The calculator, or ``stored``'s functions and environment, as the tool settings name them;
    None for a run without them (or with an agent, which runs its own)."""
    if tools.agent is not None or (
        tools.calculator is None and not stored.functions and stored.factory is None
    ):
        return None
    return ToolRecipe(
        calculator=tools.calculator,
        functions=tuple(stored.functions),
        factory=stored.factory,
        max_tool_calls=tools.max_tool_calls,
        call_format=tools.tool_call_format,
        timeout=tools.tool_timeout,
        system_prompt=system_prompt,
        max_result_chars=tools.max_tool_result_chars,
        max_parallel=tools.max_parallel_tool_calls,
    )


def policy(
    model: PreTrainedModel | None,
    tokenizer: Any,
    spec: str | None,
    mesh: Any,
    precision: str | None,
    settings: GRPOSettings,
    peft: dict[str, Any] | None,
) -> tuple[PreTrainedModel, Any]:
    """``configure_model``'s policy and tokenizer (models/policy.py), as the memory and engine
    settings say: ``spec`` loaded where no model is built yet, LoRA, checkpointing, prefix sharing."""
    memory = settings.memory
    return training_policy(
        model, tokenizer, spec, mesh, precision,
        dtype=memory.model_dtype, attention=memory.attn_implementation, peft=peft,
        gradient_checkpointing=memory.gradient_checkpointing, prefix_sharing=memory.prefix_sharing,
        generation_backend=settings.engine.generation_backend,
    )  # fmt: skip


def prepare_rollouts(
    source: RolloutSource,
    tokenizer: Any,
    model: PreTrainedModel,
    settings: GRPOSettings,
    tools: StoredTools,
    use_chat_template: bool,
    scoring_temperature: float,
    sandbox: Sandbox | None,
    reward: RewardFn,
) -> None:
    """The rollout source's engine and episode runner for ``model``: its prompts encoded as the
    prompt settings say, its completions ending at the model's EOS tokens, its tools or agent if
    any (``reward``: the module's, which may read the agent's score)."""
    eos = eos_token_ids(tokenizer, model)
    prompts = prompt_format(model, settings.prompts, settings.sampling.max_new_tokens, use_chat_template)
    system_prompt = settings.prompts.system_prompt
    source.prepare(
        tokenizer, model, eos, prompts, scoring_temperature,
        lambda sampler: with_tools(sampler, settings.tools, system_prompt, tools, sandbox, reward),
        tool_recipe(settings.tools, system_prompt, tools),
    )  # fmt: skip


def reads_agent_score(reward: RewardFn | None) -> bool:
    """Whether ``reward`` scores an agent's episodes by what the agent returned: None (no reward
    given), or EnvironmentReward (the module's reward when none is set) alone or a part of a
    CompositeReward."""
    if reward is None:
        return True
    parts = reward.rewards if isinstance(reward, CompositeReward) else [reward]
    return any(isinstance(part, EnvironmentReward) for part in parts)


def share_policy(reward: RewardFn, accuracy: RewardFn, device: Any, prompts: PromptSettings) -> None:
    """Tell the rewards (a reward model among them) the policy's device and system prompt."""
    context = PolicyContext(device, prompts.system_prompt)
    share_policy_context(reward, context)
    share_policy_context(accuracy, context)
