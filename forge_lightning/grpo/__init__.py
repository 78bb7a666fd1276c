"""GRPO math as free functions of tensors: advantages, per-token log-probs, masked means, losses.

Nothing here knows about models, tokenizers or Lightning, so every formula can be checked on small
tensors written by hand. Shapes use B for the batch of completions, T for completion length, V for
the vocabulary and G for the group size.
"""

from forge_lightning.grpo.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    AdvantageEstimator,
    AdvantageScale,
    group_advantages,
    informative_groups,
    needs_batch,
    scales_itself,
)
from forge_lightning.grpo.core import masked_mean, token_log_probs, token_log_probs_and_entropy
from forge_lightning.grpo.kl import KLEstimator, kl_penalised_rewards
from forge_lightning.grpo.losses import (
    LOSS_TYPES,
    ImportanceSampling,
    LossSettings,
    LossType,
    RolloutCorrection,
    backward_weight,
    entropy_bonus,
    grpo_loss,
    loss_normalizer,
    micro_batch_weight,
    step_count,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "LOSS_TYPES",
    "AdvantageEstimator",
    "AdvantageScale",
    "ImportanceSampling",
    "KLEstimator",
    "LossSettings",
    "LossType",
    "RolloutCorrection",
    "backward_weight",
    "entropy_bonus",
    "group_advantages",
    "grpo_loss",
    "informative_groups",
    "kl_penalised_rewards",
    "loss_normalizer",
    "masked_mean",
    "micro_batch_weight",
    "needs_batch",
    "scales_itself",
    "step_count",
    "token_log_probs",
    "token_log_probs_and_entropy",
]
