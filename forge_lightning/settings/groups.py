"""The module's settings as typed groups: :class:`GRPOSettings`, built once from the flat
hyperparameters (``--model.<name>``, a config's ``model:`` keys, a checkpoint's ``hparams``).

Each group is a frozen dataclass whose fields carry the module's names (``dynamic_sampling`` is
:attr:`DynamicSamplingSettings.enabled`), defaults and help, and whose ``__post_init__`` checks
the ranges of its own fields by the rules of settings/checks.py (``RULES``, the same messages).
The checks across fields and groups stay in :func:`~forge_lightning.settings.checks.validate_hparams`.
A collaborator takes its group, not the flat mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from forge_lightning.grpo import AdvantageEstimator, AdvantageScale, LossSettings
from forge_lightning.rollout.engines.weight_ring import check_rollout_device
from forge_lightning.settings.checks import RULES, check_setting, loss_settings


def setting_name(item: Any) -> str:
    """The module's name (``--model.<name>``) of a group's dataclass field."""
    return item.metadata.get("setting", item.name)


class _Group:
    """A settings group: its fields' ranges checked by ``RULES`` when it is made."""

    def __post_init__(self) -> None:
        for item in fields(self):
            name = setting_name(item)
            if name in RULES:
                check_setting(name, getattr(self, item.name))


@dataclass(frozen=True)
class SamplingSettings(_Group):
    """How training completions are sampled."""

    group_size: int = 8
    """completions per prompt (G), at least 2."""
    max_new_tokens: int = 512
    """longest completion, in tokens."""
    temperature: float = 0.9
    """sampling temperature; the loss scores at it too (``forge``: at 1)."""
    top_p: float = 1.0
    """nucleus sampling mass."""
    top_k: int = 0
    """sample among the k likeliest tokens; 0 disables it."""
    min_p: float = 0.0
    """drop tokens below this share of the likeliest one's probability; 0 disables it."""
    repetition_penalty: float = 1.0
    """HF's and vLLM's penalty on tokens already in the sequence; 1 disables it."""
    stop: list[str] | None = None
    """strings that end a completion (training and validation), the mask running through the
    token that completes the first; the reward's text ends with it."""
    generation_kwargs: dict[str, Any] | None = None
    """more settings for the engine, by its own names (``GenerationConfig`` fields for HF,
    ``vllm.SamplingParams`` for vLLM); keys the module sets itself and unknown ones are refused by
    name (rollout/engines/generation_settings.py)."""


