"""What a trainer checks before it uses a rollout server: that the server holds the same model
architecture and tokenizer (not the same weights: those it pushes). Computed the same way on both
ends (``GET /info``'s ``fingerprint``); :func:`differences` names each field that differs, for the
trainer's refusal to connect."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def model_fingerprint(config: Any, named_shapes: Iterable[tuple[str, Iterable[int]]]) -> dict[str, Any]:
    """The model half of a fingerprint: the architecture's sizes and a hash of its parameters'
    names and shapes (not values: the weights are what a push changes)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {
        "model_type": getattr(config, "model_type", None),
        "vocab_size": getattr(text, "vocab_size", None),
        "hidden_size": getattr(text, "hidden_size", None),
        "num_hidden_layers": getattr(text, "num_hidden_layers", None),
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "parameters_sha256": _sha256(sorted((name, list(shape)) for name, shape in named_shapes)),
    }


def tokenizer_fingerprint(tokenizer: Any, eos_ids: Iterable[int]) -> dict[str, Any]:
    """The tokenizer half of a fingerprint: a hash of its vocabulary and its special ids."""
    return {
        "vocab_sha256": _sha256(sorted(tokenizer.get_vocab().items())),
        "eos_token_ids": sorted(int(i) for i in eos_ids),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


def fingerprint(model: Any, tokenizer: Any) -> dict[str, Any]:
    """``{"model": ..., "tokenizer": ...}`` of a loaded policy and its tokenizer; the EOS ids are
    the engine's (the tokenizer's plus the model's generation config's). The parameters are those
    a server's plain model holds (a LoRA policy's base names, a sharded one's full shapes)."""
    from forge_lightning.rollout.engines.hf import eos_token_ids  # transformers: only when used
    from forge_lightning.serving.served_weights import served_shapes

    return {
        "model": model_fingerprint(model.config, served_shapes(model)),
        "tokenizer": tokenizer_fingerprint(tokenizer, eos_token_ids(tokenizer, model)),
    }


def differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], prefix: str = "") -> list[str]:
    """What differs between two fingerprints, one ``"model.hidden_size: 64 here, 32 there"`` per
    field (nested fields by dotted path); empty when they match."""
    out: list[str] = []
    for key in sorted(set(mine) | set(theirs)):
        path = f"{prefix}{key}"
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(differences(a, b, prefix=f"{path}."))
        elif a != b:
            out.append(f"{path}: {a!r} here, {b!r} there")
    return out
