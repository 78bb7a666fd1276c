"""Checks for the generation settings beyond temperature/top_p/top_k: ``min_p``,
``repetition_penalty``, ``stop`` and ``generation_kwargs`` (SamplingParams.extra, passed to the
engine by its own names).

``generation_kwargs`` are refused by name where the engine sets the key itself (or a model setting
does), where the engine does not know it, and where a value is not plain data (it is stored in
checkpoints and the saved config). Nothing heavy is imported at module level: the config's rules
import this file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

MAX_STOP_STRINGS = 8

# The sampling settings that are the module's own, under the engines' names: "set model.<name>".
_MODEL_SETTINGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}

# key -> why HF generate's engine (generation.HFGenerate) sets it, not generation_kwargs.
HF_OWNED: dict[str, str] = {
    **{key: f"it is a model setting: set model.{name} instead" for key, name in _MODEL_SETTINGS.items()},
    "stop_strings": "it is a model setting: set model.stop instead",
    "max_new_tokens": "it is a model setting: set model.max_new_tokens instead",
    "max_length": "completions are capped by model.max_new_tokens",
    "num_return_sequences": "the engine draws model.group_size completions per prompt",
    "do_sample": "the engine samples (greedy decoding is evaluation's)",
    "eos_token_id": "the engine takes the EOS ids from the tokenizer and model; the mask ends at them",
    "pad_token_id": "the engine pads with the tokenizer's pad token",
    "output_scores": "the engine asks for scores itself (engine log-probs)",
    "output_logits": "the engine reads generate's output itself",
    "return_dict_in_generate": "the engine reads generate's output itself",
    "use_cache": "the engine keeps the KV cache on",
    "synced_gpus": "the engine syncs the ranks of a sharded model itself",
    "streamer": "the engine does not stream",
    "num_beams": "completions are sampled, not beam-searched: GRPO's groups and log-probs assume sampling",
    "num_beam_groups": "completions are sampled, not beam-searched",
    "max_time": "a completion cut off by the clock would look finished, not truncated",
}

# key -> why the vLLM engine (vllm_backend.VLLMGenerate) sets it, not generation_kwargs.
VLLM_OWNED: dict[str, str] = {
    **{key: f"it is a model setting: set model.{name} instead" for key, name in _MODEL_SETTINGS.items()},
    "stop": "it is a model setting: set model.stop instead",
    "max_tokens": "it is a model setting: set model.max_new_tokens instead",
    "n": "the engine draws model.group_size completions per prompt",
    "seed": "the engine seeds each request from torch's generator (seed_everything)",
    "logprobs": "the engine asks for log-probs itself (use_engine_logprobs)",
    "prompt_logprobs": "the engine asks for log-probs itself",
    "stop_token_ids": "the engine stops at the tokenizer's and model's EOS ids; the mask ends at them",
    "ignore_eos": "completions end at their EOS: the mask and the rewards read it",
    "detokenize": "the engine turns vLLM's text on exactly when stop strings need it",
    "include_stop_str_in_output": "the engine keeps stop strings in completions, as HF generate does",
    "output_kind": "the engine reads vLLM's final outputs",
    "truncate_prompt_tokens": "prompts are cut by model.max_prompt_length",
}

# The user-settable fields of ``vllm.SamplingParams`` in the vLLM the project pins (the ``vllm``
# extra: vllm>=0.10.2), for a check where vLLM is not installed; where it is, the engine checks
# again against the installed class (vllm_fields). ``guided_decoding`` is that version's name of
# the later ``structured_outputs``.
VLLM_SAMPLING_FIELDS = (
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logits_processors",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "output_kind",
    "guided_decoding",
    "structured_outputs",
    "logit_bias",
    "allowed_token_ids",
    "extra_args",
    "bad_words",
)


# The extra keys that leave the distribution each token is sampled from as it is: where the
# engine's log-probs stand in for the policy's, which holds only when no
# logits processor reshaped them (typical_p, epsilon/eta cutoffs, n-gram bans, suppressed or biased
# tokens, a minimum length, best_of's pick...). A key not named here is taken to reshape them, so a
# setting added to an engine later is refused until it is known to be harmless.
ENGINE_LOGPROB_NEUTRAL: dict[str, frozenset[str]] = {
    "hf": frozenset(
        {
            "cache_config",
            "cache_implementation",
            "compile_config",
            "continuous_batching_config",
            "disable_compile",
            "low_memory",
            "max_cache_len",
            "output_attentions",
            "output_hidden_states",
            "prefill_chunk_size",
            "renormalize_logits",
        }
    ),
    "vllm": frozenset({"skip_special_tokens", "spaces_between_special_tokens"}),
}


@functools.cache
def hf_fields() -> frozenset[str]:
    """The settings a ``transformers.GenerationConfig`` has: the keys of a default one's dict."""
    from transformers import GenerationConfig

    meta = {"transformers_version"}  # written into the dict, not a setting
    return frozenset(k for k in GenerationConfig().to_dict() if not k.startswith("_") and k not in meta)


