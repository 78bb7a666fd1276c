"""GRPOLightningModule: group rollouts, rewards and the clipped policy-gradient step in Lightning.

What one training batch does is training/step.py's (score, advantages, plan, log-probs, loss
passes, optimizer step, record); the math, grpo/; validation, evaluation/evaluator.py. The module
builds them once from its settings (settings/components.py) and runs them from Lightning's hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from typing_extensions import override

from forge_lightning.callbacks.defaults import fit_callbacks
from forge_lightning.callbacks.preemption import Preemption
from forge_lightning.callbacks.publish import publish_step, publish_validation
from forge_lightning.callbacks.step_axis import EvaluationLogStep
from forge_lightning.callbacks.trainer_view import fit_shape, step_context
from forge_lightning.data.datamodule import split_batch
from forge_lightning.data.gsm8k import extract_answer
from forge_lightning.evaluation.ranks import owned_samples
from forge_lightning.evaluation.sampled import TrainingRandomState, batch_sizes, run_seed, sampling_seed
from forge_lightning.evaluation.validation import NO_TEST_STEP
from forge_lightning.grpo import (
    AdvantageEstimator,
    AdvantageScale,
    ImportanceSampling,
    KLEstimator,
    LossSettings,
    LossType,
)
from forge_lightning.models.loading import ensure_pad_token
from forge_lightning.models.lora import LoraSettings
from forge_lightning.reporting.metrics import StepRecord
from forge_lightning.rewards.extras import RewardExtras, reward_arguments
from forge_lightning.rewards.library import (
    PolicyContext,
    RewardArgument,
    require_arguments,
    share_policy_context,
)
from forge_lightning.rollout.agents.runner import AgentRunner
from forge_lightning.rollout.engines.base import GenerationBackend
from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.rollout.sources import TrainingBatch
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools.stored import EnvironmentArgument, ToolsArgument, stored_tools
from forge_lightning.run.checkpoint_io import refuse_unstored_objects
from forge_lightning.settings.checks import validate_hparams
from forge_lightning.settings.components import (
    build_components,
    optimizer_config,
    policy,
    prepare_rollouts,
    stored_arguments,
)
from forge_lightning.settings.groups import GRPOSettings, check_generation_budget
from forge_lightning.settings.trl_names import pointing_at_settings
from forge_lightning.training.adjustments import CHECKPOINT_KEY, Adjustments, scale_learning_rate
from forge_lightning.training.loss_passes import ReferenceSource
from forge_lightning.training.optim import rescale_schedule
from forge_lightning.training.peak_memory import memory_limit
from forge_lightning.training.preflight import (
    Engine,
    WorstCase,
    data_longest_prompt,
    filler_token,
    longest_prompt,
    optimizer_state_bytes,
    run_preflight,
    training_prompts,
)
from forge_lightning.training.preflight_advice import check_preflight
from forge_lightning.training.run_state import load_run_state, save_run_state


class GRPOLightningModule(pl.LightningModule):
    """GRPO fine-tuning of a HuggingFace causal LM, with manual optimization.

    Each ``training_step`` samples ``group_size`` completions per prompt, scores them, turns the
    scores into group-relative advantages and backpropagates the clipped surrogate loss with a KL
    pull toward the frozen reference (which a ``ReferenceModel`` callback provides). The optimizer
    steps every ``gradient_accumulation_steps`` batches and at the end of an epoch, so
    ``trainer.global_step`` counts optimizer steps.

    Args are listed by group, as the settings are typed in ``self.settings`` (a
    :class:`~forge_lightning.settings.groups.GRPOSettings`): the field of each group's dataclass in
    settings/groups.py says what its setting does in full. The model, the reward, the tokenizer,
    LoRA, the tools, the accuracy check and the answer key are not settings of a group.

    Args:
        model: a spec (``embedded``, hub id, folder, ``.gguf``, ``random:...``; models/loading.py) or
            a built HF LM.
        reward: a reward object or any ``(prompts, responses, **kwargs) -> list[float]``; GSM8K's if None.
            A list of them (TRL's ``reward_funcs``) is their equally weighted CompositeReward. One
            given by import path (functions, classes, their lists) is stored in the checkpoint.
        tokenizer: required when ``model`` is an object; loaded with the spec otherwise.
        peft: train a LoRA adapter (lora.LoraSettings or a dict of its fields); None trains every weight.
        group_size: completions per prompt (G), at least 2.
        max_new_tokens: longest completion, in tokens.
        temperature: sampling temperature; the loss scores at it too (``forge``: at 1).
        top_p: nucleus sampling mass.
        top_k: sample among the k likeliest tokens; 0 disables it.
        min_p: drop tokens below this share of the likeliest one's probability; 0 disables it.
        repetition_penalty: HF's and vLLM's penalty on tokens already in the sequence; 1 disables it.
        stop: strings that end a completion (training and validation), the mask running through
            the token that completes the first; the reward's text ends with it.
        generation_kwargs: more settings for the engine, by its own names (``GenerationConfig``
            fields for HF, ``vllm.SamplingParams`` for vLLM); keys the module sets itself and
            unknown ones are refused by name (rollout/engines/generation_settings.py).
        max_prompt_length: longer prompts are cut from the left, or refused (``prompt_truncation``);
            None: the model's context length less ``max_new_tokens``.
        prompt_truncation: ``left`` (with a warning) or ``error``.
        use_chat_template: prompts through the tokenizer's chat template; None: when it has one.
        system_prompt: system message for the chat template.
        chat_template_kwargs: more variables for the chat template (``enable_thinking``), given to
            every rendering of prompts and tool turns.
        loss_type: ``grpo``, ``dapo``, ``dr_grpo``, ``forge``, ``cispo`` or ``sapo`` (see
            grpo.LossSettings).
        clip_epsilon: the ratio's clip range, in (0, 1) (see grpo.LossSettings).
        clip_epsilon_high: a separate upper clip range (DAPO's clip-higher); None: ``clip_epsilon``.
        kl_beta: weight of the KL penalty toward the reference; 0 needs no reference.
        importance_sampling_level: ``token`` ratios, or one per completion (``sequence``, GSPO).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (grpo.LossSettings gives each one's gradient).
        clip_ratio_c: dual clip's cap on a term with A < 0, in units of -A (> 1); None: off.
        sapo_temperature_pos: ``sapo``'s gate temperature where A > 0.
        sapo_temperature_neg: ``sapo``'s gate temperature where A < 0.
        entropy_coef: weight of the entropy bonus taken off the loss; 0: none.
        kl_in_reward: ``kl_beta`` x the KL taken off each reward, not added to the loss.
        advantage_scale: divide centred rewards by the group's std, the batch's, or nothing.
        advantage_estimator: ``grpo``, ``rloo`` or ``reinforce_pp`` (with ``advantage_scale: none``).
        mask_truncated_completions: a completion cut off at ``max_new_tokens`` (no EOS) gets no
            policy or KL weight, and is left out of the loss's normaliser; it still counts in its
            group's reward statistics (as in TRL and DAPO).
        num_iterations: optimizer passes over each rollout (mu); above 1 needs accumulation 1.
        steps_per_generation: optimizer steps each batch's generation feeds (S).
        use_engine_logprobs: the old policy's log-probs from the engine's scores, not a forward.
        behav_imp_weight_cap: async: the cap of the default correction (> 1; None).
        rollout_correction: ``mask`` (MIS) or ``truncate`` (TIS) by the sampler's log-probs; None: off.
        rollout_correction_level: ``token``, or ``sequence``: one weight per completion, from
            the mean log-ratio over its model tokens.
        rollout_correction_cap: the cap of ``w`` (> 1; TRL's 3).
        learning_rate: AdamW's peak learning rate.
        weight_decay: AdamW's weight decay.
        gradient_accumulation_steps: batches per optimizer step.
        max_grad_norm: clip the gradient's total norm to this before each step; None disables.
        warmup_steps: optimizer steps of linear warmup.
        lr_schedule: ``cosine`` to zero at the last step (Forge's), ``linear`` to zero (TRL's), or
            ``constant`` after the warmup.
        max_consecutive_bad_steps: non-finite gradients skip the step; this many in a row stop.
        dynamic_sampling: train on informative groups only, sampling rounds until a step has enough
            (DAPO; see training/dynamic_sampling.py); ``gradient_accumulation_steps`` then counts
            informative prompts.
        max_sampling_rounds: with dynamic sampling, the rounds after which a step trains on what it has.
        generation_backend: ``hf`` (the policy's ``generate``) or ``vllm`` (GPU; see rollout/engines/vllm.py).
        vllm_gpu_memory_utilization: the share of GPU memory the vLLM engine may take.
        rollout_precision: sample with a copy of the policy in ``int8`` (torchao's weight-only) or
            ``bf16``, remade after every optimizer step (rollout/engines/quantized.py); needs
            ``rollout_correction``. None: the policy itself.
        rollout_mode: ``sync``, or ``async``: a worker process samples while the trainer trains.
        max_staleness: async: optimizer steps a rollout may lag the weights it trains (k >= 0).
        rollout_worker_threads: async: the worker's CPU threads, the trainer the rest; None: half.
        rollout_device: async: the worker's device (None: the CPU). ``cuda:N`` is another GPU,
            ``cuda`` the trainer's own (with ``rollout_memory_fraction``); the weights go device
            to device (rollout/engines/weight_ring.py).
        rollout_memory_fraction: async: the GPU memory share the worker may take.
        train_micro_batch_size: completions per forward/backward (None: all); same gradient, less memory.
        train_micro_batch_tokens: the most tokens per forward/backward of the loss, padding included
            (None: by ``train_micro_batch_size``). The completions, longest first, are packed into
            balanced micro-batches under it, with prefix sharing as whole groups or single rows,
            whichever runs fewer tokens (rollout/micro_batches.py), each of at most
            ``train_micro_batch_size`` rows when that is set. Same gradient, fewer padded tokens
            (``perf/padding_fraction``).
        prefix_sharing: each prompt's forward once per group, its keys/values shared by the G completions.
        logprob_chunk_size: rows per chunk of the float32 log-softmax; None for no chunks. Where
            ``lm_head_chunk_size`` applies, its chunks are the log-softmax's.
        lm_head_chunk_size: positions per chunk through the LM head (None: all at once). The
            log-probs and entropies are taken from the decoder's hidden states a chunk at a time,
            so one chunk's logits exist at a time, in the training backward too
            (grpo/linear_log_probs.py); same values and gradients. Models it does not fit
            (models/lm_head.py) take their own forward.
        gradient_checkpointing: trade compute for activation memory in the training forward.
        model_dtype: the dtype a model spec is loaded in. ``float32`` (the default) keeps the weights
            and the AdamW state in full precision under ``bf16-mixed``/``16-mixed`` (autocast computes
            in half precision), also when the checkpoint is stored in bf16, as most of the hub is;
            ``auto`` keeps the checkpoint's dtype; ``bfloat16`` / ``float16`` train half-precision
            weights, which a small learning rate barely moves (a warning says so).
        attn_implementation: ``sdpa``, ``eager``, ``flash_attention_2``, ...; None: transformers' choice.
        max_generation_tokens: the most tokens one batch's generation may hold, counted as its rows
            x (``max_prompt_length``, 0 when unset, + new tokens): a training batch (prompts per
            step x ``group_size`` rows) or a sampled validation batch (``val_batch_size`` x
            ``val_num_generations`` rows) over it is refused before any step.
        on_reward_error: ``raise`` names the failing reward and sample; ``zero`` scores it 0 and counts it.
        reward_timeout: seconds a reward call may take; a longer one is abandoned and its batch
            fails as under ``on_reward_error``; None waits for ever (under ``sandbox: process``, 60 s).
        calculator: completions may call an inline calculator, ``annotation`` (GSM8K's ``<<48/2=``)
            or ``plain`` (``41 + 29 =``); its answers are read, not trained on (rollout/tool_sampler.py).
        max_tool_calls: with tools, the calls one completion may make.
        tool_call_format: how a completion writes a call: ``hermes``, ``llama3_json`` or ``qwen3_coder``.
        tool_timeout: seconds a tool call may take before it is abandoned and answered with an error
            (an ``async def`` one too, even where it blocks its event loop); under ``sandbox:
            thread`` its thread runs on, counted in ``tool_threads_abandoned``.
        max_tool_result_chars: the characters of a tool's result the model reads; a longer one is
            cut before it is rendered, marked as cut and counted (``tool_results_cut``).
        max_parallel_tool_calls: the tool calls that run at once (``async def`` ones are awaited).
        agent: an OpenAI-SDK ``async def agent(client, row) -> float`` by import path (rollout/agents/).
        agent_timeout: seconds an agent's episode may take; a longer one fails.
        tools: typed functions with docstrings (or their import paths) a completion may call in the
            ``tool_call_format``; each result comes back as the chat template's ``tool`` message
            (tools/functions.py). Stored by import path: a lambda or local function is refused.
        environment_factory: a class, or a function returning an environment (or its import path),
            made once per completion (tools/environments.py): ``reset(**row)`` starts its episode
            (text it returns joins the prompt), ``get_reward()`` (or ``reward()``) scores it
            (EnvironmentReward: the reward when ``reward`` is None, else one more reward beside
            it, TRL's rule), its other public methods are
            tools; or a mapping name -> factory, a row's ``environment`` field picking its own. Sync
            rollouts only (HF generate or vLLM).
        sandbox: ``thread``: rewards and tools run in the trainer's process (a timeout abandons the
            call's thread); ``process``: in sandboxed worker processes (run/sandbox.py), each call
            killed with everything it started past its timeout (60 s where None); refused at the
            start where the machine cannot isolate. A RewardModel stays in process. An
            environment lives in one worker's process for its whole episode (its tools and its
            score are called there; episodes share the workers).
        sandbox_memory_mb: ``process``: the address space a call may add to its worker's, in MiB.
        sandbox_cpu_seconds: ``process``: the CPU seconds of one call.
        sandbox_workers: ``process``: worker processes, so calls that may run at once (an
            episode's among them).
        sandbox_env: ``process``: the names of the trainer's environment variables that cross
            into the workers (an API key a reward needs); no other variable does.
        val_num_generations: completions sampled per validation prompt (n) for val/mean@n, pass@k
            and maj@k; 0: greedy only.
        val_temperature: temperature of the sampled validation completions.
        val_top_p: nucleus mass of the sampled validation completions.
        val_max_new_tokens: longest validation completion, greedy and sampled (and predict's);
            None: ``max_new_tokens``.
        accuracy: the check behind ``val/accuracy`` (a reward scoring 1 when right); GSM8K's if None.
        answer_key: what a sampled completion votes for in maj@k (GSM8K's extracted number by
            default), ``completion -> hashable``, None for no answer. None logs no maj@k.
        preflight: first a worst-case step, weights unchanged (training/preflight.py): stop, with
            sized suggestions, where its peak memory is over ``preflight_memory_gb``.
        preflight_memory_gb: GiB the preflight's peak CPU RSS (GPU: allocated) may reach; None: all of it.
    """

    # TRL's names (num_generations, beta, ...) and close misspellings get a pointer to the setting
    # here instead of Python's bare TypeError (settings/trl_names.py).
    @pointing_at_settings
    def __init__(
        self,
        # -- the policy, its reward and tokenizer
        model: str | PreTrainedModel = "embedded",
        reward: RewardArgument | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        peft: LoraSettings | None = None,
        # -- sampling (SamplingSettings)
        group_size: int = 8,
        max_new_tokens: int = 512,
        temperature: float = 0.9,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: list[str] | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        # -- prompts (PromptSettings)
        max_prompt_length: int | None = None,
        prompt_truncation: Literal["left", "error"] = "left",
        use_chat_template: bool | None = None,
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        # -- the loss (grpo.LossSettings)
        loss_type: LossType = "grpo",
        clip_epsilon: float = 0.2,
        clip_epsilon_high: float | None = None,
        kl_beta: float = 0.01,
        importance_sampling_level: ImportanceSampling = "token",
        kl_estimator: KLEstimator = "k3",
        clip_ratio_c: float | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        entropy_coef: float = 0.0,
        kl_in_reward: bool = False,
        # -- advantages (AdvantageSettings)
        advantage_scale: AdvantageScale = "group",
        advantage_estimator: AdvantageEstimator = "grpo",
        mask_truncated_completions: bool = False,
        # -- off-policy passes and corrections (OffPolicySettings)
        num_iterations: int = 1,
        steps_per_generation: int = 1,
        use_engine_logprobs: bool = False,
        behav_imp_weight_cap: float | None = 5.0,
        rollout_correction: Literal["mask", "truncate"] | None = None,
        rollout_correction_level: Literal["token", "sequence"] = "token",
        rollout_correction_cap: float | None = 3.0,
        # -- the optimizer (OptimizerSettings)
        learning_rate: float = 5e-6,
        weight_decay: float = 0.0,
        gradient_accumulation_steps: int = 4,
        max_grad_norm: float | None = 1.0,
        warmup_steps: int = 0,
        lr_schedule: Literal["cosine", "linear", "constant"] = "cosine",
        max_consecutive_bad_steps: int = 3,
        # -- dynamic sampling (DynamicSamplingSettings)
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        # -- the engine and the rollout worker (EngineSettings)
        generation_backend: Literal["hf", "vllm"] = "hf",
        vllm_gpu_memory_utilization: float = 0.3,
        rollout_precision: Literal["int8", "bf16"] | None = None,
        rollout_mode: Literal["sync", "async"] = "sync",
        max_staleness: int = 1,
        rollout_worker_threads: int | None = None,
        rollout_device: str | None = None,
        rollout_memory_fraction: float | None = None,
        # -- memory (MemorySettings)
        train_micro_batch_size: int | None = None,
        train_micro_batch_tokens: int | None = None,
        prefix_sharing: bool = True,
        logprob_chunk_size: int | None = 8,
        lm_head_chunk_size: int | None = 256,
        gradient_checkpointing: bool = False,
        model_dtype: Literal["float32", "auto", "bfloat16", "float16"] = "float32",
        attn_implementation: str | None = None,
        max_generation_tokens: int = 2**20,
        # -- reward calls (RewardSettings)
        on_reward_error: Literal["raise", "zero"] = "raise",
        reward_timeout: float | None = None,
        # -- tools (ToolSettings)
        calculator: Literal["annotation", "plain"] | None = None,
        max_tool_calls: int = 4,
        tool_call_format: str = "hermes",
        tool_timeout: float | None = 10.0,
        max_tool_result_chars: int = 10_000,
        max_parallel_tool_calls: int = 16,
        agent: str | None = None,
        agent_timeout: float | None = 600.0,
        tools: ToolsArgument = None,
        environment_factory: EnvironmentArgument = None,
        # -- where rewards and tools run (SandboxSettings)
        sandbox: Literal["thread", "process"] = "thread",
        sandbox_memory_mb: int = 2048,
        sandbox_cpu_seconds: int = 60,
        sandbox_workers: int = 2,
        sandbox_env: list[str] | None = None,
        # -- validation (ValidationSettings)
        val_num_generations: int = 0,
        val_temperature: float = 1.0,
        val_top_p: float = 1.0,
        val_max_new_tokens: int | None = None,
        accuracy: Callable[..., Any] | None = None,
        answer_key: Callable[[str], Any] | None = extract_answer,
        # -- a worst-case first step (PreflightSettings)
        preflight: bool = False,
        preflight_memory_gb: float | None = None,
    ) -> None:
        super().__init__()
        # save_hyperparameters reads these arguments from this frame: stored as plain data.
        stored = stored_arguments(model, tokenizer, reward, peft)
        peft, reward = stored.peft, stored.reward
        self.tools = stored_tools(tools, environment_factory)
        tools, environment_factory = self.tools.tools, self.tools.environment_factory
        self.save_hyperparameters(ignore=["tokenizer", "accuracy", "answer_key", *stored.unstored])
        validate_hparams(self.hparams)
        self.automatic_optimization = False
        self.model_spec = model if isinstance(model, str) else None
        self.model: PreTrainedModel | None = None if isinstance(model, str) else model
        self.tokenizer = ensure_pad_token(tokenizer) if tokenizer is not None else None
        self._use_chat_template = use_chat_template
        # The flat hyperparameters as typed settings groups, and what is built from them, once: the
        # rollout source (where and when rollouts are sampled), the plan (what each batch trains,
        # when the optimizer steps), the step, the evaluator, the reporter (what loggers get).
        self.settings = GRPOSettings.from_hparams(self.hparams)
        parts = build_components(self.settings, stored, self.tools, accuracy, answer_key)
        self.reward, self.accuracy = parts.reward, parts.accuracy
        self.step, self.evaluator = parts.step, parts.evaluator
        self.sampling, self.greedy, self.scorer = parts.sampling, parts.greedy, parts.scorer
        self.rollout_source, self.plan, self.reporter = parts.rollout_source, parts.plan, parts.reporter
        # Submodules, so that their running means move to the policy's device with the module.
        self.train_metrics, self.val_metrics = parts.train_metrics, parts.val_metrics
        self.sandbox = parts.sandbox  # where rewards and tools run: None (threads) or workers
        self.reference: ReferenceSource | None = None  # handed over by the ReferenceModel callback
        self.last_step: StepRecord | None = None
        # The StepRecords of the optimizer steps the latest training batch took (an async batch at
        # the end of the fit trains every rollout still in flight); last_step is the last of them.
        self.batch_records: list[StepRecord] = []
        self._random_state = TrainingRandomState()  # put back after each validation of a fit
        self._log_step = EvaluationLogStep()  # the step validate's metrics reach the loggers at
        self._checkpoint_step: int | None = None  # the global_step of a checkpoint loaded outside fit
        self._preemption = Preemption()
        self._rewards_checked = self._stepped = False
        # Factors a callback set midway (CollapseGuard), on the loss settings the hparams give.
        self._adjustments, self._given_loss = Adjustments(), self.settings.loss

    @override
    def configure_model(self) -> None:
        precision = None if self._trainer is None else str(self.trainer.precision)
        spec, mesh, peft = self.model_spec, self.device_mesh, self.hparams.peft
        self.model, self.tokenizer = policy(
            self.model, self.tokenizer, spec, mesh, precision, self.settings, peft
        )
        prepare_rollouts(
            self.rollout_source, self.tokenizer, self.model, self.settings, self.tools,
            self.use_chat_template, self.scorer.temperature, self.sandbox, self.reward,
        )  # fmt: skip

    # The rollout source owns the engine and the episode runner (built in configure_model); one
    # set before the fit (a custom engine, a wrapped sampler) is the one it uses.
    @property
    def generator(self) -> GenerationBackend | None:
        """The engine that samples the rollouts (the async worker under ``rollout_mode: async``)."""
        return self.rollout_source.engine

    @generator.setter
    def generator(self, engine: GenerationBackend | None) -> None:
        self.rollout_source.engine = engine

    @property
    def sampler(self) -> RolloutSampler | ToolRolloutSampler | None:
        """The episode runner training, validation and prediction sample with."""
        return self.rollout_source.runner

    @sampler.setter
    def sampler(self, runner: RolloutSampler | ToolRolloutSampler | None) -> None:
        self.rollout_source.runner = runner

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits of the policy, ``(B, T, V)``."""
        if self.model is None:
            raise RuntimeError(
                f"the model {self.model_spec!r} is not loaded yet: call configure_model() first "
                "(trainer.fit, validate and predict do)"
            )
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Train on the rollouts the source gives for this batch: the batch's own, sampled now
        (sync), or those due from the worker (async; none while the pipeline fills)."""
        prompts, batch_kwargs = split_batch(batch)
        if not self._rewards_checked:  # before the first generation, so a mismatch costs nothing
            require_arguments(self.reward, reward_arguments(batch_kwargs, self._with_tools))
            self._rewards_checked = True
        self._stepped, self.batch_records = False, []
        context, batch = step_context(self), TrainingBatch(prompts, batch_kwargs, batch_idx)
        for item in self.rollout_source.rollouts(batch, context, self.model):
            record, stepped = self.step.train(
                item, self.model, self.reference, self.optimizers(), self.lr_schedulers(), context
            )
            self._stepped = self._stepped or stepped
            publish_step(self, record)
            self.last_step = record
            self.batch_records.append(record)

    @property
    def stepped(self) -> bool:
        """Whether the latest training batch ended an optimizer step (checkpoints wait for one)."""
        return self._stepped

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps a training batch takes when it steps (S x mu), so the step cadences a
        callback can keep are its multiples (HFCheckpoint's default rounds to one)."""
        return self.plan.settings.steps_per_batch

    def report_every(self, steps: int) -> None:
        """Report to the loggers every ``steps`` optimizer steps (a RewardLogger hands over its
        ``logging_steps``, so that its JSONL and every logger agree); else ``log_every_n_steps``."""
        self.reporter.every = steps

    @property
    def loss_settings(self) -> LossSettings:
        """The loss's settings (``self.settings.loss``; the module's attribute before the groups)."""
        return self.settings.loss

    @property
    def needs_reference(self) -> bool:
        return self.settings.loss.needs_reference

    @property
    def adjustments(self) -> Adjustments:
        """The factors on the learning rate and the KL weight set midway (all 1 until ``adjust``)."""
        return self._adjustments

    def adjust(self, lr_scale: float, kl_beta_scale: float) -> Adjustments:
        """Scale the learning rate (the optimizer's rates and its schedule's peak) and the KL weight
        by these factors for the rest of the run (a CollapseGuard after a rollback). The
        hyperparameters stay as given; the factors are kept in checkpoints (``forge_adjustments``),
        so a resumed fit trains on with them. Returns the adjustments now in force."""
        scheduler = self.lr_schedulers()
        if scheduler is not None and lr_scale != 1.0:
            scale_learning_rate(scheduler, lr_scale)
        self._use_adjustments(self._adjustments.then(lr_scale, kl_beta_scale))
        return self._adjustments

    def weights_restored(self) -> None:
        """The policy's weights were put back outside a step: the rollout engine samples with them."""
        self.rollout_source.weights_updated(self.model)

    def _use_adjustments(self, adjustments: Adjustments) -> None:
        self._adjustments = adjustments
        self.settings = replace(self.settings, loss=adjustments.loss(self._given_loss))
        self.step.loss_passes.loss = self.settings.loss  # what the loss passes read at each step

    def use_reference(self, source: ReferenceSource) -> None:
        """Take the frozen reference from ``source`` (the ReferenceModel callback calls this)."""
        self.reference = source

    @property
    def use_chat_template(self) -> bool:
        if self._use_chat_template is not None:
            return self._use_chat_template
        return bool(getattr(self.tokenizer, "chat_template", None))

    @override
    def on_fit_start(self) -> None:
        fit = fit_shape(self.trainer)
        self.plan.check_fit(fit)
        check_generation_budget(self.settings, *batch_sizes(fit))  # before any step
        self.rollout_source.on_fit_start(fit, self.model, sharded=self.device_mesh is not None)
        self._share_policy_context()
        self._random_state.save(self.device)  # the sanity check's validation leaves it as it was

    @override
    def on_train_start(self) -> None:
        # A resumed run's optimizer and schedule come back with the checkpoint's learning rate;
        # a new --model.learning_rate takes effect from here on (and on_load_checkpoint said so),
        # times the factor a CollapseGuard set, which the checkpoint's schedule already has.
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            total = self.plan.total_steps(fit_shape(self.trainer))
            peak = self.settings.optimizer.learning_rate * self._adjustments.lr_scale
            rescale_schedule(scheduler, peak, total)
        self.reporter.window = []
        self._checkpoint_step = None  # the trainer's global_step counts these weights' steps now
        if self.settings.preflight.enabled:  # here, where the training loader is known
            self._preflight()

    def _preflight(self) -> None:
        """The worst-case first step (training/preflight.py): stop now if it does not fit."""
        s, context = self.settings, step_context(self)
        prompts = batch_sizes(fit_shape(self.trainer))[0] or 1
        setting = s.prompts.max_prompt_length
        longest = longest_prompt(setting, None if setting is not None else self._data_longest_prompt())
        case = WorstCase(longest, s.sampling.max_new_tokens, prompts, s.sampling.group_size)
        worker = self.rollout_source.runs_a_worker  # its memory is the worker process's
        engine = None if worker else Engine(self.generator, self.sampling, s.engine.generation_backend)
        token = filler_token(self.model.config.vocab_size, self.tokenizer.all_special_ids)
        limit = memory_limit(s.preflight.preflight_memory_gb, self.device)
        state = optimizer_state_bytes(self.model, self.optimizers().state)
        passes = self.step.loss_passes
        with self.trainer.precision_plugin.train_step_context():  # autocast, as in training_step
            report = run_preflight(self.model, passes, engine, case, token, context, limit, state)
        check_preflight(report, case, s.memory.gradient_checkpointing, context)
        rank_zero_info(report.summary())

    def _data_longest_prompt(self) -> int | None:
        """The training data's longest prompt in tokens, as the sampler encodes it (cut at the
        model's context less max_new_tokens); None where the data cannot be read ahead."""
        prompts = training_prompts(self.trainer.train_dataloader)
        if prompts is None or not isinstance(self.sampler, RolloutSampler):
            return None
        return data_longest_prompt(prompts, lambda chunk: self.sampler.encode(chunk, torch.device("cpu"))[1])

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._preemption.at_batch_end(self.trainer, self._stepped)
        self._random_state.save(self.device)  # as training leaves it, should a validation follow

    @override
    def teardown(self, stage: str) -> None:
        self.stop_rollout_worker()
        if self.sandbox is not None:
            self.sandbox.close()  # a later fit starts new workers
        self._random_state.clear()
        self.reporter.every = None  # the next fit's RewardLogger, if any, hands its own

    def stop_rollout_worker(self) -> None:
        """Stop the asynchronous rollout worker, if one runs, and give the trainer its threads back."""
        self.rollout_source.close()

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        prompts, batch_kwargs = split_batch(batch)
        seed = sampling_seed(run_seed(), self.global_step, batch_idx, self.global_rank)
        extras = RewardExtras(self.trainer.global_step, self.trainer.current_epoch, self.trainer.max_steps)
        self.evaluator.batch(
            self.sampler, self.model, prompts, batch_kwargs, seed, extras, self._with_tools, batch_idx == 0
        )

    @property
    def validation_samples(self) -> list[dict[str, Any]]:
        """This rank's validation answers since the epoch began (RewardLogger writes them)."""
        return self.evaluator.samples

    @override
    def on_validation_epoch_start(self) -> None:
        self.evaluator.start(owned_samples(self.trainer.val_dataloaders, self.trainer.world_size))

    @override
    def on_validation_start(self) -> None:
        # The loaders are known now.
        check_generation_budget(self.settings, *batch_sizes(fit_shape(self.trainer)))
        self._share_policy_context()  # validate without fit: a reward model moves to the policy's device

    def _share_policy_context(self) -> None:
        context = PolicyContext(self.device, self.hparams.system_prompt)
        share_policy_context(self.reward, context)
        share_policy_context(self.accuracy, context)

    @override
    def on_validation_end(self) -> None:
        if self._fitting:
            self._random_state.restore()
        self._log_step.restore(self.trainer)

    @override
    def on_validation_epoch_end(self) -> None:
        values, step = self.evaluator.values(), self.evaluated_step or 0
        publish_validation(self, values, self._fitting, self._log_step, step)

    @property
    def evaluated_step(self) -> int | None:
        """The optimizer step of the weights validated: the trainer's in a fit, else a loaded
        checkpoint's (Lightning restores no global_step outside fit); None if unknown (a model spec)."""
        fitting = self._fitting
        if not fitting and self._checkpoint_step is not None:
            return self._checkpoint_step
        return self.global_step if fitting or self.global_step > 0 else None

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        """The greedy completion of each of the batch's prompts (``trainer.predict`` returns a
        list of these lists, one per batch)."""
        prompts, rows = split_batch(batch)
        return self.sampler(self.model, prompts, self.greedy, group_size=1, rows=rows).completions

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        raise NotImplementedError(NO_TEST_STEP)

    @override
    def setup(self, stage: str) -> None:
        if stage == "test":  # before Lightning asks the data for a test_dataloader
            raise NotImplementedError(NO_TEST_STEP)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        total, sharded = self.plan.total_steps(fit_shape(self.trainer)), self.device_mesh is not None
        return optimizer_config(self.model, self.settings.optimizer, total, self.trainer.precision, sharded)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> GRPOLightningModule:
        """Lightning's ``load_from_checkpoint``, refusing to stand the default model or reward in for
        one the checkpoint could not store (an object): pass ``model=``/``tokenizer=``/``reward=``."""
        refuse_unstored_objects(checkpoint_path, kwargs)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_run_state(checkpoint, fit_shape(self.trainer), self.reporter, self.rollout_source, self.reward)
        checkpoint[CHECKPOINT_KEY] = self._adjustments.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_step = checkpoint.get("global_step")
        # Resuming a fit checks and restores the run; validate or load_from_checkpoint may use other settings.
        resumed = fit_shape(self.trainer) if self._fitting else None
        load_run_state(checkpoint, resumed, self.hparams, self.reporter, self.rollout_source, self.reward)
        if resumed is not None:  # a resumed fit trains on with the changes made midway
            self._use_adjustments(Adjustments.from_state(checkpoint.get(CHECKPOINT_KEY)))

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        return fit_callbacks(self._trainer, self.needs_reference, self.rollout_source.runs_a_worker)

    @property
    def _with_tools(self) -> bool:
        """Whether rollouts call tools (the rewards then get tool_calls, completions, environments)."""
        return isinstance(self.sampler, ToolRolloutSampler | AgentRunner)

    @property
    def _fitting(self) -> bool:
        return self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING
