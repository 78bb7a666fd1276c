"""Credit for the steps of a worked solution: :class:`IntermediateResultsReward`.

A correctness reward pays only for the final number. On a problem that takes several results (a
product, then a sum), a completion that computes the first result right and then goes wrong earns
the same 0 as one that never started, so a policy that rarely gets the whole chain right has
nothing to climb. This reward reads the problem's worked solution, where each step is written
``expression = result`` (the arithmetic task's ``working``; GSM8K's answers, ``<<48/2=24>>24``),
and pays the share of its intermediate results (every result but the last, which is the answer)
that the completion writes after an ``=`` of its own (a tool's result written inline is one).

It is meant beside a correctness reward, in a :class:`~forge_lightning.rewards.CompositeReward`
with the smaller weight: a solution of one step has no intermediate result, and the reward
returns None for it (not applicable: the composite counts it 0); a completion that gets the answer
without writing the steps (one compound expression) earns the correctness part alone.

With ``past_the_steps`` a completion earns its steps' credit only when the answer it gives (read
as the correctness check reads it) is none of the intermediate results: one that stops at a step
(answers the sum the product should follow) earns nothing for the steps it wrote, so the credit
does not pay for stopping early.

With ``right_takes_all`` a completion whose answer is the solution's (its last result) earns the
whole credit, whatever it wrote on the way: one compound expression, the products in another
order, the distributive form. Without it a right answer that does not write the solution's steps
earns less than one that does, and the credit then pays for a form over a right answer; with it
the credit pays only on the way to a right answer.

With ``fade_steps`` the credit falls in a straight line from its whole at the run's first step to
nothing at optimizer step ``fade_steps`` (the ``trainer_state.global_step`` every reward call is
given), after which correctness alone is paid: a credit to find the chains with that is gone before
the late steps, where a policy with little entropy left drifts to what the credit pays for.

With ``within_expressions`` a result also counts as written when an expression the completion
writes before an ``=`` computes it on the way (``50 * 23 + 88 * 23 =`` computes 1150 and 2024, read
as the calculator reads a call, never run): the credit then pays for the steps' quantities in
whichever form they are computed, a chain of calls or one compound expression, and not for the
form.

The arithmetic task gives each problem's working as ``solution`` with
``--data.worked_solutions true``; rows of another dataset give it under their own field's name
(``solution_field``).
"""

from __future__ import annotations

import re
from typing import Any

from forge_lightning.data.gsm8k import NUMBER, extract_answer, normalize_number
from forge_lightning.rewards.calls import BaseReward, RewardOutput
from forge_lightning.rollout.tools.calculator import InlineCalculator, format_number, operation_values

__all__ = ["IntermediateResultsReward", "computed_results", "intermediate_results", "results"]

# A result: the number after an "=", read as the answer's number is (data/gsm8k.py's NUMBER: "$",
# thousands groups, so "= 12,13" is 12, not 1213).
_RESULT = re.compile(rf"=\s*({NUMBER.pattern})")


def results(text: str) -> list[str]:
    """The numbers ``text`` writes after an ``=``, normalized (``"1,200.0"`` -> ``"1200"``), in order."""
    found = (normalize_number(match) for match in _RESULT.findall(text))
    return [number for number in found if number is not None]


def computed_results(text: str) -> list[str]:
    """The values of the operations of each expression ``text`` writes before an ``=`` (as the
    plain-style calculator finds a call's expression there), normalized, in order."""
    calculator = InlineCalculator("plain")
    found: list[str] = []
    for equals in re.finditer("=", text):
        expression = calculator.trigger(text[: equals.end()])
        if expression is not None:
            values = (normalize_number(format_number(value)) for value in operation_values(expression))
            found.extend(value for value in values if value is not None)
    return found


def worked_results(solution: str) -> list[str]:
    """A worked solution's results in order, the last its answer; its text after a GSM8K ``####``
    (the answer line) is not read."""
    return results(solution.split("####", 1)[0])


def intermediate_results(solution: str) -> list[str]:
    """A worked solution's results but its last (the answer), each once, in order."""
    return list(dict.fromkeys(worked_results(solution)[:-1]))


class IntermediateResultsReward(BaseReward):
    """The share of a worked solution's intermediate results a completion writes after an ``=``.

    Args:
        solution_field: the batch column that holds each problem's worked solution ("solution":
            the arithmetic task's, with ``--data.worked_solutions true``).
        past_the_steps: credit the steps only of a completion whose answer is none of the
            intermediate results (one that stopped at a step earns 0).
        right_takes_all: a completion whose answer is the solution's last result earns 1,
            whatever steps it wrote.
        within_expressions: a result computed inside an expression written before an ``=``
            counts as written (one compound expression earns the steps it computes).
        fade_steps: scale the credit by ``1 - step / fade_steps`` (0 from step ``fade_steps`` on),
            the step read from the call's ``trainer_state.global_step``; None: the whole credit
            at every step.
    """

    def __init__(
        self,
        solution_field: str = "solution",
        past_the_steps: bool = False,
        right_takes_all: bool = False,
        within_expressions: bool = False,
        fade_steps: int | None = None,
    ) -> None:
        if not isinstance(solution_field, str) or not solution_field.isidentifier():
            raise ValueError(f"solution_field must be a column's name, got {solution_field!r}")
        flags = (
            ("past_the_steps", past_the_steps),
            ("right_takes_all", right_takes_all),
            ("within_expressions", within_expressions),
        )
        for name, value in flags:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if fade_steps is not None and (
            isinstance(fade_steps, bool) or not isinstance(fade_steps, int) or fade_steps < 1
        ):
            raise ValueError(f"fade_steps must be a whole number of steps >= 1 or None, got {fade_steps!r}")
        self.solution_field = solution_field
        self.past_the_steps = past_the_steps
        self.right_takes_all = right_takes_all
        self.within_expressions = within_expressions
        self.fade_steps = fade_steps
        self.needs = (solution_field,)

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        solutions = kwargs.get(self.solution_field)
        if solutions is None or len(solutions) != len(responses):
            got = "none" if solutions is None else len(solutions)
            raise ValueError(
                f"IntermediateResultsReward needs one {self.solution_field!r} per response, got {got} "
                f"for {len(responses)}"
            )
        scale = self._scale(kwargs.get("trainer_state"))
        scores: list[float | None] = []
        for solution, response in zip(solutions, responses):
            steps = worked_results(str(solution))
            wanted = list(dict.fromkeys(steps[:-1]))
            if not wanted:  # one step: nothing between the problem and its answer
                scores.append(None)
                continue
            answer = extract_answer(response)
            if self.right_takes_all and answer == steps[-1]:
                scores.append(scale)
                continue
            if self.past_the_steps and answer in wanted:  # stopped at a step
                scores.append(0.0)
                continue
            written = set(results(response))
            if self.within_expressions:
                written.update(computed_results(response))
            scores.append(scale * sum(value in written for value in wanted) / len(wanted))
        return RewardOutput(scores=scores)

    def _scale(self, trainer_state: Any) -> float:
        """The share of the credit paid at this call's step (1 without ``fade_steps``)."""
        if self.fade_steps is None:
            return 1.0
        if trainer_state is None:
            raise ValueError(
                "IntermediateResultsReward(fade_steps=...) reads the step from trainer_state, which this "
                "call was not given (the trainer gives it to every reward call)"
            )
        return max(0.0, 1.0 - trainer_state.global_step / self.fade_steps)
