"""Checks of the GRPO math against numbers worked out by hand, torch references and gradcheck."""

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from forge_lightning.grpo import (
    ADVANTAGE_SCALES,
    LOSS_TYPES,
    LossSettings,
    group_advantages,
    grpo_loss,
    loss_normalizer,
    masked_mean,
    micro_batch_weight,
    token_log_probs,
)

TOKEN_LEVEL_TYPES = ("grpo", "dapo", "dr_grpo")
EPS = 1e-8


def k3(x: float) -> float:
    return math.exp(x) - x - 1


# ---------------------------------------------------------------------------------------------------
# masked_mean


def test_masked_mean_ignores_masked_positions_even_when_they_hold_inf():
    values = torch.tensor([[1.0, 3.0, float("inf")], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_mean(values, mask), torch.tensor(2.0))  # (1 + 3 + 2) / 3
    assert_close(masked_mean(values, mask, dim=1), torch.tensor([2.0, 2.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    values = torch.randn(2, 3)
    assert_close(masked_mean(values, torch.zeros(2, 3, dtype=torch.bool)), torch.tensor(0.0))


# ---------------------------------------------------------------------------------------------------
# group_advantages


def test_forge_example_group_gives_plus_minus_0_9354():
    rewards = torch.tensor([1.0, 1, 0, 0, 1, 0, 0, 1])
    # mean 0.5, Bessel variance 8 * 0.25 / 7 = 2/7
    magnitude = 0.5 / (math.sqrt(2 / 7) + EPS)  # about 0.9354
    expected = torch.tensor([1.0, 1, -1, -1, 1, -1, -1, 1]) * magnitude
    assert_close(group_advantages(rewards, group_size=8), expected)


@pytest.mark.parametrize(
    "scale, magnitude",
    [
        ("group", 1 / (math.sqrt(2) + EPS)),  # group [0, 2]: mean 1, Bessel std sqrt(2)
        ("batch", 1 / (statistics.stdev([0, 2, 1, 1, 5, 5]) + EPS)),  # std of all raw rewards
        ("none", 1.0),
    ],
)
def test_each_scale_divides_centred_rewards_by_its_std(scale, magnitude):
    rewards = torch.tensor([0.0, 2, 1, 1, 5, 5])
    expected = torch.tensor([-magnitude, magnitude, 0, 0, 0, 0])
    assert_close(group_advantages(rewards, group_size=2, scale=scale), expected)


@pytest.mark.parametrize("scale", ADVANTAGE_SCALES)
def test_equal_rewards_give_zero_advantages(scale):
    # In float32 the mean of seven 0.1s is not 0.1; the naive (r - mean) / (std + eps) of this batch
    # is about -0.41 for every reward, so exact zeros show the equal group is special-cased.
    rewards = torch.tensor([0.1] * 7 + [0.7] * 7)
    advantages = group_advantages(rewards, group_size=7, scale=scale)
    assert torch.equal(advantages, torch.zeros(14))


def test_advantages_keep_float64_and_upcast_integers():
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2).dtype == torch.float64
    assert group_advantages(torch.tensor([1, 0]), 2).dtype == torch.float32


@pytest.mark.parametrize("length, group_size", [(4, 1), (4, 0), (5, 2)])
def test_bad_group_sizes_raise(length, group_size):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(length), group_size)


def test_unknown_scale_raises_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="batch"):
        group_advantages(torch.zeros(4), 2, scale="rank")


# ---------------------------------------------------------------------------------------------------
# token_log_probs


def reference_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
def test_token_log_probs_match_log_softmax_gather(temperature, chunk_size):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    targets = torch.randint(0, 11, (3, 5))
    result = token_log_probs(logits, targets, temperature=temperature, chunk_size=chunk_size)
    assert_close(result, reference_log_probs(logits, targets, temperature))


def test_chunked_gradient_equals_unchunked_gradient():
    torch.manual_seed(1)
    logits = torch.randn(2, 7, 13, requires_grad=True)
    targets = torch.randint(0, 13, (2, 7))
    weights = torch.randn(2, 7)
    (token_log_probs(logits, targets, temperature=0.8, chunk_size=3) * weights).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    (reference_log_probs(logits, targets, 0.8) * weights).sum().backward()
    assert_close(chunked_grad, logits.grad)


def test_bf16_logits_give_float32_log_probs():
    torch.manual_seed(2)
    logits = torch.randn(4, 9).to(torch.bfloat16)
    targets = torch.randint(0, 9, (4,))
    result = token_log_probs(logits, targets, chunk_size=2)
    assert result.dtype == torch.float32
    assert_close(result, reference_log_probs(logits, targets, 1.0))


def test_token_log_probs_pass_gradcheck():
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_log_probs(x, targets, 0.7, chunk_size=4), (logits,))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_non_positive_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=temperature)


