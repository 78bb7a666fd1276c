"""Rollout correction in a fit: the engine's log-probs as the sampler's, weighed against the trainer's."""

from __future__ import annotations

import math
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from helpers.engines import FixedCompletions
from helpers.rewards import varied

from forge_lightning.grpo import group_advantages
from forge_lightning.rollout.engines.base import Completions, EngineCapabilities, GenerationRequest
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.types import Rollout, completion_mask

pytestmark = pytest.mark.integration  # every test here builds a Trainer or starts a process

RECORDS = [{"prompt": "ab"}, {"prompt": "abc d"}]
CAP = 3.0


class NoisyScores(FixedCompletions):
    """FixedCompletions whose reported log-probs are the trainer's own plus known noise: each
    token's ``0.5 * sin(7 * row + 3 * position)``, less 1.3 on every fourth completion's tokens,
    so that some weights cross the cap of 3 (log 1.0986) token by token and whole completions do."""

    def __init__(self, vocab_size: int, eos: int, temperature: float) -> None:
        super().__init__(vocab_size, eos)
        self.scorer = LogProbScorer(temperature=temperature)
        self.noise: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    capabilities = EngineCapabilities(logprobs=True)

    def generate(self, model, request: GenerationRequest) -> Completions:
        ids = super().generate(model, replace(request, logprobs=False)).ids
        if not request.logprobs:
            return Completions(ids)
        mask = completion_mask(ids, [self.eos])
        rollout = Rollout(
            request.prompt_ids, request.prompt_mask, ids, mask, request.group_size, completions=[]
        )
        rows, cols = torch.meshgrid(torch.arange(ids.shape[0]), torch.arange(ids.shape[1]), indexing="ij")
        wave = 0.5 * torch.sin(7.0 * rows + 3.0 * cols) - 1.3 * (rows % 4 == 0)
        self.noise = wave.to(torch.float64) * mask
        self.mask = mask.bool()
        return Completions(ids, logp=self.scorer.log_probs_no_grad(model, rollout) + self.noise)


def expected_metrics(noise: torch.Tensor, mask: torch.Tensor, mode: str, level: str) -> dict[str, float]:
    """The three logged metrics by the formula, from the noise x = sampler - trainer alone."""
    x = noise[mask]
    log_w = -noise
    if level == "sequence":
        per_row = (log_w * mask).sum(1) / mask.sum(1)
        log_w = per_row[:, None].expand_as(noise)
    w = torch.exp(log_w)[mask]
    kept = w <= CAP if mode == "mask" else torch.ones_like(w, dtype=torch.bool)
    applied = w if mode == "mask" else w.clamp(max=CAP)
    return {
        "train/sampler_kl": float((torch.exp(x) - x - 1).mean()),
        "train/correction_weight_mean": float(applied[kept].mean()),
        "train/correction_masked_fraction": float((~kept).float().mean()),
    }


def fit_once(tmp_path, module, trainer, loader, **settings):
    pl.seed_everything(1)
    grpo = module(kl_beta=0.0, gradient_accumulation_steps=1, reward=varied, **settings)
    grpo.engine = NoisyScores(len(grpo.tokenizer), grpo.tokenizer.eos_token_id, grpo.scorer.temperature)
    grpo.model.double()
    fit = trainer(tmp_path, max_steps=1)
    fit.fit(grpo, loader(RECORDS, batch_size=2))
    return grpo


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_an_engine_with_known_noise_gives_the_correction_metrics_by_hand(
    tmp_path, module, trainer, loader, mode, level
):
    grpo = fit_once(
        tmp_path,
        module,
        trainer,
        loader,
        rollout_correction=mode,
        rollout_correction_level=level,
        rollout_correction_cap=CAP,
    )
    engine = grpo.engine
    want = expected_metrics(engine.noise, engine.mask, mode, level)
    assert mode == "truncate" or want["train/correction_masked_fraction"] > 0  # the noise crosses the cap
    for name, value in want.items():
        assert grpo.last_step.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name


def test_truncated_weights_scale_each_tokens_term_in_the_loss_by_hand(tmp_path, module, trainer, loader):
    grpo = fit_once(tmp_path / "tis", module, trainer, loader, rollout_correction="truncate")
    engine, record = grpo.engine, grpo.last_step
    # One pass: the ratio is 1, so each token's term is -min(w, 3) * A; grpo's mean of means.
    advantages = group_advantages(record.rewards.double(), 4)
    weights = torch.exp(-engine.noise).clamp(max=CAP)
    per_row = (-(weights * advantages[:, None]) * engine.mask).sum(1) / engine.mask.sum(1)
    assert advantages.abs().sum() > 0
    assert record.metrics["train/loss"] == pytest.approx(float(per_row.mean()), rel=1e-5, abs=1e-9)
    plain = fit_once(tmp_path / "plain", module, trainer, loader)
    assert plain.last_step.metrics["train/loss"] == pytest.approx(0.0, abs=1e-7)  # mean of centred A
    assert "train/sampler_kl" not in plain.last_step.metrics


