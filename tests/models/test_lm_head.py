"""Which models' log-probs are taken through their head's weight (models/lm_head.py)."""

from __future__ import annotations

from helpers.models import make_model
from transformers import Gemma2Config, Gemma2ForCausalLM

from forge_lightning.models.lm_head import plain_head_weight
from forge_lightning.models.lora import LoraSettings, apply_lora


def test_a_plain_linear_head_gives_its_weight_also_under_a_lora_adapter():
    model = make_model(40)
    assert plain_head_weight(model) is model.lm_head.weight
    wrapped = apply_lora(make_model(40), LoraSettings(r=2))
    assert plain_head_weight(wrapped) is wrapped.get_base_model().lm_head.weight


def test_models_whose_logits_are_more_than_the_head_keep_their_own_forward():
    # Gemma 2 soft-caps its logits after the head.
    config = Gemma2Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    assert plain_head_weight(Gemma2ForCausalLM(config)) is None
    # An adapter on the head itself: the head is no longer a plain linear layer.
    adapted = apply_lora(make_model(40), LoraSettings(r=2, target_modules=["lm_head", "q_proj"]))
    assert plain_head_weight(adapted) is None
