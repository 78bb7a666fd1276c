"""The algorithm levers against float64 numbers worked out by hand: the advantage estimators
(rloo, reinforce_pp), the loss types cispo and sapo, dual-clip (clip_ratio_c), the entropy bonus
(entropy_coef) and the KL in the reward (kl_in_reward); and each one's loss split into
micro-batches (or its advantages over ranks) summing to the whole."""

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from forge_lightning.grpo import (
    ADVANTAGE_ESTIMATORS,
    LossSettings,
    entropy_bonus,
    group_advantages,
    grpo_loss,
    kl_penalised_rewards,
    micro_batch_weight,
    token_log_probs_and_entropy,
)

EPS = 1e-8
F64 = torch.float64


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def k3(x: float) -> float:
    return math.exp(x) - x - 1


# ---------------------------------------------------------------------------------------------------
# advantage estimators


@pytest.mark.parametrize(
    "scale, divisor",
    [("none", 1.0), ("group", statistics.stdev([0, 1, 5]) + EPS)],
)
def test_rloo_subtracts_the_mean_of_the_other_completions(scale, divisor):
    rewards = f64([0, 1, 5, 2, 2, 2])
    # group [0, 1, 5]: the others' means are 3, 2.5 and 0.5; the equal group gets exact zeros
    expected = f64([0 - 3, 1 - 2.5, 5 - 0.5, 0, 0, 0]) / divisor
    assert_close(group_advantages(rewards, 3, scale=scale, estimator="rloo"), expected)


