"""What sampling is asked for and what an engine that samples offers: the request every engine's
one ``generate`` takes, the completions it returns and the capabilities it declares; the types the
rollout sampler (rollout/sampler.py), the engines (hf.py, vllm.py, chosen by name in registry.py)
and the rollout servers (serving/) share.

It imports nothing of the package, so each of them can depend on it without depending on another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class EngineOptions:
    """What building an engine takes besides the tokenizer and the EOS ids (registry.py)."""

    gpu_memory_utilization: float = 0.3  # vLLM: the share of GPU memory its engine may take
    precision: str | None = None  # the low-precision copy's, to sample with (quantized.py)


@dataclass
class SamplingParams:
    """How completions are drawn. ``greedy`` (evaluation) ignores temperature, top_p, top_k,
    min_p, repetition_penalty and ``extra``; ``stop`` applies to greedy params too.

    ``min_p`` 0 and ``repetition_penalty`` 1 are off. ``stop``: strings that end a completion right
    after the token that completes the first of them. ``extra``: more settings for the engine, by
    its own names (``GenerationConfig`` fields for HF, ``vllm.SamplingParams`` fields for vLLM;
    rollout/engines/generation_settings.py checks them).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # tuple() would split it into characters
            raise TypeError(f"SamplingParams.stop is a sequence of strings, got the string {self.stop!r}")
        self.stop = tuple(self.stop)  # a config's list


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine does besides sampling completion ids, declared once by the engine (its
    class's ``capabilities``) so that a caller reads it instead of probing for methods."""

    logprobs: bool = False  # reports the log-prob each token was sampled with (``request.logprobs``)
    stop_strings: bool = False  # applies ``SamplingParams.stop`` and reports each row's end
    stop_rule: bool = False  # ends rows where ``request.stop_rule`` says (a tool call); others ignore it
    continues: bool = False  # hands back its KV cache and goes on from one (``request.cache``)

    def check(self, request: GenerationRequest, engine: str) -> None:
        """ValueError naming what ``request`` asks for that the engine ``engine`` cannot give."""
        asked = {
            "logprobs": request.logprobs,
            "stop_strings": bool(request.params.stop),
            "continues": request.continuing,
        }
        missing = [name for name, wanted in asked.items() if wanted and not getattr(self, name)]
        if missing:
            raise ValueError(
                f"{engine} cannot give what the request asks for: its capabilities lack {', '.join(missing)}"
            )


@dataclass
class GenerationRequest:
    """One call of an engine: what to sample from, how, and what to hand back with the ids.

    Plain data, the model aside (``generate(model, request)``): the same request goes to every
    engine, and what an engine can give is its :class:`EngineCapabilities`.
    """

    prompt_ids: Tensor  # (P, Lp) left-padded; continuing (``cache``): the rows whole, (B, L)
    prompt_mask: Tensor  # like prompt_ids; continuing, it may hold zeros anywhere (a row's padding)
    group_size: int  # completions per prompt, groups contiguous in the result; 1 with a cache
    params: SamplingParams
    logprobs: bool = False  # also the log-prob each token was sampled with (``Completions.logp``)
    # The stop rule: HF ``StoppingCriteria`` that end rows early (a tool call: rollout/tool_sampler.py),
    # applied by an engine with the ``stop_rule`` capability; another's rows are cut by the caller.
    stop_rule: Sequence[Any] = ()
    # The caller comes back to these rows with a few more tokens each: hand back the KV cache
    # (``Completions.cache``); set by itself when ``cache`` is given.
    continuing: bool = False
    cache: Any = None  # the KV cache of a previous result's first columns (rows selected) to go on from

    def __post_init__(self) -> None:
        if self.cache is not None:
            self.continuing = True


@dataclass
class Completions:
    """What an engine sampled (the result of every ``generate``), with where each completion ends
    when the engine knows it."""

    ids: Tensor  # (P*G, Lc) groups contiguous, right-padded: the new tokens only
    # (P*G,) long: each row's length, through its EOS or the token that completed its stop
    # string; None: every row ends at its first EOS.
    ends: Tensor | None = None
    logp: Tensor | None = None  # (P*G, Lc) float32 log-prob of each sampled token, when asked
    cache: Any = None  # continuing: the KV cache of the first ``cache.get_seq_length()`` columns


class GenerationBackend(Protocol):
    """What the module needs from a generation engine: one ``generate`` and its capabilities.

    An object whose ``generate`` still takes ``(model, prompt_ids, prompt_mask, group_size,
    params)`` is wrapped by rollout/engines/legacy.py's adapter, with a deprecation warning.
    """

    capabilities: EngineCapabilities

    def generate(self, model: PreTrainedModel, request: GenerationRequest) -> Completions:
        """Sample ``request``: completion ids ``(P*G, Lc)``, groups contiguous, right-padded, and
        what the request asked for that the engine's capabilities give."""
        ...

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Called after every optimizer step; engines holding their own weights copy them here."""
        ...


# Their names before one ``generate`` took a request: every engine is one protocol now.
LogProbGenerationBackend = GenerationBackend
EndsGenerationBackend = GenerationBackend
