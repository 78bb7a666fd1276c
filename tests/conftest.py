"""Shared fixtures: a tiny Llama and a character tokenizer built in the test, no network."""

from __future__ import annotations

import os

# No test may reach the network: the hub client fails at once instead of retrying for a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import string  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
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


def make_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
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
    return LlamaForCausalLM(config)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture
def tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return make_model(len(tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model + tokenizer saved with save_pretrained: a local-folder model spec."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K files not found at {GSM8K_DIR}")
    return GSM8K_DIR
