"""The low-precision sampler: a copy of the policy in int8 or bfloat16 whose own log-probs come
with its completions, remade from the policy's weights after each optimizer step."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.quantized import INT8_KERNEL_MAX_ROWS, Int8Linear, QuantizedGenerate
from forge_lightning.rollout.engines.registry import generation_backend
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.types import Rollout, completion_mask
from forge_lightning.settings.checks import validate_hparams

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.9)


def sample(engine, model, tok):
    """Two prompts x 3 completions with the engine's log-probs, and the policy's own for them."""
    batch = tok(["ab", "bca"], return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(0)
    out = engine.generate(
        model, GenerationRequest(batch.input_ids, batch.attention_mask, 3, PARAMS, logprobs=True)
    )
    ids, logp = out.ids, out.logp
    mask = completion_mask(ids, [tok.eos_token_id])
    rollout = Rollout(batch.input_ids, batch.attention_mask, ids, mask, 3, completions=[])
    policy = LogProbScorer(temperature=PARAMS.temperature).log_probs_no_grad(model, rollout)
    return logp, policy, mask.bool()


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_the_low_precision_samplers_logprobs_are_its_own_not_the_policys(precision):
    tok = make_tokenizer()
    model = make_model(len(tok))
    engine = generation_backend("hf", tok, model, rollout_precision=precision)
    assert isinstance(engine, QuantizedGenerate)
    logp, policy, mask = sample(engine, model, tok)
    gap = (logp - policy)[mask].abs()
    assert 1e-4 < gap.max() < 0.5  # another model's scores, close to the policy's
    # The policy is left as it was: plain float32 weights that train.
    assert all(
        type(p.data) is torch.Tensor and p.dtype == torch.float32 and p.requires_grad
        for p in model.parameters()
    )


def test_the_int8_copy_quantizes_every_linear_layer_but_the_lm_head():
    tok = make_tokenizer()
    model = make_model(len(tok))
    engine = generation_backend("hf", tok, model, rollout_precision="int8")
    sample(engine, model, tok)
    copy = engine.sampling_copy
    linear = [m for m in copy.modules() if isinstance(m, Int8Linear)]
    assert len(linear) == 2 * 7  # q, k, v, o, gate, up, down per layer
    for layer in linear:  # int8, one scale per output channel, the activations bfloat16
        assert layer.weight_int8.dtype == torch.int8 and layer.scale.shape == (layer.out_features,)
        assert layer.scale.dtype == torch.bfloat16
    # The head alone stays a bfloat16 nn.Linear, tied to the embedding as the policy's is.
    assert [m for m in copy.modules() if isinstance(m, torch.nn.Linear)] == [copy.lm_head]
    assert copy.lm_head.weight.dtype == torch.bfloat16
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32  # the policy untouched


@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 64])
def test_an_int8_linear_multiplies_by_its_dequantized_weight_with_few_rows_or_many(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = Int8Linear(linear, torch.bfloat16)
    x = torch.randn(rows, 64).bfloat16()
    dequantized = layer.weight_int8.float() * layer.scale.float()[:, None]
    want = x.float() @ dequantized.T + linear.bias.detach().bfloat16().float()
    got = layer(x).float()
    assert got.shape == (rows, 48)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    # ... and the int8 weights stand for the float32 ones to within a step of the (bfloat16) scale.
    assert (dequantized - linear.weight.detach()).abs().max() <= layer.scale.float().max()


def test_sync_weights_remakes_the_copy_from_the_policys_new_weights():
    tok = make_tokenizer()
    model = make_model(len(tok))
    engine = generation_backend("hf", tok, model, rollout_precision="bf16")
    sample(engine, model, tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # an optimizer step that changes the distribution a lot
    stale, policy, mask = sample(engine, model, tok)
    assert (stale - policy)[mask].abs().max() > 0.5
    engine.sync_weights(model)
    fresh, policy, mask = sample(engine, model, tok)
    assert (fresh - policy)[mask].abs().max() < 0.1


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({}, "set rollout_correction"),
        (
            {"rollout_correction": "truncate", "agent": "forge_lightning.examples.calculator_agent.agent"},
            "does not work with rollout_correction: the agent's endpoint reports no log-probs",
        ),
        ({"rollout_correction": "truncate", "generation_backend": "vllm"}, "set generation_backend='hf'"),
    ],
)
def test_an_int8_sampler_is_refused_by_name_where_it_cannot_work(settings, match):
    with pytest.raises(ValueError, match=match):
        validate_hparams({"rollout_precision": "int8", **settings})


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("tools", [{}, {"calculator": "plain"}])
def test_an_int8_sampler_with_rollout_correction_is_accepted(mode, tools):
    validate_hparams(
        {"rollout_precision": "int8", "rollout_correction": "truncate", "rollout_mode": mode, **tools}
    )
