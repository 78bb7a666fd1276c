"""Tools a completion can call while it is sampled (tool_rollout.py runs the turns): the inline
calculator, and typed functions or an environment's methods called in a tool-call format."""

from forge_lightning.tools.calculator import (
    CalculatorError,
    CalculatorStop,
    CalculatorTail,
    CalculatorTools,
    InlineCalculator,
    safe_eval,
)
from forge_lightning.tools.environments import EnvironmentReward
from forge_lightning.tools.functions import TOOLS_SYSTEM_PROMPT, FunctionTools
from forge_lightning.tools.parsers import CALL_FORMATS, HermesToolCalls, ParsedCall

__all__ = [
    "CALL_FORMATS",
    "TOOLS_SYSTEM_PROMPT",
    "CalculatorError",
    "CalculatorStop",
    "CalculatorTail",
    "CalculatorTools",
    "EnvironmentReward",
    "FunctionTools",
    "HermesToolCalls",
    "InlineCalculator",
    "ParsedCall",
    "safe_eval",
]
