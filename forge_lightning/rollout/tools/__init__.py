"""Tools a completion can call while it is sampled (rollout/tool_sampler.py runs the turns): the inline
calculator, and typed functions or an environment's methods called in a tool-call format."""

from forge_lightning.rollout.tools.calculator import (
    CalculatorError,
    CalculatorStop,
    CalculatorTail,
    CalculatorTools,
    InlineCalculator,
    safe_eval,
)
from forge_lightning.rollout.tools.functions import TOOLS_SYSTEM_PROMPT, FunctionTools
from forge_lightning.rollout.tools.parsers import CALL_FORMATS, HermesToolCalls, ParsedCall

__all__ = [
    "CALL_FORMATS",
    "TOOLS_SYSTEM_PROMPT",
    "CalculatorError",
    "CalculatorStop",
    "CalculatorTail",
    "CalculatorTools",
    "FunctionTools",
    "HermesToolCalls",
    "InlineCalculator",
    "ParsedCall",
    "safe_eval",
]
