"""The inline calculator reads a call whole or refuses it, never an expression cut short: the
tokenizer here writes one token per character, as the embedded model's writes one per digit, so
a call is many tokens long."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools import InlineCalculator
from forge_lightning.rollout.tools.calculator import (
    MAX_EXPRESSION_CHARS,
    CalculatorStop,
    CalculatorTail,
    CalculatorTools,
)

LONG = "12345 * 6789 + 98765 * 4321"  # 510573770; less its leading 1, 442683770
SUM_40 = " + ".join(["1"] * 40)  # 157 characters: over the calculator's limit
CALL = {"plain": "{} =", "annotation": "<<{}="}


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_plain_call_of_many_tokens_is_read_and_evaluated_whole():
    tok = make_tokenizer()
    tools = CalculatorTools(InlineCalculator("plain"), tok)
    call = tools.call_at(None, ids(tok, f"The total is {LONG} ="))
    answer = tools.answer([(None, call)])[0]

    assert call == LONG
    assert (answer.entry["result"], answer.ok) == ("510573770", True)
    assert tok.decode(answer.ids) == " 510573770"


@pytest.mark.parametrize("style", ["plain", "annotation"])
def test_an_expression_over_the_limit_is_refused_not_evaluated_on_its_last_terms(style):
    assert len(SUM_40) > MAX_EXPRESSION_CHARS
    tok = make_tokenizer()
    tools = CalculatorTools(InlineCalculator(style), tok)
    call = tools.call_at(None, ids(tok, "Count: " + CALL[style].format(SUM_40)))
    answer = tools.answer([(None, call)])[0]

    assert call == SUM_40
    assert (answer.entry["result"], answer.ok) == ("?", False)
    assert answer.entry["arguments"] == {"expression": SUM_40}


def test_a_run_too_long_to_search_is_refused_whole_or_is_no_call():
    # Looking for where a call begins takes time growing as the square of its run's length.
    tok = make_tokenizer()
    tools = CalculatorTools(InlineCalculator("plain"), tok)
    run = " + ".join(["1"] * 400)

    assert tools.call_at(None, ids(tok, f"Count: {run} =")) == run
    assert tools.answer([(None, run)])[0].entry["result"] == "?"
    assert tools.call_at(None, ids(tok, "1 " * 600 + "=")) is None


@pytest.mark.parametrize(
    ("text", "call"),
    [
        ("1.2.3 + 4 =", None),  # not "2.3 + 4": an expression never starts inside a number
        ("3.14.15 * 2 =", None),
        (" ".join(map(str, range(60))) + " + 4 =", "59 + 4"),  # a long run, its call whole
        ("it is 5 =", None),
        ("80,000 * 1.50 =", "80,000 * 1.50"),  # not "000 * 1.50": thousands grouped with commas
        ("costs $1,234,567 - 250 =", "1,234,567 - 250"),
        ("1,2345 * 2 =", None),  # not "2345 * 2": no number begins just after a digit and a comma
        ("1234,567 * 2 =", None),
        ("12,5 + 3 =", None),  # a decimal comma: no call rather than "5 + 3"
        ("He has 3, 100 + 5 =", "100 + 5"),  # a comma and a space end a number
    ],
)
def test_a_plain_call_starts_where_its_first_number_starts(text, call):
    tok = make_tokenizer()
    assert CalculatorTools(InlineCalculator("plain"), tok).call_at(None, ids(tok, text)) == call


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("80,000 * 1.50", "120000"),
        ("(1,000 + 2) * 3", "3006"),
        ("1,000.5 * 2", "2001"),
        ("1,2345 * 2", "?"),
        ("1234,567 * 2", "?"),  # not 1234567: a grouped number starts with one to three digits
        ("1,234,56 + 1", "?"),
        ("1,2", "?"),
    ],
)
@pytest.mark.parametrize("style", ["plain", "annotation"])
def test_thousands_separators_are_read_and_any_other_comma_refused(style, expression, result):
    calculator = InlineCalculator(style)
    text, ok = calculator.respond(expression)
    assert text.strip(" >") == result and ok == (result != "?")


def test_a_long_line_of_prose_ending_with_equals_is_no_annotation_call():
    # GSM8K writes "48/2 = <<48/2=24>>": the "=" before the annotation is text, however long
    # the line before it (read further back than the first window, it is still no call).
    tok = make_tokenizer()
    tools = CalculatorTools(InlineCalculator("annotation"), tok)
    line = "She sold " + "many clips and " * 12 + "then 48/2 ="

    assert tools.call_at(None, ids(tok, line)) is None
    assert tools.call_at(None, ids(tok, line + " <<48/2=")) == "48/2"


@pytest.mark.parametrize("style", ["plain", "annotation"])
def test_the_round_stops_at_a_long_call_written_over_two_rounds(style):
    # The stop reads the completion (an earlier round's tokens and this round's), not the prompt.
    tok = make_tokenizer()
    text = "Count: " + CALL[style].format(SUM_40)
    prompt, earlier, new = ids(tok, "Q: 7"), ids(tok, text[:60]), ids(tok, text[60:])
    no_call = ids(tok, "x" * (len(earlier) + len(new) - 1) + "=")
    rows = torch.tensor([prompt + earlier + new, prompt + no_call])
    stop = CalculatorStop(
        CalculatorTail(InlineCalculator(style), tok), len(prompt) + len(earlier), [60, 60], [True] * 2
    )

    assert stop(rows, None).tolist() == [True, False]


class OneCall:
    """An engine without stopping criteria: each row writes ``call`` and some text, or ``done``
    once the calculator has answered (its text ends with a digit or ``?``)."""

    def __init__(self, tokenizer, call: str) -> None:
        self.tok, self.call = tokenizer, call

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = []
        for row, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(row, mask) if m], skip_special_tokens=True)
            new = " done" if text[-1] in "0123456789?" else f"{self.call} = 1 then"
            rows += [[*ids(self.tok, new), self.tok.eos_token_id]] * request.group_size
        width = max(len(r) for r in rows)
        return Completions(torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows]))

    def sync_weights(self, model) -> None:
        pass


@pytest.mark.parametrize(("expression", "answer", "errors"), [(LONG, "510573770", 0), (SUM_40, "?", 1)])
def test_a_rollout_answers_a_long_call_whole_or_counts_its_refusal(expression, answer, errors):
    tok = make_tokenizer()
    eos = [tok.eos_token_id]
    base = RolloutSampler(tok, OneCall(tok, expression), eos, PromptFormat(use_chat_template=False))
    sampler = ToolRolloutSampler(base, InlineCalculator("plain"))
    rollout = sampler(make_model(len(tok)), ["Q:"], SamplingParams(max_new_tokens=240, greedy=True), 2)

    assert rollout.completions == [f"{expression} = {answer} done"] * 2
    assert rollout.tool_stats["tool_calls"].tolist() == [1, 1]
    assert rollout.tool_stats["tool_errors"].tolist() == [errors] * 2
