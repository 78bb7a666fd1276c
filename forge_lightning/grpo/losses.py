"""The clipped policy-gradient losses, one loss type each, and the settings they take.

A loss type is one entry of ``_KINDS``: its function (for the token-level ones, its policy
term: the ``surrogate``), the count it divides by (so that the share of a micro-batch or an
accumulation batch follows from it, see :func:`micro_batch_weight`), whether it needs the
reference without a KL term, and whether it scores completions at the sampling temperature.
Adding a loss type means its function, its entry here and its name in ``LossType``.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import torch
from torch import Tensor

from forge_lightning.grpo.core import masked_mean
from forge_lightning.grpo.correction import RolloutCorrection, sampler_corrected
from forge_lightning.grpo.kl import KL_ESTIMATORS, KLEstimator, k3
from forge_lightning.grpo.surrogates import Surrogate, cispo, clip_masks, clipped_surrogate, ppo_clip, sapo

LossType = Literal["grpo", "dapo", "dr_grpo", "forge", "cispo", "sapo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
ImportanceSampling = Literal["token", "sequence"]


@dataclass(frozen=True)
class LossSettings:
    """What the loss needs to know; every range is checked here, and only here.

    Args:
        loss_type: ``grpo`` (mean over tokens within each sequence, then over sequences),
            ``dapo`` (mean over every token), ``dr_grpo`` (sum over a constant,
            ``rows x max_completion_length``), ``forge`` (Forge's sequence-level ratio against
            the reference, at temperature 1; reproduces its numbers), ``cispo`` (MiniMax-M1's
            clipped importance-sampling-weight policy optimisation, arXiv 2506.13585:
            ``-sg(min(r, 1 + eps_high)) * A * logp`` per token, the weight's gradient stopped, so
            a token past the cap still has a gradient (PPO's clip gives it none); mean over every
            token, as dapo; no lower bound on the weight, as the paper runs it, and
            ``clip_epsilon_high`` (else ``clip_epsilon``) sets the cap, e.g. 4 for ScaleRL's
            cap of 5) or ``sapo`` (Qwen's soft adaptive policy optimisation, arXiv 2511.20347:
            ``-f(r) * A`` per token with the soft gate ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``
            in place of the clip, ``tau`` = ``sapo_temperature_pos`` where ``A > 0``, else
            ``sapo_temperature_neg``; its gradient ``4 sigmoid'(tau (r - 1)) r A`` is grpo's
            ``r A`` at ``r = 1`` and fades smoothly away from it; grpo's per-sequence mean, as the
            paper and TRL). cispo and sapo have no hard clip: no ``clip_ratio_c``, and their
            clip fractions count where cispo's cap bites (high) and nothing for sapo.
        clip_epsilon: the ratio is clipped to ``[1 - clip_epsilon, 1 + clip_epsilon]``; in (0, 1).
        clip_epsilon_high: a separate upper range (DAPO's clip-higher), > 0; None: clip_epsilon.
        kl_beta: weight of the KL penalty toward the reference, >= 0.
        max_completion_length: dr_grpo's constant; None uses the mask's width.
        importance_sampling_level: ``token`` (one ratio per token, as GRPO) or ``sequence``
            (GSPO, as TRL defines it): one ratio per completion,
            ``s = exp(mean over its tokens of (logp - old_logp))``, clipped per sequence, its
            clipped surrogate applied to every token of the completion (the gradient flows
            through every token's log-prob), then the loss type's reduction. GSPO's paper pairs
            it with ``grpo``; with ``dapo``/``dr_grpo`` a long completion weighs more, as its
            tokens are counted one by one. Its paper uses far smaller clip ranges (about 3e-4
            below, 4e-4 above) than token-level GRPO's 0.2. With one pass per rollout the ratio
            is 1 and the gradient equals token-level grpo's. Not with ``forge``.
        kl_estimator: how each token's KL term is estimated from ``x = ref_logp - logp`` (the
            completion sampled from the policy): ``k1 = -x``, unbiased for KL(policy || ref), but
            as a loss term its gradient is zero in expectation; ``k2 = x**2 / 2``, whose gradient
            is that of KL(policy || ref); ``k3 = exp(x) - x - 1`` (the default, as DeepSeekMath
            and TRL), unbiased for KL(policy || ref) and never negative, whose gradient is that
            of the forward KL(ref || policy). ``forge`` keeps Forge's k3 on its sequence ratio.
        behav_imp_weight_cap: the cap of the sampler correction weight ``w`` (see
            :func:`grpo_loss`; AReaL's ``behav_imp_weight_cap``, 5 by default there; TRL's and
            verl's cap is 3); > 1, or None for no cap.
        rollout_correction: what a weight above the cap does: ``mask`` gives its token (or its
            completion, at ``sequence`` level) weight 0 (masked importance sampling, MIS; the
            tokens stay in the normaliser); ``truncate`` weighs it ``cap`` (truncated importance
            sampling, TIS).
        rollout_correction_level: ``token`` (one weight per token) or ``sequence`` (one per
            completion, from the mean log-ratio over its model tokens).
        clip_ratio_c: dual-clip PPO's bound (Ye et al., arXiv 1912.09729; verl's
            ``clip_ratio_c``, 3 there): where the advantage is negative the policy term
            ``-min(r A, clip(r) A)`` is capped at ``-clip_ratio_c * A``, so a token whose ratio
            ran far above 1 cannot push by more than ``clip_ratio_c`` times its advantage (nor
            does it carry a gradient there); > 1, or None: off. grpo, dapo and dr_grpo only.
        sapo_temperature_pos: sapo's gate temperature where the advantage is positive, > 0
            (the paper's and TRL's 1.0).
        sapo_temperature_neg: sapo's gate temperature where it is negative, > 0 (1.05: the
            paper fades negative-advantage tokens faster, they spread their push over the whole
            vocabulary).
        entropy_coef: weight of an entropy bonus, >= 0: ``entropy_coef x`` the tokens' entropy
            (of the scored distribution, with its gradient), reduced as the loss type reduces its
            per-token loss, is subtracted from the loss (:func:`entropy_bonus`; verl's
            ``entropy_coeff``). 0: no term.
        kl_in_reward: put the KL penalty in the reward instead of the loss (verl's
            ``use_kl_in_reward``): each completion's reward loses ``kl_beta x`` the sum over its
            tokens of the ``kl_estimator``'s KL between the sampling policy and the reference
            (grpo.kl.kl_penalised_rewards), before advantages; the loss then has no KL term (its
            ``kl`` metric is still reported). Needs ``kl_beta > 0``; not with ``forge``.
    """

    loss_type: LossType = "grpo"
    clip_epsilon: float = 0.2
    clip_epsilon_high: float | None = None
    kl_beta: float = 0.01
    max_completion_length: int | None = None
    importance_sampling_level: ImportanceSampling = "token"
    kl_estimator: KLEstimator = "k3"
    behav_imp_weight_cap: float | None = None
    rollout_correction: RolloutCorrection = "mask"
    rollout_correction_level: ImportanceSampling = "token"
    clip_ratio_c: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    entropy_coef: float = 0.0
    kl_in_reward: bool = False

    def __post_init__(self) -> None:
        checks = {
            "loss_type": (self.loss_type in _KINDS, f"one of {LOSS_TYPES}"),
            "clip_epsilon": (_number(self.clip_epsilon) and 0 < self.clip_epsilon < 1, "in (0, 1)"),
            "clip_epsilon_high": (
                self.clip_epsilon_high is None
                or (_number(self.clip_epsilon_high) and self.clip_epsilon_high > 0),
                "None or > 0",
            ),
            "kl_beta": (_number(self.kl_beta) and self.kl_beta >= 0, ">= 0"),
            "max_completion_length": (
                self.max_completion_length is None
                or (isinstance(self.max_completion_length, int) and self.max_completion_length >= 1),
                "None or an integer >= 1",
            ),
            "importance_sampling_level": (
                self.importance_sampling_level in get_args(ImportanceSampling),
                f"one of {get_args(ImportanceSampling)}",
            ),
            "kl_estimator": (self.kl_estimator in KL_ESTIMATORS, f"one of {get_args(KLEstimator)}"),
            "behav_imp_weight_cap": (
                self.behav_imp_weight_cap is None
                or (_number(self.behav_imp_weight_cap) and self.behav_imp_weight_cap > 1),
                "None or > 1",
            ),
            "rollout_correction": (
                self.rollout_correction in get_args(RolloutCorrection),
                f"one of {get_args(RolloutCorrection)}",
            ),
            "rollout_correction_level": (
                self.rollout_correction_level in get_args(ImportanceSampling),
                f"one of {get_args(ImportanceSampling)}",
            ),
            "clip_ratio_c": (
                self.clip_ratio_c is None or (_number(self.clip_ratio_c) and self.clip_ratio_c > 1),
                "None or > 1",
            ),
            "sapo_temperature_pos": (
                _number(self.sapo_temperature_pos) and self.sapo_temperature_pos > 0,
                "> 0",
            ),
            "sapo_temperature_neg": (
                _number(self.sapo_temperature_neg) and self.sapo_temperature_neg > 0,
                "> 0",
            ),
            "entropy_coef": (_number(self.entropy_coef) and self.entropy_coef >= 0, ">= 0"),
            "kl_in_reward": (isinstance(self.kl_in_reward, bool), "True or False"),
        }
        for field, (ok, words) in checks.items():
            if not ok:
                raise ValueError(f"{field} must be {words}, got {getattr(self, field)!r}")
        if self.loss_type == "forge" and self.kl_estimator != "k3":
            raise ValueError(
                "loss_type 'forge' is Forge's own sequence-level loss with its k3 term: leave "
                "kl_estimator 'k3'"
            )
        self._check_levers()

    def _check_levers(self) -> None:
        """Refuse, by name, the settings the loss type does not take (its ``_KINDS`` entry's
        ``refuses``), and the KL in the reward without a KL weight."""
        kind = _KINDS[self.loss_type]
        changed = {
            "importance_sampling_level": self.importance_sampling_level != "token",
            "clip_ratio_c": self.clip_ratio_c is not None,
            "entropy_coef": self.entropy_coef > 0,
            "kl_in_reward": self.kl_in_reward,
        }
        for name in kind.refuses:
            if changed[name]:
                raise ValueError(
                    f"{name} does not go with loss_type {self.loss_type!r} ({kind.why}): leave "
                    f"{name} at its default, or use grpo, dapo or dr_grpo"
                )
        if self.kl_in_reward and self.kl_beta == 0:
            raise ValueError(
                "kl_in_reward subtracts kl_beta x the KL from each reward: set kl_beta > 0 "
                "(or kl_in_reward false)"
            )

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(eps_low, eps_high)``: the ratio is clipped to ``[1 - eps_low, 1 + eps_high]``."""
        high = self.clip_epsilon_high
        return self.clip_epsilon, self.clip_epsilon if high is None else high

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads reference log-probs (a KL term, or Forge's ratio)."""
        return self.kl_beta > 0 or _KINDS[self.loss_type].ratio_against_reference

    @property
    def advantage_weighted(self) -> bool:
        """Whether every term of the loss is a completion's advantage times something: no KL term
        in the loss (``kl_beta`` 0, or the KL in the reward), no entropy bonus, not ``forge``. A
        completion whose advantage is 0 then adds exactly nothing to the gradient."""
        in_loss_kl = self.kl_beta > 0 and not self.kl_in_reward
        return not (in_loss_kl or self.entropy_coef > 0 or _KINDS[self.loss_type].ratio_against_reference)

    def scoring_temperature(self, sampling_temperature: float) -> float:
        """The temperature completions are scored at: the sampling one, or 1 for ``forge``."""
        return sampling_temperature if _KINDS[self.loss_type].at_sampling_temperature else 1.0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class _LossInputs:
    """Checked arguments of :func:`grpo_loss`; per-token tensors are (B, T), advantages (B,)."""

    logp: Tensor
    old_logp: Tensor
    ref_logp: Tensor | None
    advantages: Tensor
    mask: Tensor  # bool
    settings: LossSettings
    behav_logp: Tensor | None = None

    def __post_init__(self) -> None:
        # A (B, 1) advantage would silently broadcast to (B, B, T) below; fail loudly instead.
        per_token = {
            "old_logp": self.old_logp,
            "ref_logp": self.ref_logp,
            "mask": self.mask,
            "behav_logp": self.behav_logp,
        }
        for name, tensor in per_token.items():
            if tensor is not None and tensor.shape != self.logp.shape:
                raise ValueError(
                    f"{name} must match logp's shape {tuple(self.logp.shape)}, got {tuple(tensor.shape)}"
                )
        if self.logp.dim() != 2 or self.advantages.shape != self.logp.shape[:1]:
            raise ValueError(
                f"expected logp (B, T) and advantages (B,), got {tuple(self.logp.shape)} and "
                f"{tuple(self.advantages.shape)}"
            )
        if self.behav_logp is not None and self.settings.loss_type == "forge":
            raise ValueError(
                "behav_logp (a sampler's log-probs: rollout correction) does not go with loss_type 'forge'"
            )
        if self.ref_logp is None and self.settings.needs_reference:
            raise ValueError(
                f"ref_logp is required when kl_beta > 0 or loss_type == 'forge' "
                f"(got kl_beta={self.settings.kl_beta}, loss_type={self.settings.loss_type!r})"
            )

    def reduce(self, values: Tensor) -> Tensor:
        """(B, T) per-token values (or (B,) per-sequence ones) to the loss type's scalar."""
        return _reduced(values, self.mask, self.settings)


def _reduced(values: Tensor, mask: Tensor, settings: LossSettings) -> Tensor:
    kind = _KINDS[settings.loss_type]
    return kind.numerator(values, mask) / loss_normalizer(settings, mask).clamp(min=1)


def _add_kl(policy: Tensor, kl: Tensor, beta: float) -> Tensor:
    # Skipping the term at beta 0 keeps an overflowing KL (inf * 0 = NaN) out of the loss.
    return policy + beta * kl if beta > 0 else policy


def _forge_loss(x: _LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Forge's literal loss: one ratio per sequence, of mean token log-probs, against the reference."""
    assert x.ref_logp is not None  # _LossInputs guarantees it for "forge"
    eps_low, eps_high = x.settings.clip_range
    log_ratio = masked_mean(x.logp, x.mask, dim=1) - masked_mean(x.ref_logp, x.mask, dim=1)  # (B,)
    ratio = torch.exp(log_ratio)
    policy = x.reduce(clipped_surrogate(ratio, x.advantages, eps_low, eps_high))
    kl = k3(log_ratio).mean()
    low, high = clip_masks(ratio.detach(), x.advantages, eps_low, eps_high)
    metrics = {
        "policy_loss": policy,
        "kl": kl,
        "clip_fraction_low": low.float().mean(),
        "clip_fraction_high": high.float().mean(),
    }
    return _add_kl(policy, kl, x.settings.kl_beta), metrics


def _token_level_loss(x: _LossInputs, surrogate: Surrogate) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token policy term (``surrogate``) plus the KL penalty of the token-level loss
    types, which differ in that term and in how :meth:`_LossInputs.reduce` turns (B, T) values
    into a scalar."""
    advantages = x.advantages.unsqueeze(-1)  # (B, 1)
    # Zero the log-ratios on padding before exp: garbage there could overflow, and inf * 0 grads are NaN.
    log_ratio = torch.where(x.mask, x.logp - x.old_logp, 0)  # (B, T)
    if x.settings.importance_sampling_level == "sequence":
        log_ratio = masked_mean(log_ratio, x.mask, dim=1).unsqueeze(-1)  # (B, 1): one per completion
    ratio = torch.exp(log_ratio)
    policy, low, high = surrogate(ratio, advantages, x.logp, x.mask, x.settings)
    policy = policy.expand_as(x.logp)  # (B, T)
    behaviour: dict[str, Tensor] = {}
    if x.behav_logp is not None:
        s = x.settings
        policy, behaviour = sampler_corrected(
            policy,
            x.old_logp,
            x.behav_logp,
            x.mask,
            s.rollout_correction,
            s.rollout_correction_level,
            s.behav_imp_weight_cap,
        )
    per_token = policy
    kl_metric = x.logp.new_zeros(())
    if x.ref_logp is not None:
        kl = KL_ESTIMATORS[x.settings.kl_estimator](torch.where(x.mask, x.ref_logp - x.logp, 0))  # (B, T)
        # With kl_in_reward the penalty is in the advantages already.
        per_token = _add_kl(policy, kl, 0.0 if x.settings.kl_in_reward else x.settings.kl_beta)
        kl_metric = masked_mean(kl.detach(), x.mask)
    low, high = (m.expand_as(x.logp) for m in (low, high))
    metrics = {
        "policy_loss": x.reduce(policy.detach()),
        "kl": kl_metric,
        "clip_fraction_low": masked_mean(low.float(), x.mask),
        "clip_fraction_high": masked_mean(high.float(), x.mask),
        **behaviour,
    }
    return x.reduce(per_token), metrics


def _sequence_means(values: Tensor, mask: Tensor) -> Tensor:
    # A sequence without tokens adds 0 here and is not counted by its normaliser.
    return masked_mean(values, mask, dim=1).sum()


def _token_sum(values: Tensor, mask: Tensor) -> Tensor:
    return values.masked_fill(~mask, 0).sum()


def _sequence_sum(values: Tensor, mask: Tensor) -> Tensor:
    return values.sum()  # (B,) already one value per sequence


@dataclass(frozen=True)
class _LossKind:
    """One loss type. Its scalar is ``numerator(values, mask) / normalizer(mask, max_length)``.

    ``over_the_step``: the normaliser is counted over a whole optimizer step (every accumulation
    batch, every rank), so the step's gradient is that of one loss over all its rollouts; False
    (forge) averages the per-batch losses instead, as Forge's per-prompt accumulation does.
    ``refuses``: the settings (of :meth:`LossSettings._check_levers`) it does not take off their
    defaults, ``why`` saying why in the refusal.
    """

    loss: Callable[[_LossInputs], tuple[Tensor, dict[str, Tensor]]]
    numerator: Callable[[Tensor, Tensor], Tensor]
    normalizer: Callable[[Tensor, int], int | Tensor]
    ratio_against_reference: bool = False
    at_sampling_temperature: bool = True
    over_the_step: bool = True
    refuses: tuple[str, ...] = ()
    why: str = ""


def _sequences_with_tokens(mask: Tensor, _: int) -> Tensor:
    return mask.any(dim=1).sum()


def _tokens(mask: Tensor, _: int) -> Tensor:
    return mask.sum()


_ppo_loss = partial(_token_level_loss, surrogate=ppo_clip)
_NO_HARD_CLIP = "it weighs each token by its own ratio, with no hard clip to dual-clip"

_KINDS: dict[str, _LossKind] = {
    # DeepSeekMath: mean over tokens within each sequence, then over the sequences with tokens.
    "grpo": _LossKind(_ppo_loss, _sequence_means, _sequences_with_tokens),
    # DAPO: every token weighs the same, so long completions are not diluted.
    "dapo": _LossKind(_ppo_loss, _token_sum, _tokens),
    # Dr. GRPO: a constant normaliser, removing the length bias of per-sequence means.
    "dr_grpo": _LossKind(_ppo_loss, _token_sum, lambda mask, length: mask.shape[0] * length),
    # MiniMax-M1's CISPO: a token-mean over the batch, as its objective's 1 / sum |o_i|.
    "cispo": _LossKind(
        partial(_token_level_loss, surrogate=cispo),
        _token_sum,
        _tokens,
        refuses=("importance_sampling_level", "clip_ratio_c"),
        why=_NO_HARD_CLIP,
    ),
    # Qwen's SAPO: per-sequence means, then over the sequences, as GRPO.
    "sapo": _LossKind(
        partial(_token_level_loss, surrogate=sapo),
        _sequence_means,
        _sequences_with_tokens,
        refuses=("importance_sampling_level", "clip_ratio_c"),
        why=_NO_HARD_CLIP,
    ),
    "forge": _LossKind(
        _forge_loss,
        _sequence_sum,
        lambda mask, _: mask.shape[0],
        ratio_against_reference=True,
        at_sampling_temperature=False,
        over_the_step=False,
        refuses=("importance_sampling_level", "clip_ratio_c", "entropy_coef", "kl_in_reward"),
        why="Forge's own loss: one ratio per sequence against the reference, with its k3 term",
    ),
}


def loss_normalizer(settings: LossSettings, mask: Tensor) -> Tensor:
    """The count the loss type divides by over ``mask`` (B, T): sequences with tokens (grpo,
    sapo), tokens (dapo, cispo), ``B x max_completion_length`` (dr_grpo) or sequences (forge)."""
    length = mask.shape[1] if settings.max_completion_length is None else settings.max_completion_length
    count = _KINDS[settings.loss_type].normalizer(mask.bool(), length)
    return torch.as_tensor(count, dtype=torch.float32, device=mask.device)


def micro_batch_weight(settings: LossSettings, part: Tensor, whole: Tensor) -> Tensor:
    """The share of the whole batch's loss that the loss of rows ``part`` of mask ``whole`` stands
    for: summing ``weight x loss(part)`` over a split of the rows gives the loss of ``whole``."""
    return loss_normalizer(settings, part) / loss_normalizer(settings, whole).clamp(min=1)


def backward_weight(settings: LossSettings, part: Tensor, whole: Tensor) -> Tensor:
    """What a micro-batch's loss (rows ``part`` of a batch with mask ``whole``) is multiplied by
    before its backward pass.

    The step's gradient is then scaled once by ``world_size / N``, ``N`` the sum of
    :func:`step_count` over the step's batches and ranks (DDP and FSDP average gradients over
    ranks, hence ``world_size``). For grpo, dapo and dr_grpo the weight is the micro-batch's own
    normaliser, so each backward carries its unnormalised sum and the step's gradient equals that
    of the loss computed once over all its rollouts, however they were split into micro-batches,
    accumulation batches and ranks: dapo's token mean is over every token of the step. For forge it
    is the micro-batch's share of its batch's loss, and each batch counts 1: the mean of the
    per-batch losses.
    """
    if _KINDS[settings.loss_type].over_the_step:
        return loss_normalizer(settings, part)
    return micro_batch_weight(settings, part, whole)


def step_count(settings: LossSettings, mask: Tensor) -> Tensor:
    """What one batch (mask ``(B, T)``) adds to its optimizer step's normaliser: its
    :func:`loss_normalizer` (grpo: sequences with a token; dapo: tokens; dr_grpo:
    ``B x max_completion_length``), or 1 for forge (see :func:`backward_weight`)."""
    if _KINDS[settings.loss_type].over_the_step:
        return loss_normalizer(settings, mask)
    return torch.ones((), device=mask.device)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings = LossSettings(),  # frozen, so a shared default is safe
    behav_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss with a k3 KL penalty towards the reference policy.

    Per token, with ``r = exp(logp - old_logp)`` and the completion's advantage ``A``, the policy
    term is ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` (dual-clipped with
    ``clip_ratio_c``; ``cispo`` and ``sapo`` have their own, see :class:`LossSettings` and
    grpo/surrogates.py), plus ``kl_beta x`` the KL term (none with ``kl_in_reward``), reduced by
    the loss type (an entropy bonus is :func:`entropy_bonus`, subtracted by the caller, who has
    the entropy). Given the sampler's own
    log-probs ``behav_logp`` (rollout correction), the term becomes ``-w * min(r * A, clip(r) * A)``
    with one detached weight ``w``:

    - token level: ``w_t = exp(old_logp_t - behav_logp_t)``; sequence level: every token of a
      completion gets ``w = exp(mean over its model tokens of (old_logp - behav_logp))``;
    - ``mask`` (MIS): ``w`` where ``w <= cap``, else 0; ``truncate`` (TIS): ``min(w, cap)``
      (``cap``: ``settings.behav_imp_weight_cap``).

    Synchronous rollouts: ``old_logp`` is the trainer's recomputation on the sampling weights
    (with one pass, ``logp`` detached: the same values) and ``behav_logp`` the engine's, so ``w``
    corrects the engine's mismatch alone. Asynchronous rollouts (AReaL's decoupled objective):
    ``old_logp`` is the proximal policy (the weights before this update) and ``behav_logp`` the
    older version that sampled, so the one ``w`` covers both the lag and the mismatch. The KL term
    is not weighted. Where ``behav_logp`` equals ``old_logp``, ``w`` is exactly 1 and the loss
    is the uncorrected one bit for bit.

    Args:
        logp: (B, T) per-token log-probs of the completions under the policy being trained.
        old_logp: (B, T) the same under the policy that sampled them; ``None`` means ``logp``
            detached (ratio 1, one optimisation step per rollout).
        ref_logp: (B, T) the same under the frozen reference; ``None`` only when
            ``settings.needs_reference`` is false.
        advantages: (B,) one advantage per completion.
        mask: (B, T) 1 on completion tokens, 0 on padding; bool or float.
        settings: the loss type and its constants.
        behav_logp: (B, T) the log-probs the sampler reported (an engine's, or an older
            version's); None: no correction.

    Returns:
        The scalar loss and detached scalar metrics ``policy_loss``, ``kl``, ``clip_fraction_low``
        and ``clip_fraction_high`` (fractions of masked tokens, or of sequences for ``forge``),
        and with ``behav_logp`` ``sampler_kl``, ``correction_weight_mean`` and
        ``correction_masked_fraction``.
    """
    inputs = _LossInputs(
        logp=logp,
        old_logp=logp.detach() if old_logp is None else old_logp,
        ref_logp=ref_logp,
        advantages=advantages,
        mask=mask.bool(),
        settings=settings,
        behav_logp=behav_logp,
    )
    loss, metrics = _KINDS[settings.loss_type].loss(inputs)
    return loss, {name: value.detach() for name, value in metrics.items()}


def entropy_bonus(entropy: Tensor, mask: Tensor, settings: LossSettings) -> Tensor:
    """What the entropy bonus takes off :func:`grpo_loss`'s loss: ``entropy_coef x`` the (B, T)
    ``entropy`` over ``mask``, reduced as the loss type reduces its per-token loss (so a
    micro-batch's share follows from :func:`micro_batch_weight`, as the loss's does), with the
    entropy's gradient; exactly 0 when ``entropy_coef`` is 0."""
    if settings.entropy_coef == 0:
        return entropy.new_zeros(())
    mask = mask.bool()
    return settings.entropy_coef * _reduced(torch.where(mask, entropy, 0), mask, settings)
