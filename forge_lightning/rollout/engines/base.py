"""What sampling is asked for and what an engine that samples offers: the types the rollout
sampler (rollout/sampler.py), the engines (hf.py, vllm.py, chosen by name in registry.py) and the
rollout worker share.

It imports nothing of the package, so each of them can depend on it without depending on another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class EngineOptions:
    """What building an engine takes besides the tokenizer and the EOS ids (registry.py)."""

    gpu_memory_utilization: float = 0.3  # vLLM: the share of GPU memory its engine may take
    precision: str | None = None  # rollout_precision: the low-precision copy's (quantized.py)


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


@dataclass
class Completions:
    """What an engine sampled, with where each completion ends when the engine knows it."""

    ids: Tensor  # (P*G, Lc) groups contiguous, right-padded
    # (P*G,) long: each row's length, through its EOS or the token that completed its stop
    # string; None: every row ends at its first EOS.
    ends: Tensor | None = None
    logp: Tensor | None = None  # (P*G, Lc) float32 log-prob of each sampled token, when asked


class GenerationBackend(Protocol):
    """What the module needs from a generation engine."""

    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
    ) -> Tensor:
        """Return completion token ids ``(P*G, Lc)``, groups contiguous, right-padded."""
        ...

    def sync_weights(self, model: PreTrainedModel) -> None:
        """Called after every optimizer step; engines holding their own weights copy them here."""
        ...


class LogProbGenerationBackend(GenerationBackend, Protocol):
    """A backend that can also report the log-prob it sampled each completion token with."""

    def generate_with_logprobs(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
    ) -> tuple[Tensor, Tensor]:
        """Completion ids as ``generate`` returns them and their log-probs, both ``(P*G, Lc)``."""
        ...


class EndsGenerationBackend(GenerationBackend, Protocol):
    """A backend that reports where each completion ends: needed for stop strings, after which a
    row is padded with the pad token, often the EOS (SmolLM2), so its end cannot be read from it."""

    def generate_with_ends(
        self,
        model: PreTrainedModel,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        params: SamplingParams,
        logprobs: bool = False,
    ) -> Completions:
        """The completions, their ends, and (``logprobs``) their tokens' log-probs."""
        ...
