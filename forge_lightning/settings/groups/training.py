"""The groups of what grpo/ and training/ read: the loss, the advantages, training off-policy, the
optimizer, dynamic sampling, what a step holds in memory, and the preflight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from forge_lightning._moved import renamed
from forge_lightning.grpo import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    AdvantageEstimator,
    AdvantageScale,
    ImportanceSampling,
    KLEstimator,
    LossSettings,
    LossType,
)
from forge_lightning.settings.declare import (
    POSITIVE,
    Group,
    OldName,
    count,
    maybe_count,
    one_of,
    optional,
    setting,
)
from forge_lightning.training.optim import LR_SCHEDULES

MODEL_DTYPES = ("float32", "auto", "bfloat16", "float16")
_LOSS = LossSettings()  # the loss's defaults, which grpo.LossSettings declares


@dataclass(frozen=True)
class LossGroup(Group):
    """The loss's settings as the module takes them. ``settings.loss`` is the grpo.LossSettings
    built from them (:func:`loss_settings`), which checks their ranges and says each in full."""

    loss_type: LossType = setting(_LOSS.loss_type, card=True)
    """``grpo``, ``dapo``, ``dr_grpo``, ``forge``, ``cispo`` or ``sapo`` (see grpo.LossSettings)."""
    clip_epsilon: float = setting(_LOSS.clip_epsilon)
    """the ratio's clip range, in (0, 1) (see grpo.LossSettings)."""
    clip_epsilon_high: float | None = setting(_LOSS.clip_epsilon_high)
    """a separate upper clip range (DAPO's clip-higher); None: ``clip_epsilon``."""
    kl_beta: float = setting(_LOSS.kl_beta, card=True)
    """weight of the KL penalty toward the reference; 0 needs no reference."""
    importance_sampling_level: ImportanceSampling = setting(_LOSS.importance_sampling_level)
    """``token`` ratios, or one per completion (``sequence``, GSPO)."""
    kl_estimator: KLEstimator = setting(_LOSS.kl_estimator)
    """``k1``, ``k2`` or ``k3`` (grpo.LossSettings gives each one's gradient)."""
    clip_ratio_c: float | None = setting(_LOSS.clip_ratio_c)
    """dual clip's cap on a term with A < 0, in units of -A (> 1); None: off."""
    sapo_temperature_pos: float = setting(_LOSS.sapo_temperature_pos)
    """``sapo``'s gate temperature where A > 0."""
    sapo_temperature_neg: float = setting(_LOSS.sapo_temperature_neg)
    """``sapo``'s gate temperature where A < 0."""
    entropy_coef: float = setting(_LOSS.entropy_coef)
    """weight of the entropy bonus taken off the loss; 0: none."""
    kl_in_reward: bool = setting(_LOSS.kl_in_reward)
    """the KL penalty's weight x the KL taken off each reward, not added to the loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        LossSettings(**{item.name: getattr(self, item.name) for item in fields(self)})


@dataclass(frozen=True)
class AdvantageSettings(Group):
    """How rewards become advantages, and which completions carry them."""

    advantage_scale: AdvantageScale = setting(
        "group", check=(lambda v: v in ADVANTAGE_SCALES, f"one of {ADVANTAGE_SCALES}")
    )
    """divide centred rewards by the group's std, the batch's, or nothing."""
    advantage_estimator: AdvantageEstimator = setting(
        "grpo", check=(lambda v: v in ADVANTAGE_ESTIMATORS, f"one of {ADVANTAGE_ESTIMATORS}")
    )
    """the baseline each reward is measured against: ``grpo`` its group's mean; ``rloo`` the mean
    of the other G - 1 of its group (RLOO; then ``advantage_scale`` as for grpo, RLOO's own is
    ``none``); ``reinforce_pp`` (REINFORCE++-baseline) its group's mean, then divided by the std of
    the centred rewards over the whole generation batch (every rank's, all its micro-batches and
    ``steps_per_generation`` shares; not later accumulation batches, sampled after it), so it
    needs ``advantage_scale: none``. Unlike ``advantage_scale: batch`` (the std of the raw rewards,
    spread between prompts included) its std is of the within-group spread alone (grpo.advantages)."""
    mask_truncated_completions: bool = setting(False, card=True)
    """a completion cut off at ``max_new_tokens`` (no EOS) gets no policy or KL weight, and is left
    out of the loss's normaliser; it still counts in its group's reward statistics (as in TRL and
    DAPO)."""


@dataclass(frozen=True)
class OffPolicySettings(Group):
    """Training on a rollout more than once, or on one sampled by other weights or another engine."""

    num_iterations: int = setting(1, check=count(1), card=True)
    """optimizer passes over each rollout (mu); above 1 needs accumulation 1."""
    steps_per_generation: int = setting(1, check=count(1))
    """optimizer steps each batch's generation feeds (S). With S > 1 the batch (give the data S x
    the prompts of a step) is sampled once and split, by whole groups in prompt order, into S
    steps of ``gradient_accumulation_steps`` shares each; the old-policy log-probs are the
    sampling weights', fixed once (``num_iterations`` repeats the S steps). Checkpoints fall
    between generations; step cadences (``max_steps``, ``every_n_train_steps``, ``save_steps``)
    must be multiples of S x mu."""
    use_engine_logprobs: bool = setting(False)
    """the old policy's log-probs from the engine's scores, not a forward. The engine (vLLM, or HF
    generate) is trusted: needs top_p 1, top_k 0 and a loss at the sampling temperature. Else see
    ``rollout_correction``."""
    rollout_correction: Literal["mask", "truncate"] | None = setting(
        None, check=(optional(lambda v: v in ("mask", "truncate")), "None, 'mask' or 'truncate'")
    )
    """``mask`` (MIS) or ``truncate`` (TIS) by the sampler's log-probs; None: off. It corrects the
    loss for the sampler's log-probs differing from the trainer's (vLLM's kernels, top-p/top-k
    cuts, async rollouts): the engine's scores come with the rollout and weigh each token
    (``token``) or completion (``sequence``) by ``w`` (the formula: grpo.grpo_loss), ``mask``
    dropping those above the cap, ``truncate`` capping them. Logs ``train/sampler_kl``,
    ``train/correction_weight_mean`` and ``train/correction_masked_fraction``."""
    rollout_correction_level: Literal["token", "sequence"] = setting(
        "token", check=one_of("token", "sequence")
    )
    """``token``, or ``sequence``: one weight per completion, from the mean log-ratio over its model
    tokens."""
    rollout_correction_cap: float | Literal["auto"] | None = setting(
        "auto", check=(optional(lambda v: v == "auto" or v > 1), "'auto', None or > 1")
    )
    """the cap of the correction weight ``w`` (> 1; None: no cap). ``auto``: the mode's, TRL's 3
    with ``rollout_correction`` set; without, AReaL's 5 for async rollouts' default correction
    (a rollout sampled by older weights weighs each token by ``exp(old_logp - behav_logp)``,
    masked above the cap)."""

    old_names = (
        OldName(
            "behav_imp_weight_cap",
            "rollout_correction_cap",
            old_defaults=(("behav_imp_weight_cap", 5.0), ("rollout_correction_cap", 3.0)),
        ),
    )


@dataclass(frozen=True)
class OptimizerSettings(Group):
    """AdamW, its schedule, and the gradient it steps on."""

    learning_rate: float = setting(5e-6, check=POSITIVE, resume=True, card=True)
    """AdamW's peak learning rate."""
    weight_decay: float = setting(0.0, check=(lambda v: v >= 0, ">= 0"))
    """AdamW's weight decay."""
    gradient_accumulation_steps: int = setting(4, check=count(1), card=True)
    """batches per optimizer step."""
    max_grad_norm: float | None = setting(1.0, check=(optional(lambda v: v > 0), "None or > 0"))
    """clip the gradient's total norm to this before each step; None disables."""
    warmup_steps: int = setting(0, check=count(0))
    """optimizer steps of linear warmup."""
    lr_schedule: Literal["cosine", "linear", "constant"] = setting(
        "cosine", check=(lambda v: v in LR_SCHEDULES, f"one of {LR_SCHEDULES}"), resume=True
    )
    """``cosine`` to zero at the last step (Forge's), ``linear`` to zero (TRL's), or ``constant``
    after the warmup."""
    max_consecutive_bad_steps: int = setting(3, check=count(1), resume=True)
    """non-finite gradients skip the step; this many in a row stop."""


