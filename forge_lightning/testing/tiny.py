"""A tiny policy built in the test, with no network and no files: a byte-level tokenizer with a
ChatML chat template that renders tools (as Qwen's does), and a 2-layer random Llama. Both build in
milliseconds; what they sample is noise, so a test gives the completions (scripted.py) or trains a
few steps on a task a random model can learn."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# The special tokens first (ids 0, 1, 2), then one token per byte: any text encodes, one token a
# byte, and decodes back as it was.
SPECIAL_TOKENS = ["<pad>", "<|im_end|>", "<|im_start|>"]
# ChatML, with the tools' JSON schemas in a system block of their own where there are any.
CHATML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinyPolicy:
    """A model and its tokenizer, as :func:`tiny_policy` builds them."""

    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerFast


def tiny_tokenizer(chat_template: str | None = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per byte (259 in all); ``<|im_end|>`` (id 1) ends a turn and is the EOS, ``<pad>``
    (id 0) pads. ``chat_template`` None: a tokenizer without one."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template, tokenizer.name_or_path = chat_template, "forge-lightning-tiny"
    return tokenizer


def tiny_model(vocab_size: int = len(SPECIAL_TOKENS) + 256, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden size 32) of ``vocab_size`` tokens (:func:`tiny_tokenizer`'s by
    default), its weights drawn after ``torch.manual_seed(seed)``; ``overrides`` replace any of its
    LlamaConfig fields."""
    torch.manual_seed(seed)
    settings = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **{**settings, **overrides}))


def tiny_policy(seed: int = 0, max_position_embeddings: int = 4096) -> TinyPolicy:
    """:func:`tiny_tokenizer` and a :func:`tiny_model` of its vocabulary, seeded with ``seed``;
    ``max_position_embeddings``: its context, room for a prompt with its tools' schemas."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer), seed, max_position_embeddings=max_position_embeddings)
    return TinyPolicy(model, tokenizer)