@dataclass(frozen=True)
class PromptSettings(_Group):
    """How prompts are encoded."""

    max_prompt_length: int | None = None
    """longer prompts are cut from the left, or refused (``prompt_truncation``); None: the model's
    context length less ``max_new_tokens``."""
    prompt_truncation: Literal["left", "error"] = "left"
    """``left`` (with a warning) or ``error``."""
    use_chat_template: bool | None = None
    """prompts through the tokenizer's chat template; None: when it has one."""
    system_prompt: str | None = None
    """system message for the chat template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """more variables for the chat template (Qwen3's ``enable_thinking``, Llama 3.1's
    ``tools_in_user_message``), passed to every rendering of prompts (training and validation) and
    tool turns; the names the rollouts set themselves (``tools``, ``add_generation_prompt``) are
    refused."""


@dataclass(frozen=True)
class AdvantageSettings(_Group):
    """How rewards become advantages, and which completions carry them."""

    advantage_scale: AdvantageScale = "group"
    """divide centred rewards by the group's std, the batch's, or nothing."""
    advantage_estimator: AdvantageEstimator = "grpo"
    """the baseline each reward is measured against: ``grpo`` its group's mean; ``rloo`` the mean
    of the other G - 1 of its group (RLOO; then ``advantage_scale`` as for grpo, RLOO's own is
    ``none``); ``reinforce_pp`` (REINFORCE++-baseline) its group's mean, then divided by the std of
    the centred rewards over the whole generation batch (every rank's, all its micro-batches and
    ``steps_per_generation`` shares; not later accumulation batches, sampled after it), so it
    needs ``advantage_scale: none``. Unlike ``advantage_scale: batch`` (the std of the raw rewards,
    spread between prompts included) its std is of the within-group spread alone (grpo.advantages)."""
    mask_truncated_completions: bool = False
    """a completion cut off at ``max_new_tokens`` (no EOS) gets no policy or KL weight, and is left
    out of the loss's normaliser; it still counts in its group's reward statistics (as in TRL and
    DAPO)."""


@dataclass(frozen=True)
class OffPolicySettings(_Group):
    """Training on a rollout more than once, or on one sampled by other weights or another engine."""

    num_iterations: int = 1
    """optimizer passes over each rollout (mu); above 1 needs accumulation 1."""
    steps_per_generation: int = 1
    """optimizer steps each batch's generation feeds (S). With S > 1 the batch (give the data S x
    the prompts of a step) is sampled once and split, by whole groups in prompt order, into S
    steps of ``gradient_accumulation_steps`` shares each; the old-policy log-probs are the
    sampling weights', fixed once (``num_iterations`` repeats the S steps). Checkpoints fall
    between generations; step cadences (``max_steps``, ``every_n_train_steps``, ``save_steps``)
    must be multiples of S x mu."""
    use_engine_logprobs: bool = False
    """the old policy's log-probs from the engine's scores, not a forward. The engine (vLLM, or HF
    generate) is trusted: needs top_p 1, top_k 0 and a loss at the sampling temperature. Else see
    ``rollout_correction``."""
    behav_imp_weight_cap: float | None = 5.0
    """async: the cap of the default correction (> 1; None). Without ``rollout_correction``, a
    rollout sampled by older weights weighs each token by ``exp(old_logp - behav_logp)``, none
    above this."""
    rollout_correction: Literal["mask", "truncate"] | None = None
    """``mask`` (MIS) or ``truncate`` (TIS) by the sampler's log-probs; None: off. It corrects the
    loss for the sampler's log-probs differing from the trainer's (vLLM's kernels, top-p/top-k
    cuts, the async worker): the engine's scores come with the rollout and weigh each token
    (``token``) or completion (``sequence``) by ``w`` (the formula: grpo.grpo_loss), ``mask``
    dropping those above the cap, ``truncate`` capping them. Logs ``train/sampler_kl``,
    ``train/correction_weight_mean`` and ``train/correction_masked_fraction``."""
    rollout_correction_level: Literal["token", "sequence"] = "token"
    """``token``, or ``sequence``: one weight per completion, from the mean log-ratio over its model
    tokens."""
    rollout_correction_cap: float | None = 3.0
    """the cap of ``w`` (> 1; TRL's 3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        LossSettings(behav_imp_weight_cap=self.behav_imp_weight_cap)  # the loss's rule for its cap


@dataclass(frozen=True)
class OptimizerSettings(_Group):
    """AdamW, its schedule, and the gradient it steps on."""

    learning_rate: float = 5e-6
    """AdamW's peak learning rate."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    gradient_accumulation_steps: int = 4
    """batches per optimizer step."""
    max_grad_norm: float | None = 1.0
    """clip the gradient's total norm to this before each step; None disables."""
    warmup_steps: int = 0
    """optimizer steps of linear warmup."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """``cosine`` to zero at the last step (Forge's), ``linear`` to zero (TRL's), or ``constant``
    after the warmup."""
    max_consecutive_bad_steps: int = 3
    """non-finite gradients skip the step; this many in a row stop."""


@dataclass(frozen=True)
class DynamicSamplingSettings(_Group):
    """DAPO's dynamic sampling (training/dynamic_sampling.py)."""

    enabled: bool = field(default=False, metadata={"setting": "dynamic_sampling"})
    """``dynamic_sampling``: train on informative groups only, sampling rounds until a step has
    enough (DAPO; see training/dynamic_sampling.py); ``gradient_accumulation_steps`` then counts
    informative prompts. Needs ``trainer.max_steps`` and ``num_iterations`` 1."""
    max_sampling_rounds: int = 4
    """with dynamic sampling, the rounds after which a step trains on what it has."""


@dataclass(frozen=True)
class EngineSettings(_Group):
    """What samples the rollouts, and where: the generation engine and the async rollout worker."""

    generation_backend: Literal["hf", "vllm"] = "hf"
    """``hf`` (the policy's ``generate``) or ``vllm`` (GPU; see rollout/engines/vllm.py)."""
    vllm_gpu_memory_utilization: float = 0.3
    """the share of GPU memory the vLLM engine may take."""
    rollout_precision: Literal["int8", "bf16"] | None = None
    """sample with a copy of the policy in ``int8`` (torchao's weight-only) or ``bf16``, remade after
    every optimizer step (rollout/engines/quantized.py); needs ``rollout_correction``. None: the
    policy itself."""
    rollout_mode: Literal["sync", "async"] = "sync"
    """``sync``, or ``async``: a worker process samples while the trainer trains."""
    max_staleness: int = 1
    """async: optimizer steps a rollout may lag the weights it trains (k >= 0)."""
    rollout_worker_threads: int | None = None
    """async: the worker's CPU threads, the trainer the rest; None: half."""
    rollout_device: str | None = None
    """async: the worker's device (None: the CPU). ``cuda:N`` is another GPU, ``cuda`` the
    trainer's own (with ``rollout_memory_fraction``); the weights go device to device
    (rollout/engines/weight_ring.py)."""
    rollout_memory_fraction: float | None = None
    """async: the GPU memory share the worker may take."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rollout_device(self.rollout_device, self.rollout_memory_fraction)


@dataclass(frozen=True)
class MemorySettings(_Group):
    """What a step holds in memory: micro-batches, shared prefixes, chunks, dtypes, the generation budget."""

    train_micro_batch_size: int | None = None
    """completions per forward/backward (None: all); same gradient, less memory."""
    train_micro_batch_tokens: int | None = None
    """the most tokens per forward/backward of the loss, padding included (None: by
    ``train_micro_batch_size``). The completions, longest first, are packed into balanced
    micro-batches under it, with prefix sharing as whole groups or single rows, whichever runs
    fewer tokens (rollout/micro_batches.py), each of at most ``train_micro_batch_size`` rows when
    that is set. Same gradient, fewer padded tokens (``perf/padding_fraction``)."""
    prefix_sharing: bool = True
    """each prompt's forward once per group, its keys/values shared by the G completions."""
    logprob_chunk_size: int | None = 8
    """rows per chunk of the float32 log-softmax; None for no chunks. Where
    ``lm_head_chunk_size`` applies, its chunks are the log-softmax's."""
    lm_head_chunk_size: int | None = 256
    """positions per chunk through the LM head (None: all at once). The log-probs and entropies
    are taken from the decoder's hidden states a chunk at a time, so one chunk's (positions,
    vocab) logits exist at a time, the training backward rebuilding each
    (grpo/linear_log_probs.py); same values and gradients. Models whose logits are not a bias-free
    linear head on the last hidden state, a head with an adapter and FSDP-sharded models take
    their own forward (models/lm_head.py)."""
    gradient_checkpointing: bool = False
    """trade compute for activation memory in the training forward."""
    model_dtype: Literal["float32", "auto", "bfloat16", "float16"] = "float32"
    """the dtype a model spec is loaded in. ``float32`` (the default) keeps the weights and the
    AdamW state in full precision under ``bf16-mixed``/``16-mixed`` (autocast computes in half
    precision), also when the checkpoint is stored in bf16, as most of the hub is; ``auto`` keeps
    the checkpoint's dtype; ``bfloat16`` / ``float16`` train half-precision weights, which a small
    learning rate barely moves (a warning says so)."""
    attn_implementation: str | None = None
    """``sdpa``, ``eager``, ``flash_attention_2``, ...; None: transformers' choice."""
    max_generation_tokens: int = 2**20
    """the most tokens one batch's generation may hold, counted as its rows x
    (``max_prompt_length``, 0 when unset, + new tokens): a training batch (prompts per step x
    ``group_size`` rows) or a sampled validation batch (``val_batch_size`` x
    ``val_num_generations`` rows) over it is refused before any step (check_generation_budget)."""


@dataclass(frozen=True)
class RewardSettings(_Group):
    """How reward calls fail."""

    on_reward_error: Literal["raise", "zero"] = "raise"
    """``raise`` names the failing reward and sample; ``zero`` scores it 0 and counts it."""
    reward_timeout: float | None = None
    """seconds a reward call may take; a longer one is abandoned and its batch fails as under
    ``on_reward_error``; None waits for ever (under ``sandbox: process``, 60 s)."""


@dataclass(frozen=True)
class ToolSettings(_Group):
    """Tool calls in a completion (rollout/tool_sampler.py), or a user's agent (rollout/agents/);
    the module's ``tools`` and ``environment_factory`` name the functions, stored by import path."""

    calculator: Literal["annotation", "plain"] | None = None
    """completions may call an inline calculator, ``annotation`` (GSM8K's ``<<48/2=``) or ``plain``
    (``41 + 29 =``); its answers are read, not trained on (rollout/tool_sampler.py). None: no tool."""
    max_tool_calls: int = 4
    """with tools, the calls one completion may make."""
    tool_call_format: str = "hermes"
    """how a completion writes a call (tools/parsers.py's CALL_FORMATS): ``hermes``
    (``<tool_call>{json}</tool_call>``), ``llama3_json`` (Llama 3.1/3.2's JSON reply) or
    ``qwen3_coder`` (Qwen3-Coder's ``<function=...>`` XML)."""
    tool_timeout: float | None = 10.0
    """seconds a tool call may take before it is abandoned and answered with an error (an ``async
    def`` one too, even where it blocks its event loop); under ``sandbox: thread`` its thread runs
    on, counted in ``tool_threads_abandoned`` and warned about once per process."""
    max_tool_result_chars: int = 10_000
    """the characters of a tool's result the model reads; a longer one is cut before it is
    rendered, marked as cut and counted (``tool_results_cut``)."""
    max_parallel_tool_calls: int = 16
    """the tool calls that run at once: the calls of every row that waits for a tool, and every
    call of one turn, run concurrently up to this many (an ``async def`` tool is awaited, on an
    event loop no other call at once uses), each under ``tool_timeout``; the answers keep the order
    the calls were written."""
    agent: str | None = None
    """the import path of ``async def agent(client, row) -> float``, a user's agent written
    against the OpenAI SDK, run ``group_size`` times per prompt with a client of the policy's own
    endpoint (rollout/agents/): the policy's tokens of each episode are trained, the turns the agent
    inserts are masked. Its return value is the score, with no ``reward`` set (or one that holds
    EnvironmentReward); with another reward it returns None. An agent that raises fails its
    episode: counted (``agent_errors``), scored 0, nothing of it trained. Sync rollouts with HF
    generate only; not with the calculator, tools or environment_factory. None: no agent."""
    agent_timeout: float | None = 600.0
    """seconds an agent's episode may take; a longer one is cancelled and fails (counted in
    ``agent_errors``). None waits for ever."""


@dataclass(frozen=True)
class SandboxSettings(_Group):
    """Where rewards and tools run (run/sandbox.py)."""

    sandbox: Literal["thread", "process"] = "thread"
    """``thread``: in the trainer's process (a timeout abandons the call's thread, which runs on);
    ``process``: each call in a pool of sandboxed worker processes (no network and no sockets,
    reads only Python and the user's modules, writes only a scratch folder, none of the trainer's
    environment variables but ``sandbox_env``'s, as nobody under a root trainer, the limits
    below; what it returns crosses back as data, never unpickled), killed with everything it
    started past ``reward_timeout``/``tool_timeout`` (60 s where None); refused at the start where
    the machine cannot isolate. A RewardModel stays in the trainer's process. An
    ``environment_factory``'s environment lives in one worker's process for its whole episode
    (its tools and its score are called there; episodes share the workers)."""
    sandbox_memory_mb: int = 2048
    """``process``: the address space a call may add to its worker's, in MiB."""
    sandbox_cpu_seconds: int = 60
    """``process``: the CPU seconds of one call."""
    sandbox_workers: int = 2
    """``process``: worker processes, so calls that may run at once (an episode's among them)."""
    sandbox_env: list[str] | None = None
    """``process``: the names of the trainer's environment variables that cross into the workers
    (an API key a reward needs); no other variable does. A name that is not set does not cross."""


@dataclass(frozen=True)
class PreflightSettings(_Group):
    """A worst-case first step before training (training/preflight.py)."""

    enabled: bool = field(default=False, metadata={"setting": "preflight"})
    """``preflight``: before the first step, generate and train the worst case once (the longest
    prompt, ``max_new_tokens`` for every completion, the batch's P x G rows, one full
    micro-batch) and stop with sized suggestions where its peak memory, with AdamW's state to
    come, is over ``preflight_memory_gb``. No optimizer step: the weights, gradients and RNG
    streams are left as they were, so the run takes the same steps as without. The longest prompt
    is ``max_prompt_length``, else the training data's longest (read ahead, tokenised)."""
    preflight_memory_gb: float | None = None
    """the preflight's limit in GiB: the peak CPU RSS of the process (the GPU's allocated memory
    on a GPU); None: the machine's memory (the GPU's)."""


@dataclass(frozen=True)
class ValidationSettings(_Group):
    """The sampled completions of a validation, besides the greedy one (evaluation/sampled.py)."""

    val_num_generations: int = 0
    """completions sampled per validation prompt (n) for val/mean@n, pass@k and maj@k; 0: greedy
    only. With n, each validation also logs k = 1, 2, 4, ..., n,
    ``frac_all_correct``/``frac_none_correct`` and the samples' length and truncated share, and
    the answers file holds the samples (evaluation/sampled.py). They are drawn under their own
    seeded RNG: a fit trains the same with or without them. Under DDP/FSDP each prompt counts once
    (evaluation/ranks.py)."""
    val_temperature: float = 1.0
    """temperature of the sampled validation completions."""
    val_top_p: float = 1.0
    """nucleus mass of the sampled validation completions."""
    val_max_new_tokens: int | None = None
    """longest validation completion, greedy and sampled alike (and ``predict``'s); None:
    ``max_new_tokens``. A model trained on short completions can then be judged at a longer one."""

    def max_new_tokens(self, training: int) -> int:
        """The longest validation completion, given training's ``max_new_tokens``."""
        return self.val_max_new_tokens or training


# Every group but the loss's, by its attribute of GRPOSettings.
GROUPS: dict[str, type[_Group]] = {
    "sampling": SamplingSettings,
    "prompts": PromptSettings,
    "advantages": AdvantageSettings,
    "off_policy": OffPolicySettings,
    "optimizer": OptimizerSettings,
    "dynamic_sampling": DynamicSamplingSettings,
    "engine": EngineSettings,
    "memory": MemorySettings,
    "rewards": RewardSettings,
    "tools": ToolSettings,
    "sandbox": SandboxSettings,
    "validation": ValidationSettings,
    "preflight": PreflightSettings,
}

G = TypeVar("G", bound=_Group)


def picked(kind: type[G], values: Mapping[str, Any]) -> G:
    """The group ``kind`` of the flat settings ``values``; a setting they lack takes its default."""
    names = {item.name: setting_name(item) for item in fields(kind)}
    return kind(**{name: values[setting] for name, setting in names.items() if setting in values})


def flat_values(group: _Group) -> dict[str, Any]:
    """A group's settings by the module's names (``--model.<name>``)."""
    return {setting_name(item): getattr(group, item.name) for item in fields(group)}


@dataclass(frozen=True)
class GRPOSettings:
    """Every setting of GRPOLightningModule but the objects it is given (model, reward, tokenizer,
    LoRA, tools, accuracy and answer key), by group; build it with :meth:`from_hparams`."""

    sampling: SamplingSettings
    prompts: PromptSettings
    loss: LossSettings  # as settings/checks.loss_settings builds it, with the correction's cap
    advantages: AdvantageSettings
    off_policy: OffPolicySettings
    optimizer: OptimizerSettings
    dynamic_sampling: DynamicSamplingSettings
    engine: EngineSettings
    memory: MemorySettings
    rewards: RewardSettings
    tools: ToolSettings
    sandbox: SandboxSettings
    validation: ValidationSettings
    preflight: PreflightSettings

    @classmethod
    def from_hparams(cls, values: Mapping[str, Any]) -> GRPOSettings:
        """The groups of the module's flat hyperparameters ``values``. A key they lack (a
        checkpoint written before the setting existed) takes the group's default, which is the
        module's."""
        groups = {name: picked(kind, values) for name, kind in GROUPS.items()}
        every = {name: v for group in groups.values() for name, v in flat_values(group).items()}
        return cls(**groups, loss=loss_settings({**every, **values}))


def check_generation_budget(
    settings: GRPOSettings, train_prompts: int | None, val_prompts: int | None
) -> None:
    """Refuse a batch whose generation would hold more than ``max_generation_tokens`` tokens,
    counted as rows x (P + new tokens), ``P`` being ``max_prompt_length`` (0 when unset: completion
    tokens alone): a training batch of ``train_prompts`` x ``group_size`` rows and ``max_new_tokens``,
    and a sampled validation batch of ``val_prompts`` x ``val_num_generations`` rows and
    ``val_max_new_tokens``. A batch that passes can still be too big for a small machine; one that
    fails would allocate its KV cache and logits at once (a validation only after the first steps).
    A batch size not known yet (no datamodule, no loader) is not checked."""
    sampling, validation = settings.sampling, settings.validation
    prompt = settings.prompts.max_prompt_length or 0
    n, budget = validation.val_num_generations, settings.memory.max_generation_tokens
    batches = [
        ("data.prompts_per_step", train_prompts, "group_size", sampling.group_size, sampling.max_new_tokens),
        (
            "data.val_batch_size",
            val_prompts,
            "val_num_generations",
            n,
            validation.max_new_tokens(sampling.max_new_tokens),
        ),
    ]
    for prompts_name, prompts, rows_name, per_prompt, new in batches:
        tokens = (prompts or 0) * per_prompt * (prompt + new)
        if tokens > budget:
            raise ValueError(
                f"{rows_name}={per_prompt} x {prompts_name}={prompts} rows x ({prompt} prompt + {new} new "
                f"tokens) = {tokens:,} tokens in one batch's generation, over max_generation_tokens="
                f"{budget:,} (the rule: rows x (max_prompt_length, 0 when unset, + new tokens) <= "
                f"max_generation_tokens). Lower {rows_name} (at most {budget // (prompts * (prompt + new))} "
                f"here) or {prompts_name}, or raise max_generation_tokens if the machine holds it"
            )
