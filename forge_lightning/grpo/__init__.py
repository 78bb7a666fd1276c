"""GRPO math as free functions of tensors: advantages, per-token log-probs, masked means, losses.

Nothing here knows about models, tokenizers or Lightning, so every formula can be checked on small
tensors written by hand. Shapes use B for the batch of completions, T for completion length, V for
the vocabulary and G for the group size.
"""

from forge_lightning.grpo.advantages import (
    ADVANTAGE_SCALES,
    AdvantageScale,
    group_advantages,
    informative_groups,
)
from forge_lightning.grpo.core import masked_mean, token_log_probs, token_log_probs_and_entropy
from forge_lightning.grpo.losses import (
    LOSS_TYPES,
    ImportanceSampling,
    KLEstimator,
    LossSettings,
    LossType,
    RolloutCorrection,
    backward_weight,
    grpo_loss,
    loss_normalizer,
    micro_batch_weight,
    step_count,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "LOSS_TYPES",
    "AdvantageScale",
    "ImportanceSampling",
    "KLEstimator",
    "LossSettings",
    "LossType",
    "RolloutCorrection",
    "backward_weight",
    "group_advantages",
    "grpo_loss",
    "informative_groups",
    "loss_normalizer",
    "masked_mean",
    "micro_batch_weight",
    "step_count",
    "token_log_probs",
    "token_log_probs_and_entropy",
]
