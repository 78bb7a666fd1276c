"""The sampling copies themselves: the bf16 copy computes what the policy cast to bfloat16 computes
(only its attention kernel differs on a CPU), and the int8 copy's layers multiply by their int8
weights, with torch's CPU kernel where it applies and a dequantizing matmul where it does not."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.rollout.engines.quantized import INT8_KERNEL_BLOCK, Int8Linear, low_precision_copy


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


def test_the_bf16_copy_computes_the_policy_cast_to_bfloat16_and_leaves_the_policy_as_it_was():
    tok = make_tokenizer()
    model = make_model(len(tok))
    batch = tok(["ab", "bcab"], return_tensors="pt", padding=True, padding_side="left")
    sampler = low_precision_copy(model, "bf16")
    assert sampler.config._attn_implementation == "eager"  # on a CPU: see cpu_attention
    assert model.config._attn_implementation != "eager"  # the policy keeps its own
    cast = copy.deepcopy(model).to(torch.bfloat16).eval()
    eager = copy.deepcopy(cast)
    eager.set_attn_implementation("eager")
    mask = batch.attention_mask.bool()
    ours = logits(sampler, batch)[mask]
    assert torch.equal(ours, logits(eager, batch)[mask])  # the policy in bfloat16, nothing else
    # Eager attention instead of the model's own (SDPA): a few of bfloat16's rounding steps at most.
    theirs = logits(cast, batch)[mask]
    steps = (ours - theirs).abs().max() / (torch.finfo(torch.bfloat16).eps * theirs.abs().max())
    assert steps <= 4
    assert all(p.dtype == torch.bfloat16 for p in sampler.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("in_features", [2 * INT8_KERNEL_BLOCK, INT8_KERNEL_BLOCK + 8])  # kernel, fallback
def test_an_int8_layer_multiplies_by_its_int8_weights_and_stays_near_the_float_layer(in_features):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 24, bias=True)
    layer = Int8Linear(linear, torch.bfloat16)
    x = torch.randn(3, 5, in_features, dtype=torch.bfloat16)  # (B, T, in)
    out = layer(x)
    assert out.shape == (3, 5, 24) and out.dtype == torch.bfloat16
    dequantized = layer.weight_int8.float() * layer.scale.float()[:, None]  # (out, in)
    exact = x.float() @ dequantized.T + layer.bias.float()
    assert torch.allclose(out.float(), exact, atol=0.05, rtol=0.02)
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127  # (out, 1): each row's int8 step
    assert ((dequantized - linear.weight).abs() <= step).all()  # half a step, and the scale's rounding
    with torch.no_grad():
        assert torch.allclose(out.float(), linear(x.float()), atol=0.1, rtol=0.05)