# ---------------------------------------------------------------------------------------------------
# grpo_loss: one worked example, B=2 completions, T=2 tokens, the second completion one token long.
# Log-ratios logp - old: (0,0) 0.1, (0,1) -0.3, (1,0) 0.0; ref - logp: -0.1, 0.2, 0.3; A = [1, -1].
# No token is clipped: (0,1) has ratio 0.74 < 0.8 but a positive advantage, so the min keeps it.

LOGP = [[-0.9, -2.3], [-1.5, -9.0]]  # -9.0 sits on padding and must not matter
OLD = [[-1.0, -2.0], [-1.5, -0.5]]
REF = [[-1.0, -2.1], [-1.2, -0.7]]
MASK = [[1, 1], [1, 0]]
ADVANTAGES = [1.0, -1.0]
BETA = 0.1

POLICY = [-math.exp(0.1), -math.exp(-0.3), 1.0]  # -min(r*A, clip(r)*A) per real token
KL = [k3(-0.1), k3(0.2), k3(0.3)]
TOKEN_LOSS = [p + BETA * k for p, k in zip(POLICY, KL)]


def per_sequence_mean(values: list[float]) -> float:
    return ((values[0] + values[1]) / 2 + values[2]) / 2


# forge: x = mean(logp) - mean(ref) per sequence = [-1.6 + 1.55, -1.5 + 1.2] = [-0.05, -0.3].
# Sequence 1 has ratio 0.74 with A = -1, so its clip is active: -min(-0.74, -0.8) = 0.8.
FORGE_POLICY = (-math.exp(-0.05) + 0.8) / 2
FORGE_KL = (k3(-0.05) + k3(-0.3)) / 2

# cispo: -min(r, 1.2) * A * logp with the weight a constant; no ratio here reaches 1.2.
CISPO_POLICY = [0.9 * math.exp(0.1), 2.3 * math.exp(-0.3), -1.5]
# sapo: -sigmoid(tau (r - 1)) * 4 / tau * A, tau 1 for A = 1 and 1.05 for A = -1.
SAPO_POLICY = [
    -4 / (1 + math.exp(-(math.exp(0.1) - 1))),
    -4 / (1 + math.exp(-(math.exp(-0.3) - 1))),
    0.5 * 4 / 1.05,
]

WORKED_EXAMPLE = {
    "grpo": (per_sequence_mean(TOKEN_LOSS), per_sequence_mean(POLICY), 0.0),
    "cispo": (sum(p + BETA * k for p, k in zip(CISPO_POLICY, KL)) / 3, sum(CISPO_POLICY) / 3, 0.0),
    "sapo": (
        per_sequence_mean([p + BETA * k for p, k in zip(SAPO_POLICY, KL)]),
        per_sequence_mean(SAPO_POLICY),
        0.0,
    ),
    "dapo": (sum(TOKEN_LOSS) / 3, sum(POLICY) / 3, 0.0),
    "dr_grpo": (sum(TOKEN_LOSS) / 4, sum(POLICY) / 4, 0.0),
    "forge": (FORGE_POLICY + BETA * FORGE_KL, FORGE_POLICY, 0.5),
}


def worked_inputs(**overrides):
    inputs = {
        "logp": torch.tensor(LOGP, dtype=torch.float64, requires_grad=True),
        "old_logp": torch.tensor(OLD, dtype=torch.float64),
        "ref_logp": torch.tensor(REF, dtype=torch.float64),
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
        "mask": torch.tensor(MASK),
    }
    return inputs | overrides


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_worked_example_matches_hand_computation(loss_type):
    expected_loss, expected_policy, expected_clip_low = WORKED_EXAMPLE[loss_type]
    expected_kl = FORGE_KL if loss_type == "forge" else sum(KL) / 3
    loss, metrics = grpo_loss(**worked_inputs(), settings=LossSettings(loss_type, kl_beta=BETA))
    assert_close(loss.item(), expected_loss)
    assert set(metrics) == {"policy_loss", "kl", "clip_fraction_low", "clip_fraction_high"}
    assert not any(value.requires_grad for value in metrics.values())
    assert_close(metrics["policy_loss"].item(), expected_policy)
    assert_close(metrics["kl"].item(), expected_kl)
    assert_close(metrics["clip_fraction_low"].item(), expected_clip_low)
    assert_close(metrics["clip_fraction_high"].item(), 0.0)


def test_dr_grpo_divides_by_max_completion_length():
    loss, _ = grpo_loss(
        **worked_inputs(), settings=LossSettings("dr_grpo", kl_beta=BETA, max_completion_length=5)
    )
    assert_close(loss.item(), sum(TOKEN_LOSS) / (2 * 5))


def test_loss_leaves_caller_tensors_untouched():
    inputs = worked_inputs()
    before = {name: tensor.clone() for name, tensor in inputs.items()}
    for loss_type in LOSS_TYPES:
        grpo_loss(**inputs, settings=LossSettings(loss_type, kl_beta=BETA))[0].backward()
    for name, tensor in before.items():
        assert torch.equal(inputs[name].detach(), tensor.detach())


# cispo's weight depends on logp but carries no gradient (by design): its loss value's numerical
# derivative is not its gradient (tests/grpo/test_levers.py checks that one by hand).
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "cispo"])
def test_grpo_loss_passes_gradcheck(loss_type):
    torch.manual_seed(4)
    logp = (-torch.rand(3, 4, dtype=torch.float64) * 3).requires_grad_()
    # Log-ratios well away from log(0.8) and log(1.2), where min and clamp have kinks.
    log_ratio = torch.tensor([[0.5, -0.05, 0.05, -0.5]], dtype=torch.float64).expand(3, 4)
    old = logp.detach() - log_ratio
    ref = logp.detach() - torch.tensor([[0.5], [0.05], [-0.5]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])

    def loss_of(x):
        return grpo_loss(x, old, ref, advantages, mask, LossSettings(loss_type, kl_beta=0.1))[0]

    assert torch.autograd.gradcheck(loss_of, (logp,))


# ---------------------------------------------------------------------------------------------------
# grpo_loss: edge cases


@pytest.mark.parametrize("loss_type", TOKEN_LEVEL_TYPES)
def test_all_zero_mask_gives_zero_loss_that_still_backpropagates(loss_type):
    inputs = worked_inputs(mask=torch.zeros(2, 2))
    loss, metrics = grpo_loss(**inputs, settings=LossSettings(loss_type))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(inputs["logp"].grad, torch.zeros(2, 2, dtype=torch.float64))
    assert all(torch.isfinite(value) for value in metrics.values())


def test_forge_with_all_zero_mask_stays_finite():
    inputs = worked_inputs(mask=torch.zeros(2, 2))
    loss, _ = grpo_loss(**inputs, settings=LossSettings("forge"))
    assert torch.isfinite(loss)
    loss.backward()
    # No token counts: the masked means are 0 and carry no gradient, finite or otherwise.
    assert torch.equal(inputs["logp"].grad, torch.zeros(2, 2, dtype=torch.float64))