def test_reinforce_pp_divides_group_centred_rewards_by_their_batch_std_not_the_raw_rewards():
    rewards = f64([0, 2, 1, 1, 5, 9])
    centred = [-1, 1, 0, 0, -2, 2]  # each minus its group's mean
    expected = f64(centred) / (statistics.stdev(centred) + EPS)  # sqrt(10 / 5) = sqrt(2)
    assert_close(group_advantages(rewards, 2, scale="none", estimator="reinforce_pp"), expected)
    # advantage_scale batch divides the same centred rewards by the raw rewards' std instead,
    # which counts the spread between the prompts (the third group's 5 and 9 against 0 to 2).
    batch = f64(centred) / (statistics.stdev([0, 2, 1, 1, 5, 9]) + EPS)
    assert_close(group_advantages(rewards, 2, scale="batch"), batch)
    assert not torch.allclose(expected, batch)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_each_rank_computes_its_share_of_the_whole_batchs_advantages(estimator):
    # Two ranks of two groups each; every rank sees every rank's rewards (all_gather).
    torch.manual_seed(0)
    rewards = torch.randn(8, dtype=F64)
    scale = "none" if estimator == "reinforce_pp" else "group"
    whole = group_advantages(rewards, 2, scale=scale, estimator=estimator)
    ranks = [
        group_advantages(part, 2, scale=scale, batch_rewards=rewards, estimator=estimator)
        for part in rewards.split(4)
    ]
    assert_close(torch.cat(ranks), whole, rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_equal_rewards_give_zero_advantages_for_every_estimator(estimator):
    rewards = torch.tensor([0.1] * 7 + [0.7] * 7)
    scale = "none" if estimator == "reinforce_pp" else "group"
    assert torch.equal(group_advantages(rewards, 7, scale=scale, estimator=estimator), torch.zeros(14))


def test_reinforce_pp_refuses_a_second_scale_and_unknown_estimators_are_named():
    with pytest.raises(ValueError, match="scale must be 'none'"):
        group_advantages(torch.zeros(4), 2, scale="group", estimator="reinforce_pp")
    with pytest.raises(ValueError, match="rloo"):
        group_advantages(torch.zeros(4), 2, estimator="ppo")


# ---------------------------------------------------------------------------------------------------
# cispo, sapo and dual-clip on two completions of two tokens, the second one token long.
# Log-ratios logp - old: (0,0) 0.5, (0,1) -0.1, (1,0) 1.5; advantages [1, -2].

LOGP = [[-0.5, -1.1], [-0.2, -7.0]]  # -7.0 sits on padding
OLD = [[-1.0, -1.0], [-1.7, -0.3]]
MASK = [[True, True], [True, False]]
ADV = [1.0, -2.0]
RATIOS = [math.exp(0.5), math.exp(-0.1), math.exp(1.5)]
A_OF = [1.0, 1.0, -2.0]  # each real token's advantage
LOGP_OF = [-0.5, -1.1, -0.2]


def inputs(**overrides):
    base = {
        "logp": f64(LOGP).requires_grad_(),
        "old_logp": f64(OLD),
        "ref_logp": None,
        "advantages": f64(ADV),
        "mask": torch.tensor(MASK),
    }
    return base | overrides


def loss_and_grad(settings: LossSettings, **overrides):
    x = inputs(**overrides)
    loss, metrics = grpo_loss(**x, settings=settings)
    loss.backward()
    return loss.item(), x["logp"].grad, metrics


def test_cispo_is_reinforce_weighted_by_the_clipped_ratio_with_its_gradient_stopped():
    settings = LossSettings("cispo", kl_beta=0.0, clip_epsilon_high=1.0)  # cap 2: only e^1.5 bites
    weights = [min(r, 2.0) for r in RATIOS]
    terms = [-w * a * lp for w, a, lp in zip(weights, A_OF, LOGP_OF)]
    loss, grad, metrics = loss_and_grad(settings)
    assert_close(loss, sum(terms) / 3)  # a mean over every token
    # d/dlogp is -w A / tokens: the capped token (1, 0) still moves, PPO's clip would stop it
    expected = f64([[-RATIOS[0] * 1.0, -RATIOS[1] * 1.0], [-2.0 * -2.0, 0.0]]) / 3
    assert_close(grad, expected)
    assert_close(metrics["clip_fraction_high"].item(), 1 / 3)
    assert metrics["clip_fraction_low"].item() == 0.0


def test_cispo_cap_defaults_to_clip_epsilon():
    settings = LossSettings("cispo", kl_beta=0.0)  # cap 1.2: e^0.5 and e^1.5 bite
    _, grad, metrics = loss_and_grad(settings)
    assert_close(grad, f64([[-1.2, -RATIOS[1]], [-1.2 * -2.0, 0.0]]) / 3)
    assert_close(metrics["clip_fraction_high"].item(), 2 / 3)


def test_sapo_gates_the_ratio_softly_by_the_advantages_sign():
    settings = LossSettings("sapo", kl_beta=0.0, sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    taus = [1.0, 1.0, 2.0]
    terms = [-sigmoid(t * (r - 1)) * 4 / t * a for t, r, a in zip(taus, RATIOS, A_OF)]
    loss, grad, metrics = loss_and_grad(settings)
    assert_close(loss, ((terms[0] + terms[1]) / 2 + terms[2]) / 2)  # grpo's per-sequence mean
    # d/dlogp of -f(r) A is -4 sigmoid'(tau (r - 1)) r A; sigmoid' = s (1 - s)
    slopes = [
        -4 * sigmoid(t * (r - 1)) * (1 - sigmoid(t * (r - 1))) * r * a for t, r, a in zip(taus, RATIOS, A_OF)
    ]
    assert_close(grad, f64([[slopes[0] / 4, slopes[1] / 4], [slopes[2] / 2, 0.0]]))
    assert metrics["clip_fraction_low"].item() == metrics["clip_fraction_high"].item() == 0.0


@pytest.mark.parametrize("loss_type", ["sapo", "cispo"])
def test_sapo_and_cispo_give_grpos_gradient_at_ratio_one(loss_type):
    # One pass per rollout: old_logp is the policy's own. cispo's reduction is dapo's.
    reference = "dapo" if loss_type == "cispo" else "grpo"
    _, grad, _ = loss_and_grad(LossSettings(loss_type, kl_beta=0.0), old_logp=None)
    _, expected, _ = loss_and_grad(LossSettings(reference, kl_beta=0.0), old_logp=None)
    assert_close(grad, expected)


def test_sapo_passes_gradcheck():
    torch.manual_seed(4)
    logp = (-torch.rand(3, 4, dtype=F64) * 3).requires_grad_()
    old = logp.detach() - torch.tensor([[0.5, -0.05, 0.05, -0.5]], dtype=F64)
    advantages, mask = f64([1.0, -0.5, 2.0]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    settings = LossSettings("sapo", kl_beta=0.0)
    assert torch.autograd.gradcheck(lambda x: grpo_loss(x, old, None, advantages, mask, settings)[0], (logp,))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_dual_clip_caps_a_negative_advantages_term_at_c_times_its_size(loss_type):
    # Token (1, 0): r = e^1.5 = 4.48 > c = 3 with A = -2, so its term -r A = 8.96 becomes 6 and
    # carries no gradient; the positive advantages' tokens are as PPO clips them.
    plain = [-min(r * a, min(max(r, 0.8), 1.2) * a) for r, a in zip(RATIOS, A_OF)]
    dual = [*plain[:2], min(plain[2], -3.0 * -2.0)]
    assert plain[2] == pytest.approx(2 * math.exp(1.5)) and dual[2] == 6.0
    reduce = {
        "grpo": lambda t: ((t[0] + t[1]) / 2 + t[2]) / 2,
        "dapo": lambda t: sum(t) / 3,
        "dr_grpo": lambda t: sum(t) / 4,
    }[loss_type]
    loss, grad, _ = loss_and_grad(LossSettings(loss_type, kl_beta=0.0, clip_ratio_c=3.0))
    assert_close(loss, reduce(dual))
    assert grad[1, 0].item() == 0.0
    without, plain_grad, _ = loss_and_grad(LossSettings(loss_type, kl_beta=0.0))
    assert_close(without, reduce(plain))
    assert plain_grad[1, 0].item() != 0.0
    assert_close(grad[0], plain_grad[0])  # A > 0: untouched


def test_dual_clip_leaves_a_ratio_below_c_as_ppo_clips_it():
    # r = e^1.5 < c = 5: the term stays -r A (A < 0 and r above the range: the min keeps r A).
    loss, _, _ = loss_and_grad(LossSettings("dapo", kl_beta=0.0, clip_ratio_c=5.0))
    plain, _, _ = loss_and_grad(LossSettings("dapo", kl_beta=0.0))
    assert loss == plain


# ---------------------------------------------------------------------------------------------------
# entropy_coef


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_entropy_gradient_is_the_softmax_entropys_gradient(chunk_size):
    torch.manual_seed(2)
    logits = torch.randn(3, 4, 7, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 7, (3, 4))
    weights = torch.randn(3, 4, dtype=F64)

    def ours(x):
        logp, entropy = token_log_probs_and_entropy(x, targets, 0.7, chunk_size, entropy_grad=True)
        return (logp * weights).sum() + (entropy * weights.flip(0)).sum()

    def by_softmax(x):
        log_softmax = torch.log_softmax(x / 0.7, dim=-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        logp = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return (logp * weights).sum() + (entropy * weights.flip(0)).sum()

    (ours_grad,) = torch.autograd.grad(ours(logits), logits)
    (expected,) = torch.autograd.grad(by_softmax(logits), logits)
    assert_close(ours_grad, expected)
    assert torch.autograd.gradcheck(ours, (logits,))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
def test_entropy_bonus_is_the_coef_times_the_entropy_reduced_as_the_loss(loss_type):
    entropy = f64([[0.7, 1.3], [0.4, float("inf")]]).requires_grad_()  # padding must not count
    # each real token's share of the reduction: grpo and sapo per sequence, dapo and cispo per
    # token, dr_grpo over 2 rows x 2 positions
    shares = {"grpo": [0.25, 0.25, 0.5], "dapo": [1 / 3] * 3, "dr_grpo": [0.25] * 3}
    s = (shares | {"cispo": shares["dapo"], "sapo": shares["grpo"]})[loss_type]
    bonus = entropy_bonus(entropy, torch.tensor(MASK), LossSettings(loss_type, entropy_coef=0.1))
    assert_close(bonus.item(), 0.1 * (0.7 * s[0] + 1.3 * s[1] + 0.4 * s[2]))
    bonus.backward()
    assert_close(entropy.grad, f64([[0.1 * s[0], 0.1 * s[1]], [0.1 * s[2], 0.0]]))


def test_no_entropy_bonus_at_zero_coef():
    entropy = f64([[0.7, 1.3], [0.4, float("nan")]])
    assert entropy_bonus(entropy, torch.tensor(MASK), LossSettings()).item() == 0.0


# ---------------------------------------------------------------------------------------------------
# kl_in_reward

REF = [[-0.8, -1.2], [-1.0, 0.0]]


def test_kl_in_reward_subtracts_beta_times_each_completions_summed_kl():
    rewards = f64([1.0, 0.0])
    # x = ref - old on the real tokens: (0,0) 0.2, (0,1) -0.2, (1,0) 0.7; padding not counted
    expected = f64([1.0 - 0.1 * (k3(0.2) + k3(-0.2)), 0.0 - 0.1 * k3(0.7)])
    got = kl_penalised_rewards(rewards, f64(OLD), f64(REF), torch.tensor(MASK), 0.1, "k3")
    assert_close(got, expected)
    got = kl_penalised_rewards(rewards, f64(OLD), f64(REF), torch.tensor(MASK), 0.1, "k1")
    assert_close(got, f64([1.0 - 0.1 * (-0.2 + 0.2), 0.0 - 0.1 * -0.7]))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
def test_kl_in_reward_leaves_no_kl_term_in_the_loss_but_reports_it(loss_type):
    ref = f64(REF)
    in_reward = LossSettings(loss_type, kl_beta=0.1, kl_in_reward=True)
    loss, grad, metrics = loss_and_grad(in_reward, ref_logp=ref)
    no_kl, no_kl_grad, _ = loss_and_grad(LossSettings(loss_type, kl_beta=0.0))
    assert loss == no_kl and torch.equal(grad, no_kl_grad)
    # the KL metric is of the policy being trained: x = ref - logp = 0.3, -0.1, -0.8
    assert_close(metrics["kl"].item(), (k3(-0.3) + k3(-0.1) + k3(-0.8)) / 3)


# ---------------------------------------------------------------------------------------------------
# every lever split into micro-batches (accumulation, ranks) gives the whole loss

LEVERS = {
    "cispo": dict(loss_type="cispo", clip_epsilon_high=0.1),
    "sapo": dict(loss_type="sapo"),
    "dual_clip_grpo": dict(clip_ratio_c=1.5),
    "dual_clip_dapo": dict(loss_type="dapo", clip_ratio_c=1.5),
    "entropy_grpo": dict(entropy_coef=0.05),
    "entropy_dr_grpo": dict(loss_type="dr_grpo", entropy_coef=0.05),
    "kl_in_reward": dict(kl_in_reward=True),
}


@pytest.mark.parametrize("lever", LEVERS)
def test_micro_batch_weights_make_each_levers_parts_sum_to_the_whole_loss(lever):
    torch.manual_seed(5)
    logp = -torch.rand(4, 6, dtype=F64)
    old = logp - 0.6 * torch.randn(4, 6, dtype=F64)  # ratios well past every clip and cap
    ref = logp - 0.3 * torch.randn(4, 6, dtype=F64)
    entropy = torch.rand(4, 6, dtype=F64)
    advantages = torch.randn(4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    settings = LossSettings(kl_beta=0.1, max_completion_length=6, **LEVERS[lever])

    def loss(rows):
        policy = grpo_loss(logp[rows], old[rows], ref[rows], advantages[rows], mask[rows], settings)[0]
        return policy - entropy_bonus(entropy[rows], mask[rows], settings)

    whole = loss(slice(None))
    parts = [
        micro_batch_weight(settings, mask[rows], mask) * loss(rows) for rows in (slice(0, 1), slice(1, 4))
    ]
    assert_close(parts[0] + parts[1], whole)


# ---------------------------------------------------------------------------------------------------
# combinations refused by name


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(loss_type="forge", clip_ratio_c=3.0), "^clip_ratio_c does not go with loss_type 'forge'"),
        (dict(loss_type="forge", entropy_coef=0.1), "^entropy_coef does not go with loss_type 'forge'"),
        (dict(loss_type="forge", kl_in_reward=True), "^kl_in_reward does not go with loss_type 'forge'"),
        (dict(loss_type="cispo", clip_ratio_c=3.0), "^clip_ratio_c does not go with loss_type 'cispo'"),
        (dict(loss_type="sapo", clip_ratio_c=3.0), "^clip_ratio_c does not go with loss_type 'sapo'"),
        (
            dict(loss_type="sapo", importance_sampling_level="sequence"),
            "^importance_sampling_level does not go with loss_type 'sapo'",
        ),
        (dict(kl_beta=0.0, kl_in_reward=True), "kl_in_reward .* set kl_beta > 0"),
        (dict(clip_ratio_c=1.0), "^clip_ratio_c must be None or > 1"),
        (dict(sapo_temperature_neg=0.0), "^sapo_temperature_neg must be > 0"),
        (dict(entropy_coef=-0.1), "^entropy_coef must be >= 0"),
    ],
)
def test_levers_refuse_what_they_do_not_combine_with_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        LossSettings(**kwargs)
