"""An agent written against the OpenAI SDK, trained as it is (``--model.agent``)::

    forge-lightning fit --config configs/smoke.yaml \\
        --model.agent forge_lightning.examples.calculator_agent.agent

Two tools: ``calculate`` evaluates an arithmetic expression (the calculator's safe evaluator,
rollout/tools/calculator.py: the model's text is parsed into numbers and ``+ - * /``, never run),
``answer`` submits the final number. ``calculate`` and ``answer`` are also plain function tools,
so that the built-in tool loop can run the same episodes (``python -m forge_lightning.bench
--endpoint-compare``). The agent offers both, runs the calls the model makes, sends
back their results, and stops at an answer, a turn with no call, or ``MAX_TURNS``. Its return
value, 1.0 for the row's reference answer and 0.0 otherwise, is the episode's reward.
"""

from __future__ import annotations

import json
from typing import Any

from forge_lightning.data.gsm8k import extract_answer, normalize_number
from forge_lightning.rollout.sampler import prompt_text
from forge_lightning.rollout.tools.calculator import CalculatorError, format_number, safe_eval

MAX_TURNS = 4

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (41 + 29) * 2"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Submit the final answer, a number.",
            "parameters": {
                "type": "object",
                "properties": {"value": {"type": "string", "description": "the answer"}},
                "required": ["value"],
            },
        },
    },
]


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression, e.g. (41 + 29) * 2
    """
    try:
        return format_number(safe_eval(str(expression)))
    except CalculatorError as err:
        return f"error: {err}"


def answer(value: str) -> str:
    """Submit the final answer, a number.

    Args:
        value: the answer
    """
    return "submitted"


async def agent(client: Any, row: dict[str, Any]) -> float:
    """Solve ``row["prompt"]`` with the two tools; 1.0 when the answer is ``row["reference"]``."""
    messages: list[Any] = [{"role": "user", "content": prompt_text(row["prompt"])}]
    answer = None
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            answer = extract_answer(message.content or "")
            break
        for call in message.tool_calls:
            arguments = _arguments(call.function.arguments)
            if call.function.name == "answer":
                answer = normalize_number(str(arguments.get("value", "")))
                result = "submitted"
            elif call.function.name == "calculate":
                result = calculate(arguments.get("expression", ""))
            else:
                result = f"error: no tool named {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if answer is not None:
            break
    reference = normalize_number(str(row.get("reference", "")))
    return 1.0 if answer is not None and answer == reference else 0.0


def _arguments(text: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return arguments if isinstance(arguments, dict) else {}