def test_sequence_without_tokens_is_not_counted_in_grpo_mean():
    inputs = worked_inputs(mask=torch.tensor([[1, 1], [0, 0]]))
    loss, _ = grpo_loss(**inputs, settings=LossSettings(kl_beta=BETA))
    first_row = {name: tensor[:1] for name, tensor in worked_inputs().items()}
    alone, _ = grpo_loss(**first_row, settings=LossSettings(kl_beta=BETA))
    assert_close(loss, alone)
    assert_close(loss.item(), (TOKEN_LOSS[0] + TOKEN_LOSS[1]) / 2)


def test_zero_kl_beta_accepts_missing_reference():
    loss, metrics = grpo_loss(**worked_inputs(ref_logp=None), settings=LossSettings(kl_beta=0.0))
    assert_close(loss.item(), per_sequence_mean(POLICY))
    assert metrics["kl"].item() == 0.0


def test_missing_reference_with_kl_penalty_raises_naming_ref_logp():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(**worked_inputs(ref_logp=None), settings=LossSettings(kl_beta=0.1))


def test_forge_without_reference_raises_even_at_zero_beta():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(**worked_inputs(ref_logp=None), settings=LossSettings("forge", kl_beta=0.0))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"clip_epsilon": 1.0}, "clip_epsilon"),
        ({"clip_epsilon": 0.0}, "clip_epsilon"),
        ({"clip_epsilon_high": -0.1}, "clip_epsilon_high"),
        ({"kl_beta": -0.01}, "kl_beta"),
    ],
)
def test_invalid_loss_settings_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        LossSettings(**kwargs)


def test_advantages_of_wrong_shape_raise():
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(**worked_inputs(advantages=torch.ones(2, 1, dtype=torch.float64)))


@pytest.mark.parametrize("loss_type", TOKEN_LEVEL_TYPES)
@pytest.mark.parametrize("old_from_caller", [True, False])
def test_ratio_one_gives_zero_clip_fractions(loss_type, old_from_caller):
    inputs = worked_inputs()
    inputs["old_logp"] = inputs["logp"].detach().clone() if old_from_caller else None
    _, metrics = grpo_loss(**inputs, settings=LossSettings(loss_type))
    assert metrics["clip_fraction_low"].item() == 0.0
    assert metrics["clip_fraction_high"].item() == 0.0


