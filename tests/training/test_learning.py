"""GRPO makes a model better at a task on problems it never trained on: a tiny model, built here,
learns single-digit addition from the correctness reward alone, and its greedy accuracy on
held-out sums (``val/accuracy``, as ``forge-lightning validate`` reports it) rises."""

from __future__ import annotations

import random

import lightning.pytorch as pl
import pytest
from helpers.models import make_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.library import GSM8KAnswerReward

pytestmark = pytest.mark.integration  # every test here builds a Trainer or starts a process

# "a + b =" -> one token, the sum: 19 number tokens, "+", "=", EOS (also the pad) and unknown.
WORDS = ["<eos>", "<unk>", *(str(n) for n in range(19)), "+", "="]


def word_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"
    )


def addition_model() -> LlamaForCausalLM:
    return make_model(
        len(WORDS), hidden_size=64, intermediate_size=128, num_key_value_heads=4,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def problems(pairs: list[tuple[int, int]]) -> list[dict[str, str]]:
    return [{"prompt": f"{a} + {b} =", "reference": str(a + b)} for a, b in pairs]


def test_grpo_raises_held_out_accuracy_on_single_digit_addition(trainer, loader, tmp_path):
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    held_out, train = pairs[:20], pairs[20:]  # no (a, b) in both
    assert not set(held_out) & set(train)
    pl.seed_everything(0, verbose=False)
    grpo = GRPOLightningModule(
        model=addition_model(),
        tokenizer=word_tokenizer(),
        reward=GSM8KAnswerReward(),  # correctness only
        group_size=16,
        max_new_tokens=1,
        temperature=1.0,
        use_chat_template=False,
        learning_rate=3e-3,
        weight_decay=0.1,
        lr_schedule="constant",
        gradient_accumulation_steps=1,
        kl_beta=0.0,
    )
    fit = trainer(tmp_path, max_epochs=150, limit_val_batches=1.0, num_sanity_val_steps=0)
    validation = loader(problems(held_out), batch_size=len(held_out))

    def held_out_accuracy() -> float:
        return fit.validate(grpo, validation, verbose=False)[0]["val/accuracy"]

    before = held_out_accuracy()
    fit.fit(grpo, loader(problems(train), batch_size=len(train)))
    after = held_out_accuracy()
    assert before <= 0.2
    assert after >= 0.5, (before, after)
