"""What a run's tools are, as plain data: the :class:`ToolRecipe` the module's settings make
(settings/assembly.py), from which the trainer builds its tool sampler (in either rollout mode:
with rollout servers the tool loop runs on the trainer's side too). Its functions and factory are
held by reference (their import paths), never with state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forge_lightning.rollout.sampler import RolloutSampler
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools.calculator import CalculatorTools, InlineCalculator
from forge_lightning.rollout.tools.functions import FunctionTools
from forge_lightning.rollout.tools.protocol import ToolProtocol
from forge_lightning.sandbox.pool import Sandbox


@dataclass(frozen=True)
class ToolRecipe:
    """The inline ``calculator`` (its style), or typed ``functions`` and an environment
    ``factory`` called in ``call_format`` (the module's tool settings, of the same names)."""

    calculator: str | None = None
    functions: Sequence[Callable[..., Any]] = ()
    factory: Any = None  # a factory, or a mapping name -> factory
    max_tool_calls: int = 4
    call_format: str = "hermes"
    timeout: float | None = 10.0
    system_prompt: str | None = None
    max_result_chars: int = 10_000
    max_parallel: int = 16

    def runner(self, sampler: RolloutSampler, sandbox: Sandbox | None = None) -> ToolRolloutSampler:
        """The tool sampler around ``sampler``, its calls run in ``sandbox`` where given."""
        if self.calculator is not None:
            calls: ToolProtocol = CalculatorTools(InlineCalculator(self.calculator), sampler.tokenizer)
        else:
            calls = FunctionTools(
                sampler.tokenizer,
                list(self.functions),
                self.factory,
                self.call_format,
                self.timeout,
                self.system_prompt,
                self.max_result_chars,
                self.max_parallel,
                sampler.prompts.chat_template_kwargs,
                sandbox,
            )
        return ToolRolloutSampler(sampler, calls, self.max_tool_calls)