@pytest.mark.parametrize("clip_epsilon_high, expected_high", [(None, 0.25), (0.7, 0.0)])
def test_clip_fractions_count_only_active_clips(clip_epsilon_high, expected_high):
    # Ratios e^0.5 = 1.65 and e^-0.5 = 0.61. Active: (0,0) high side (A > 0) and (1,1) low side
    # (A < 0). (1,0) exceeds 1.2 but has A < 0, so the min ignores the clip; (0,1) has ratio 1.
    logp = torch.zeros(2, 2, requires_grad=True)
    old = -torch.tensor([[0.5, 0.0], [0.5, -0.5]])
    advantages = torch.tensor([1.0, -1.0])
    loss, metrics = grpo_loss(
        logp,
        old,
        None,
        advantages,
        torch.ones(2, 2),
        LossSettings(kl_beta=0.0, clip_epsilon_high=clip_epsilon_high),
    )
    assert_close(metrics["clip_fraction_low"].item(), 0.25)
    assert_close(metrics["clip_fraction_high"].item(), expected_high)
    loss.backward()
    # A clipped token must not push the policy any further.
    assert logp.grad[1, 1].item() == 0.0
    assert (logp.grad[0, 0].item() == 0.0) == (expected_high > 0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_weights_make_the_parts_sum_to_the_whole_loss(loss_type):
    torch.manual_seed(5)
    logp = -torch.rand(4, 6)
    old = logp - 0.3 * torch.randn(4, 6)
    ref = logp - 0.3 * torch.randn(4, 6)
    advantages = torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    settings = LossSettings(loss_type, kl_beta=0.1, max_completion_length=6)
    whole, _ = grpo_loss(logp, old, ref, advantages, mask, settings)
    parts = [
        micro_batch_weight(settings, mask[rows], mask)
        * grpo_loss(logp[rows], old[rows], ref[rows], advantages[rows], mask[rows], settings)[0]
        for rows in (slice(0, 1), slice(1, 4))
    ]
    assert_close(parts[0] + parts[1], whole)


@pytest.mark.parametrize(
    ("loss_type", "count"),
    # one row has no token
    [("grpo", 3), ("dapo", 9), ("dr_grpo", 4 * 6), ("forge", 4), ("cispo", 9), ("sapo", 3)],
)
def test_each_loss_type_names_its_normalizer(loss_type, count):
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    settings = LossSettings(loss_type, max_completion_length=6)
    assert loss_normalizer(settings, mask).item() == count


def test_only_forge_scores_at_temperature_one_and_needs_the_reference_without_kl():
    assert LossSettings("forge", kl_beta=0.0).needs_reference
    assert LossSettings("forge").scoring_temperature(0.7) == 1.0
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        assert not LossSettings(loss_type, kl_beta=0.0).needs_reference
        assert LossSettings(loss_type, kl_beta=0.1).needs_reference
        assert LossSettings(loss_type).scoring_temperature(0.7) == 0.7


# ---------------------------------------------------------------------------------------------------
# Sequence-level importance sampling (GSPO) and the KL estimators, on the worked example above.
# Sequence log-ratios: row 0 mean(0.1, -0.3) = -0.1, row 1 0.0; both ratios inside [0.8, 1.2].

SEQ_POLICY = [-math.exp(-0.1), -math.exp(-0.1), 1.0]  # -s * A on every token of the completion


def test_sequence_level_ratio_matches_hand_computation():
    settings = LossSettings(kl_beta=BETA, importance_sampling_level="sequence")
    loss, metrics = grpo_loss(**worked_inputs(), settings=settings)
    token_loss = [p + BETA * k for p, k in zip(SEQ_POLICY, KL)]
    assert_close(loss.item(), per_sequence_mean(token_loss))
    assert_close(metrics["policy_loss"].item(), per_sequence_mean(SEQ_POLICY))
    assert metrics["clip_fraction_low"].item() == metrics["clip_fraction_high"].item() == 0.0


def test_a_clipped_sequence_carries_no_gradient_on_any_of_its_tokens():
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)  # ratio e^0.5 = 1.65
    settings = LossSettings(kl_beta=0.0, importance_sampling_level="sequence")
    loss, metrics = grpo_loss(
        logp, old, None, torch.tensor([1.0, 1.0], dtype=torch.float64), torch.ones(2, 3), settings
    )
    loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(3, dtype=torch.float64))  # clipped high, A > 0
    assert (logp.grad[1] != 0).all()
    assert_close(metrics["clip_fraction_high"].item(), 0.5)