def vllm_fields(vllm: ModuleType | None = None) -> frozenset[str]:
    """The fields of the installed ``vllm.SamplingParams`` (a ``msgspec.Struct``), given the
    imported module; the pinned version's (``VLLM_SAMPLING_FIELDS``) where they cannot be read."""
    names = getattr(getattr(vllm, "SamplingParams", None), "__struct_fields__", None)
    if not names:
        return frozenset(VLLM_SAMPLING_FIELDS)
    return frozenset(n for n in names if not n.startswith("_"))


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data: str, int, float, bool, None, or lists and dicts (str or
    int keys) of them."""
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and is_plain(v) for k, v in value.items())
    return False


def check_generation_kwargs(
    kwargs: Mapping[str, Any] | None, backend: str, fields: frozenset[str] | None = None
) -> dict[str, Any]:
    """``kwargs`` as a new dict, once each key is one the engine ``backend`` (``hf`` or ``vllm``)
    takes from the user and each value plain data; a ValueError names the first that is not.
    ``fields``: the engine's known settings (default: ``GenerationConfig``'s for hf, the pinned
    ``vllm.SamplingParams``'s for vllm)."""
    if backend not in ("hf", "vllm"):
        raise ValueError(f"generation_backend must be 'hf' or 'vllm', got {backend!r}")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"generation_kwargs must be a mapping of settings, got {type(kwargs).__name__}")
    owned = HF_OWNED if backend == "hf" else VLLM_OWNED
    known = fields if fields is not None else hf_fields() if backend == "hf" else vllm_fields()
    where = "a transformers GenerationConfig field" if backend == "hf" else "a vllm.SamplingParams field"
    for key, value in kwargs.items():
        if key in owned:
            raise ValueError(f"generation_kwargs.{key} is refused: {owned[key]}")
        if key not in known:
            raise ValueError(f"generation_kwargs.{key} is not {where} ({backend} backend)")
        if not is_plain(value):
            raise ValueError(
                f"generation_kwargs.{key} must be plain data (str, int, float, bool, None, lists and "
                f"dicts of them; it is saved with the checkpoint), got {type(value).__name__}"
            )
    return dict(kwargs)


def valid_min_p(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1


def valid_repetition_penalty(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def valid_stop(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) and s for s in value)
    )


# field -> (predicate, the allowed range in words): the shape of config.RULES.
SAMPLING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "min_p": (valid_min_p, "in [0, 1) (0: off)"),
    "repetition_penalty": (valid_repetition_penalty, "> 0 (1: off)"),
    "stop": (valid_stop, f"a list of at most {MAX_STOP_STRINGS} non-empty strings"),
}


def check_sampling_settings(min_p: float, repetition_penalty: float, stop: Sequence[str]) -> None:
    """Raise a ValueError naming the first of ``min_p``, ``repetition_penalty``, ``stop`` out of range."""
    for name, value in (("min_p", min_p), ("repetition_penalty", repetition_penalty), ("stop", stop)):
        check, allowed = SAMPLING_RULES[name]
        if not check(value):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_engine_logprob_kwargs(kwargs: Mapping[str, Any] | None, backend: str) -> None:
    """Refuse, with ``use_engine_logprobs``, a ``generation_kwargs`` key that may reshape the
    sampling distribution (anything outside :data:`ENGINE_LOGPROB_NEUTRAL`): the engine would report
    log-probs of the reshaped distribution, the loss computes the model's own, and the first step's
    ratio would not be 1."""
    neutral = ENGINE_LOGPROB_NEUTRAL.get(backend, frozenset())
    shaping = sorted(key for key in kwargs or {} if key not in neutral)
    if shaping:
        raise ValueError(
            f"use_engine_logprobs does not go with generation_kwargs {', '.join(shaping)}: "
            "such a setting changes the distribution the engine samples from (as top_p < 1 does), so "
            "its log-probs are not the policy's; drop the key, or set use_engine_logprobs false "
            "(rollout_correction then measures and corrects the sampler's difference). Keys that leave "
            f"the distribution as it is ({backend}): {', '.join(sorted(neutral))}"
        )
