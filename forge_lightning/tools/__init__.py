"""Tools a completion can call while it is sampled (tool_rollout.py runs the turns)."""

from forge_lightning.tools.calculator import (
    CalculatorError,
    CalculatorStop,
    CalculatorTail,
    InlineCalculator,
    safe_eval,
)

__all__ = ["CalculatorError", "CalculatorStop", "CalculatorTail", "InlineCalculator", "safe_eval"]