@pytest.mark.parametrize("loss_type", TOKEN_LEVEL_TYPES)
def test_sequence_level_gradient_equals_token_level_at_ratio_one_and_differs_after_a_step(loss_type):
    def grad(old_logp, level: str) -> torch.Tensor:
        inputs = worked_inputs(old_logp=old_logp)
        settings = LossSettings(loss_type, kl_beta=BETA, importance_sampling_level=level)
        grpo_loss(**inputs, settings=settings)[0].backward()
        return inputs["logp"].grad

    # One pass per rollout (mu = 1): old_logp is the policy's own, so every ratio is 1.
    assert_close(grad(None, "sequence"), grad(None, "token"))
    # A later pass (mu = 2): the old log-probs differ from the current ones.
    old = torch.tensor(OLD, dtype=torch.float64)
    assert not torch.allclose(grad(old, "sequence"), grad(old, "token"))


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [("k1", lambda x: -x), ("k2", lambda x: x * x / 2), ("k3", k3)],
)
def test_kl_estimators_match_their_formulas(estimator, per_token):
    xs = [-0.1, 0.2, 0.3]  # ref - logp on the three real tokens
    settings = LossSettings(kl_beta=BETA, kl_estimator=estimator)
    loss, metrics = grpo_loss(**worked_inputs(), settings=settings)
    kl = [per_token(x) for x in xs]
    assert_close(metrics["kl"].item(), sum(kl) / 3)
    assert_close(loss.item(), per_sequence_mean([p + BETA * k for p, k in zip(POLICY, kl)]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_new_loss_paths_pass_gradcheck(estimator, level):
    torch.manual_seed(4)
    logp = (-torch.rand(3, 4, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() - torch.tensor([[0.05, -0.05, 0.02, -0.01]], dtype=torch.float64)
    ref = logp.detach() - torch.tensor([[0.5], [0.05], [-0.5]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    settings = LossSettings(kl_beta=0.1, kl_estimator=estimator, importance_sampling_level=level)
    assert torch.autograd.gradcheck(lambda x: grpo_loss(x, old, ref, advantages, mask, settings)[0], (logp,))


def test_k1_gradient_is_the_score_function_k2_and_k3_weigh_it_by_the_log_ratio():
    # d/dlogp of each token's term: k1 -> 1, k2 -> -(ref - logp), k3 -> 1 - exp(ref - logp).
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5]], dtype=torch.float64)
    x = -0.5
    expected = {"k1": 1.0, "k2": -x, "k3": 1 - math.exp(x)}
    for estimator, slope in expected.items():
        logp.grad = None
        settings = LossSettings(kl_beta=1.0, kl_estimator=estimator)
        loss, _ = grpo_loss(
            logp, logp.detach(), ref, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), settings
        )
        loss.backward()
        assert_close(logp.grad.item(), slope)


def test_forge_refuses_the_sequence_level_ratio_and_other_estimators():
    with pytest.raises(ValueError, match="forge"):
        LossSettings("forge", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="forge"):
        LossSettings("forge", kl_estimator="k2")


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_entropy_comes_with_the_log_probs_and_matches_the_softmax(chunk_size):
    from forge_lightning.grpo import token_log_probs_and_entropy

    torch.manual_seed(2)
    logits = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (3, 4))
    logp, entropy = token_log_probs_and_entropy(logits, targets, temperature=0.7, chunk_size=chunk_size)
    log_softmax = torch.log_softmax(logits / 0.7, dim=-1)
    assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1).detach())
    assert_close(logp, token_log_probs(logits, targets, temperature=0.7))
    assert not entropy.requires_grad
    logp.sum().backward()  # the entropy output does not get in the way of the gradient
    assert torch.isfinite(logits.grad).all()


# -- the decoupled objective of asynchronous rollouts (AReaL) ----------------------------------


