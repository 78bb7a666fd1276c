"""What sampling is asked for and what an engine that samples offers: the types the rollout
assembler (rollout.py), the engines (generation.py, vllm_backend.py) and the rollout worker share.

It imports nothing of the package, so each of them can depend on it without depending on another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel


@dataclass
class SamplingParams:
    """How completions are drawn. ``greedy`` ignores temperature/top_p/top_k (used for evaluation)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


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
