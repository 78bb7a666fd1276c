"""Tiny models and tokenizers built in the test: one token per character, a 2-layer Llama,
and a Llama pushed to write a script."""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

# A 2-layer Llama seeded with ``seed``; ``overrides`` replace any of its LlamaConfig fields.
from forge_lightning.testing import tiny_model as make_model

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]

CHARS = list(string.ascii_letters + string.digits + " .,:;?!+-*/=()$%#\n'\"<>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tokenizer(chat_template: bool = False) -> PreTrainedTokenizerFast:
    """One token per character; pad is the EOS, as in SmolLM2."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class ScriptedLlama(LlamaForCausalLM):
    """A tiny Llama pushed hard towards writing ``script`` (token ids from the prompt's first
    token on, then EOS): the logit of the script's token at each position gets +40. The next token
    depends on the position alone, so a round that resumes after a tool's answer picks the script
    up where the answer ends."""

    script: list[int] = []

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is None:  # no padding (generate leaves the mask out): positions follow the cache
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = 0 if cache is None else cache.get_seq_length()
            attention_mask = torch.ones(input_ids.shape[0], past + input_ids.shape[1], dtype=torch.long)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        script = torch.tensor([*self.script, self.config.eos_token_id], device=out.logits.device)
        positions = (attention_mask.cumsum(dim=-1) - 1)[:, -out.logits.shape[1] :]  # (B, T)
        following = script[(positions + 1).clamp(0, len(script) - 1)]
        out.logits = out.logits + 40.0 * torch.nn.functional.one_hot(following, out.logits.shape[-1])
        return out


def scripted(tokenizer, text: str, seed: int = 0) -> ScriptedLlama:
    torch.manual_seed(seed)
    model = ScriptedLlama(make_model(len(tokenizer)).config)
    model.script = tokenizer(text, add_special_tokens=False)["input_ids"]
    return model