def test_decoupled_loss_on_hand_made_tensors():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    prox = torch.tensor([[-1.1, -2.0], [-0.5, -1.0]])  # the weights before this update
    behav = torch.tensor([[-1.3, -2.5], [-0.4, -1.0]])  # the older weights that sampled
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    settings = LossSettings(kl_beta=0.0, behav_imp_weight_cap=1.5)
    loss, metrics = grpo_loss(logp, prox, None, advantages, mask, settings, behav_logp=behav)

    def term(i, t):  # -w * min(r A, clip(r) A), by the formula
        r = math.exp(logp[i, t].item() - prox[i, t].item())
        w = math.exp(prox[i, t].item() - behav[i, t].item())
        a = advantages[i].item()
        return 0.0 if w > 1.5 else -w * min(r * a, min(max(r, 0.8), 1.2) * a)

    # grpo: each completion's mean over its tokens, then the mean over completions.
    expected = ((term(0, 0) + term(0, 1)) / 2 + term(1, 0)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert term(0, 1) == 0.0  # w = e^0.5 > 1.5: masked, but still counted in its mean
    loss.backward()
    # The weight is a constant: d/dlogp of -w r A is -w r A inside the clip range.
    w00, r00 = math.exp(0.2), math.exp(0.1)
    assert logp.grad[0, 0].item() == pytest.approx(-w00 * r00 * 1.0 / 4, rel=1e-5)
    assert logp.grad[0, 1].item() == 0.0
    assert logp.grad[1, 0].item() == pytest.approx(-math.exp(-0.1) * -2.0 / 2, rel=1e-5)
    assert metrics["correction_weight_mean"].item() == pytest.approx(
        (math.exp(0.2) + math.exp(-0.1)) / 2, rel=1e-6
    )
    assert metrics["correction_masked_fraction"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_decoupled_loss_at_lag_zero_is_the_loss_bit_for_bit(loss_type):
    torch.manual_seed(0)
    logp = torch.randn(4, 6, requires_grad=True)
    old, ref = logp.detach() + 0.1 * torch.randn(4, 6), logp.detach() + 0.1 * torch.randn(4, 6)
    advantages, mask = torch.randn(4), torch.rand(4, 6) > 0.3
    settings = LossSettings(loss_type=loss_type, kl_beta=0.05, behav_imp_weight_cap=5.0)
    plain, plain_metrics = grpo_loss(logp, old, ref, advantages, mask, settings)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    # Sampled by the proximal policy itself: w = exp(0) = 1 on every token.
    same, metrics = grpo_loss(logp, old, ref, advantages, mask, settings, behav_logp=old.clone())
    (same_grad,) = torch.autograd.grad(same, logp)
    assert torch.equal(plain, same) and torch.equal(plain_grad, same_grad)
    assert metrics["correction_weight_mean"].item() == 1.0
    assert metrics["correction_masked_fraction"].item() == 0.0 and metrics["sampler_kl"].item() == 0.0
    assert torch.equal(metrics["kl"], plain_metrics["kl"])


def test_decoupled_loss_leaves_the_kl_term_unweighted():
    torch.manual_seed(1)
    logp = torch.randn(3, 4, requires_grad=True)
    old, ref = logp.detach() + 0.1, logp.detach() - 0.2
    behav = old - 0.3  # w = e^0.3 on every token
    advantages, mask = torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 4, dtype=torch.bool)
    with_kl = LossSettings(kl_beta=0.1)
    loss, metrics = grpo_loss(logp, old, ref, advantages, mask, with_kl, behav_logp=behav)
    unweighted, _ = grpo_loss(logp, old, None, advantages, mask, LossSettings(kl_beta=0.0))
    # policy term scaled by w, plus the same KL term as without behav_logp
    assert loss.item() == pytest.approx(
        math.exp(0.3) * unweighted.item() + 0.1 * metrics["kl"].item(), rel=1e-5
    )


# -- rollout correction: the sampler's log-probs against the trainer's (TIS / MIS) --------------


def _corrected_by_hand(logp, old, behav, advantages, mask, mode, level, cap):
    """grpo's loss with the correction weight, term by term, and the three metrics."""
    rows, cols = logp.shape
    log_w = [[old[i, t].item() - behav[i, t].item() for t in range(cols)] for i in range(rows)]
    if level == "sequence":
        for i in range(rows):
            kept = [log_w[i][t] for t in range(cols) if mask[i, t]]
            log_w[i] = [sum(kept) / len(kept)] * cols
    weights, means, applied, dropped, kl = {}, [], [], 0, []
    for i in range(rows):
        terms = []
        for t in range(cols):
            if not mask[i, t]:
                continue
            w = math.exp(log_w[i][t])
            w = (0.0 if w > cap else w) if mode == "mask" else min(w, cap)
            dropped += w == 0.0
            if w != 0.0:
                applied.append(w)
            weights[i, t] = w
            r, a = math.exp(logp[i, t].item() - old[i, t].item()), advantages[i].item()
            terms.append(-w * min(r * a, min(max(r, 0.8), 1.2) * a))
            x = behav[i, t].item() - old[i, t].item()
            kl.append(math.exp(x) - x - 1)
        means.append(sum(terms) / len(terms))
    tokens = int(mask.sum())
    metrics = {
        "sampler_kl": sum(kl) / tokens,
        "correction_weight_mean": sum(applied) / len(applied),
        "correction_masked_fraction": dropped / tokens,
    }
    return sum(means) / rows, weights, metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_rollout_correction_weights_loss_and_metrics_by_hand(mode, level):
    # The trainer's log-probs, and a sampler's: the same plus known noise, large enough on some
    # tokens (and one whole completion) to cross the cap of 3.
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0], [-0.2, -0.9, -1.1]])
    noise = torch.tensor([[0.1, -1.5, 0.3], [-1.05, -1.05, -1.3], [0.4, 0.0, -0.2]])
    behav = old + noise
    logp = (old + torch.tensor([[0.05, -0.1, 0.3], [0.0, 0.2, -0.25], [0.1, -0.05, 0.0]])).requires_grad_()
    advantages = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    settings = LossSettings(
        kl_beta=0.0, behav_imp_weight_cap=3.0, rollout_correction=mode, rollout_correction_level=level
    )
    loss, metrics = grpo_loss(logp, old, None, advantages, mask, settings, behav_logp=behav)
    expected, weights, expected_metrics = _corrected_by_hand(
        logp, old, behav, advantages, mask, mode, level, 3.0
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    for name, value in expected_metrics.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-6), name
    # The noise crosses the cap of 3 (log 1.0986) where it should: tokens (0, 1) and (1, 2) at
    # e^1.5 and e^1.3; at sequence level only row 1, whose mean log-weight is 1.133.
    crossed = [k for k, w in weights.items() if w in (0.0, 3.0)]
    assert crossed == ([(0, 1), (1, 2)] if level == "token" else [(1, 0), (1, 1), (1, 2)])
    loss.backward()
    # The weight is a constant: inside the clip range a token's gradient is -w r A / (tokens * rows).
    w, r = weights[2, 0], math.exp(0.1)
    assert logp.grad[2, 0].item() == pytest.approx(-w * r * 2.0 / 2 / 3, rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["mask", "truncate"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_every_rollout_correction_without_mismatch_is_the_plain_loss_bit_for_bit(loss_type, mode, level):
    torch.manual_seed(3)
    logp = torch.randn(4, 6, requires_grad=True)
    old, ref = logp.detach() + 0.1 * torch.randn(4, 6), logp.detach() + 0.1 * torch.randn(4, 6)
    advantages, mask = torch.randn(4), torch.rand(4, 6) > 0.3
    plain_settings = LossSettings(loss_type=loss_type, kl_beta=0.05, importance_sampling_level="sequence")
    settings = LossSettings(
        loss_type=loss_type,
        kl_beta=0.05,
        importance_sampling_level="sequence",
        behav_imp_weight_cap=3.0,
        rollout_correction=mode,
        rollout_correction_level=level,
    )
    plain, _ = grpo_loss(logp, old, ref, advantages, mask, plain_settings)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    same, metrics = grpo_loss(logp, old, ref, advantages, mask, settings, behav_logp=old.clone())
    (same_grad,) = torch.autograd.grad(same, logp)
    assert torch.equal(plain, same) and torch.equal(plain_grad, same_grad)
    assert metrics["sampler_kl"].item() == 0.0 and metrics["correction_masked_fraction"].item() == 0.0


def test_rollout_correction_settings_are_checked():
    with pytest.raises(ValueError, match="rollout_correction must be one of"):
        LossSettings(rollout_correction="clip")
    with pytest.raises(ValueError, match="rollout_correction_level must be one of"):
        LossSettings(rollout_correction_level="batch")


def test_decoupled_loss_settings_are_checked():
    with pytest.raises(ValueError, match="behav_imp_weight_cap must be None or > 1"):
        LossSettings(behav_imp_weight_cap=1.0)
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="behav_logp must match"):
        grpo_loss(
            logp, None, None, torch.zeros(1), torch.ones(1, 2), LossSettings(kl_beta=0.0), torch.zeros(1, 3)
        )
    with pytest.raises(ValueError, match="does not go with loss_type 'forge'"):
        grpo_loss(logp, None, logp, torch.zeros(1), torch.ones(1, 2), LossSettings(loss_type="forge"), logp)
