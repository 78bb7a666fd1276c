"""Which models' log-probs may be taken from their final hidden states, through their LM head's
weight a chunk at a time (grpo/linear_log_probs.py), instead of from their own forward's logits.

A forward's logits are (rows, length, vocab): with a large vocabulary, more memory than the rest of
the step's activations. Taking them a chunk at a time from the hidden states is the same
computation only where the model's forward is ``lm_head(decoder(...).last_hidden_state)`` and the
head a plain linear layer; :func:`plain_head_weight` says where.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import PreTrainedModel

from forge_lightning.models.lora import has_adapter
from forge_lightning.models.sharding import is_sharded

# Causal LMs whose forward is ``lm_head(decoder(...).last_hidden_state)`` and nothing after it
# (read in their transformers sources). Others may scale or soft-cap the logits (Gemma 2, Cohere,
# Granite), so they keep their own forward.
PLAIN_HEAD_MODELS = frozenset(
    {
        "GemmaForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Olmo2ForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "SmolLM3ForCausalLM",
    }
)


def plain_head_weight(model: PreTrainedModel) -> Tensor | None:
    """The (V, H) weight of ``model``'s LM head when its logits are ``last_hidden_state @
    weight.T`` and nothing else; None where the model's own forward must make them: a model not
    in PLAIN_HEAD_MODELS, a head that is not a bias-free ``nn.Linear`` (an adapter on it among
    them), a PEFT model other than LoRA, and an FSDP-sharded model (its root unit gathers the
    head's weight only in its own forward), and a model whose ``get_decoder()`` finds no decoder
    (transformers before 4.57 returns None for Llama-style models: their logits path is kept)."""
    if is_sharded(model):
        return None
    base = model
    if has_adapter(model):
        if any(config.peft_type != "LORA" for config in model.peft_config.values()):
            return None
        base = model.get_base_model()
    if type(base).__name__ not in PLAIN_HEAD_MODELS or not isinstance(base.get_decoder(), nn.Module):
        return None
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    return head.weight
