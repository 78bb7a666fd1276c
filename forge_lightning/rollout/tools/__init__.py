"""Tools a completion can call while it is sampled (rollout/tool_sampler.py runs the turns): the inline
calculator, and typed functions or an environment's methods called in a tool-call format, many at
once (call_loop.py)."""

from forge_lightning.rollout.tools.calculator import (
    CalculatorError,
    CalculatorStop,
    CalculatorTail,
    CalculatorTools,
    InlineCalculator,
    safe_eval,
)
from forge_lightning.rollout.tools.call_loop import CallLoop
from forge_lightning.rollout.tools.functions import TOOLS_SYSTEM_PROMPT, FunctionTools
from forge_lightning.rollout.tools.parsers import (
    CALL_FORMATS,
    HermesToolCalls,
    Llama3JsonToolCalls,
    ParsedCall,
    Qwen3CoderToolCalls,
)

__all__ = [
    "CALL_FORMATS",
    "TOOLS_SYSTEM_PROMPT",
    "CalculatorError",
    "CalculatorStop",
    "CalculatorTail",
    "CalculatorTools",
    "CallLoop",
    "FunctionTools",
    "HermesToolCalls",
    "InlineCalculator",
    "Llama3JsonToolCalls",
    "ParsedCall",
    "Qwen3CoderToolCalls",
    "safe_eval",
]