@dataclass(frozen=True)
class DynamicSamplingSettings(Group):
    """DAPO's dynamic sampling (training/dynamic_sampling.py)."""

    enabled: bool = setting(False, name="dynamic_sampling", card=True)
    """train on informative groups only, sampling rounds until a step has
    enough (DAPO; see training/dynamic_sampling.py); ``gradient_accumulation_steps`` then counts
    informative prompts. Needs ``trainer.max_steps`` and ``num_iterations`` 1."""
    max_sampling_rounds: int = setting(4, check=count(1))
    """with dynamic sampling, the rounds after which a step trains on what it has."""


@dataclass(frozen=True)
class MemorySettings(Group):
    """What a step holds in memory: micro-batches, shared prefixes, chunks, dtypes, the generation budget."""

    train_micro_batch_size: int | None = setting(None, check=maybe_count(1), resume=True)
    """completions per forward/backward (None: all); same gradient, less memory. With
    ``prefix_sharing`` a micro-batch of whole groups, or of part of one group, runs each prompt
    once (a group of 16 in micro-batches of 8: twice)."""
    train_micro_batch_tokens: int | None = setting(None, check=maybe_count(1))
    """the most tokens per forward/backward of the loss, padding included (None: by
    ``train_micro_batch_size``). The completions, longest first, are packed into balanced
    micro-batches under it, with prefix sharing as whole groups, single rows, or each group cut into
    runs of like lengths that run its prompt once, whichever runs fewer tokens
    (rollout/micro_batches.py), each of at most ``train_micro_batch_size`` rows when that is set.
    Same gradient, fewer padded tokens (``perf/padding_fraction``)."""
    prefix_sharing: bool = setting(True, resume=True)
    """each prompt's forward once per group, its keys/values shared by the G completions."""
    logprob_chunk_size: int | None = setting(8, check=maybe_count(1), resume=True)
    """rows per chunk of the float32 log-softmax; None for no chunks. Where
    ``lm_head_chunk_size`` applies, its chunks are the log-softmax's."""
    lm_head_chunk_size: int | None = setting(256, check=maybe_count(1))
    """positions per chunk through the LM head (None: all at once). The log-probs and entropies
    are taken from the decoder's hidden states a chunk at a time, so one chunk's (positions,
    vocab) logits exist at a time, the training backward rebuilding each
    (grpo/linear_log_probs.py); same values and gradients. Models whose logits are not a bias-free
    linear head on the last hidden state, a head with an adapter and FSDP-sharded models take
    their own forward (models/lm_head.py)."""
    gradient_checkpointing: bool = setting(False, resume=True)
    """trade compute for activation memory in the training forward."""
    model_dtype: Literal["float32", "auto", "bfloat16", "float16"] = setting(
        "float32", check=(lambda v: v in MODEL_DTYPES, f"one of {MODEL_DTYPES}")
    )
    """the dtype a model spec is loaded in. ``float32`` (the default) keeps the weights and the
    AdamW state in full precision under ``bf16-mixed``/``16-mixed`` (autocast computes in half
    precision), also when the checkpoint is stored in bf16, as most of the hub is; ``auto`` keeps
    the checkpoint's dtype; ``bfloat16`` / ``float16`` train half-precision weights, which a small
    learning rate barely moves (a warning says so)."""
    attn_implementation: str | None = setting(None, resume=True)
    """``sdpa``, ``eager``, ``flash_attention_2``, ...; None: transformers' choice."""
    max_generation_tokens: int = setting(2**20, check=count(1), resume=True)
    """the most tokens one batch's generation may hold, counted as its rows x
    (the longest prompt the settings allow, 0 when unset, + new tokens): a training batch (prompts per step x
    the group's rows) or a sampled validation batch (``val_batch_size`` x its samples per prompt
    rows) over it is refused before any step (check_generation_budget)."""