def test_hf_generate_scores_as_the_old_policy_give_the_loss_of_the_trainers_own(
    tmp_path, module, trainer, loader
):
    # use_engine_logprobs on HF generate: the scores it sampled from (top_p 1, top_k 0) are the
    # policy's log-probs at the temperature, so the first step's loss is the recomputed one's.
    def run(root, **settings):
        pl.seed_everything(3)
        grpo = module(kl_beta=0.0, gradient_accumulation_steps=1, num_iterations=2, **settings)
        trainer(root, max_steps=2).fit(grpo, loader(RECORDS[:1], batch_size=1))
        return grpo.last_step.metrics

    trusted, recomputed = run(tmp_path / "a", use_engine_logprobs=True), run(tmp_path / "b")
    for key in ("train/loss", "train/reward", "train/clip_fraction"):
        assert trusted[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key
    # A generation_kwargs key that engine log-probs take leaves the scores the policy's.
    neutral = run(tmp_path / "c", use_engine_logprobs=True, generation_kwargs={"renormalize_logits": True})
    for key in ("train/loss", "train/reward", "train/clip_fraction"):
        assert neutral[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key


def test_the_sampler_kl_of_hf_generate_against_the_trainer_is_about_zero(tmp_path, module, trainer, loader):
    pl.seed_everything(2)
    grpo = module(kl_beta=0.0, gradient_accumulation_steps=1, rollout_correction="mask")
    trainer(tmp_path, max_steps=1).fit(grpo, loader(RECORDS, batch_size=2))
    metrics = grpo.last_step.metrics
    assert 0 <= metrics["train/sampler_kl"] < 1e-6
    assert metrics["train/correction_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["train/correction_masked_fraction"] == 0.0
    assert not math.isnan(metrics["train/loss"])


class PolicyScored:
    """An engine that keeps, for each rollout it samples, its reported log-probs and the policy's
    own at that moment (before the step trains on it)."""

    def __init__(self, engine, temperature: float, eos: int) -> None:
        self.engine, self.eos = engine, eos
        self.scorer = LogProbScorer(temperature=temperature)
        self.sampler_logp = self.policy_logp = self.mask = None
        self.syncs = 0

    capabilities = EngineCapabilities(logprobs=True)

    def generate(self, model, request: GenerationRequest) -> Completions:
        out = self.engine.generate(model, request)
        if request.logprobs:
            mask = completion_mask(out.ids, [self.eos])
            rollout = Rollout(
                request.prompt_ids, request.prompt_mask, out.ids, mask, request.group_size, completions=[]
            )
            self.policy_logp = self.scorer.log_probs_no_grad(model, rollout)
            self.sampler_logp, self.mask = out.logp, mask.bool()
        return out

    def sync_weights(self, model) -> None:
        self.syncs += 1
        self.engine.sync_weights(model)


def test_an_int8_sampler_in_a_step_gives_the_correction_metrics_of_its_own_logprobs(
    tmp_path, module, trainer, loader
):
    from forge_lightning.rollout.engines.registry import generation_backend

    pl.seed_everything(4)
    grpo = module(
        kl_beta=0.0, gradient_accumulation_steps=1, rollout_precision="int8", rollout_correction="truncate"
    )
    engine = generation_backend("hf", grpo.tokenizer, grpo.model, rollout_precision="int8")
    grpo.engine = spy = PolicyScored(engine, grpo.scorer.temperature, grpo.tokenizer.eos_token_id)
    trainer(tmp_path, max_steps=2).fit(grpo, loader(RECORDS * 2, batch_size=2))
    gap = (spy.sampler_logp - spy.policy_logp).double() * spy.mask
    assert gap.abs().max() > 1e-4  # the int8 copy's scores, not the policy's
    assert spy.syncs == 2  # remade after each optimizer step
    want = expected_metrics(gap, spy.mask, "truncate", "token")
    for name, value in want.items():
        assert grpo.last_step.metrics[name] == pytest.approx(value, rel=1e-3, abs=1e-7), name
    assert grpo.last_step.metrics["train/sampler_kl"] > 1e-8


def test_a_module_given_rollout_precision_samples_with_its_low_precision_copy(
    tmp_path, module, trainer, loader
):
    from forge_lightning.rollout.engines.quantized import QuantizedGenerate

    pl.seed_everything(5)
    grpo = module(
        kl_beta=0.0, gradient_accumulation_steps=1, rollout_precision="bf16", rollout_correction="mask"
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader(RECORDS, batch_size=2))
    assert isinstance(grpo.engine, QuantizedGenerate) and grpo.engine.precision == "bf16"
    assert grpo.last_step.metrics["train/sampler_kl"] > 1e-9  # bfloat16 rounding: a gap