@dataclass(frozen=True)
class PreflightSettings(Group):
    """A worst-case first step before training (training/preflight.py)."""

    enabled: bool = setting(False, name="preflight", resume=True)
    """before the first step, generate and train the worst case once (the longest
    prompt, ``max_new_tokens`` for every completion, the batch's P x G rows, one full
    micro-batch) and stop with sized suggestions where its peak memory, with AdamW's state to
    come, is over ``preflight_memory_gb``. No optimizer step: the weights, gradients and RNG
    streams are left as they were, so the run takes the same steps as without. The longest prompt
    is the one the prompt settings allow, else the training data's longest (read ahead, tokenised)."""
    preflight_memory_gb: float | None = setting(
        None, check=(optional(lambda v: v > 0), "None or > 0 (GiB)"), resume=True
    )
    """the preflight's limit in GiB: the peak CPU RSS of the process (the GPU's allocated memory
    on a GPU); None: the machine's memory (the GPU's)."""


# The loss's settings, passed to grpo.LossSettings (which checks them) under the same names.
LOSS_FIELDS = tuple(item.name for item in fields(LossGroup))
# What rollout_correction_cap 'auto' stands for: AReaL's cap for async rollouts' default
# correction (masked, token level, only for a rollout sampled by older weights), until a rollout
# correction is named; then TRL's.
ASYNC_CAP, CORRECTION_CAP = 5.0, 3.0
_OFF_POLICY = OffPolicySettings()


__getattr__ = renamed(__name__, {"DEFAULT_BEHAV_IMP_WEIGHT_CAP": "ASYNC_CAP"})  # its name before the one cap


def loss_settings(values: Mapping[str, Any]) -> LossSettings:
    """The loss settings among ``values`` (the longest completion is dr_grpo's constant). With a
    rollout correction set, its mode, level and cap make the correction weight; else the async
    worker's default correction (masked, token level) at the cap."""
    chosen = {name: values[name] for name in LOSS_FIELDS if name in values}
    named = values.get("rollout_correction") is not None
    cap = values.get("rollout_correction_cap", _OFF_POLICY.rollout_correction_cap)
    chosen["behav_imp_weight_cap"] = (CORRECTION_CAP if named else ASYNC_CAP) if cap == "auto" else cap
    if named:
        chosen["rollout_correction"] = values["rollout_correction"]
        chosen["rollout_correction_level"] = values.get(
            "rollout_correction_level", _OFF_POLICY.rollout_correction_level
        )
    return LossSettings(**chosen, max_completion_length=values.get("max_new_tokens"))
