"""The inline calculator and tool-using rollouts: the expression grammar, the calls in both styles,
the tool's tokens in the completion but out of the loss, and a fit with the calculator on."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engines import CalculatorCalls
from helpers.models import make_model, make_tokenizer, scripted
from helpers.tools import CallsAtLengths, tool_sampler

from forge_lightning.callbacks import RewardLogger
from forge_lightning.grpo import LossSettings, grpo_loss, loss_normalizer
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.engines.base import (
    Completions,
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
)
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools import CalculatorError, InlineCalculator, safe_eval
from forge_lightning.rollout.tools.calculator import CalculatorStop, CalculatorTail, operation_values

GREEDY = SamplingParams(max_new_tokens=40, greedy=True)


@pytest.mark.parametrize(
    ("expr", "value"),
    [("41 + 29", 70), ("12 x 13", 156), ("12×13", 156), ("(3+4)*2", 14), ("7/2", 3.5), ("6/3", 2)]
    + [("1/3", 0.333333), ("-5 + +2", -3), ("0.1+0.2", 0.3)],
)
def test_safe_eval_computes_arithmetic(expr, value):
    result = safe_eval(expr)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    "expr",
    ["a + 1", "abs(-1)", "(1).real", "[1][0]", "2**3", "5//2", "1 < 2", "~1", "1e13", "1000000 * 2000000"]
    + ["1/0", "", "3x + 4", "__import__('os')", "1" * 101, "1e400"],
)
def test_safe_eval_refuses_what_is_not_small_arithmetic(expr):
    with pytest.raises(CalculatorError):
        safe_eval(expr)


def test_operation_values_are_each_operations_value_inner_first():
    assert operation_values("50 * 23 + 88 * 23") == [1150, 2024, 3174]
    assert operation_values("(50 + 88) x 23") == [138, 3174]
    assert operation_values("-(7 / 2) + 1,000") == [3.5, 996.5]
    assert operation_values("42") == []  # no operation
    # Refused whole, as safe_eval refuses it: nothing of it is read.
    assert operation_values("6 * 7 + 1/0") == [] and operation_values("2**3 + 1") == []
    assert operation_values("__import__('os') * 2") == []


@pytest.mark.parametrize("expr", ["1234,567 * 2", "1,2", "1,234,56 + 1", "(1, 2)"])
def test_a_comma_that_groups_no_thousands_is_refused_by_name(expr):
    with pytest.raises(CalculatorError, match="a comma that groups no thousands"):
        safe_eval(expr)


def test_annotation_calls_end_with_an_open_annotation():
    calc = InlineCalculator("annotation")
    assert calc.trigger("She pays <<48/2=") == "48/2"
    assert calc.trigger("<<48/2=24>> then") is None
    assert calc.trigger("41 + 29 =") is None
    assert calc.respond("48/2") == ("24>>", True)
    assert calc.respond("48^2") == ("?>>", False)


def test_plain_calls_end_with_an_expression_and_an_equals_sign():
    calc = InlineCalculator("plain")
    assert calc.trigger("so 41 + 29 =") == "41 + 29"
    assert calc.trigger("a box of 3 x 4 =") == "3 x 4"
    assert calc.trigger("total. (3+4)*2=") == "(3+4)*2"
    assert calc.trigger("it is 5 =") is None  # no operator
    assert calc.trigger("3x + 4 =") is None  # algebra, not arithmetic
    assert calc.trigger("41 + 29 = 70") is None
    assert calc.respond("41 + 29") == (" 70", True)


def test_a_tail_of_many_spaced_operators_is_refused_at_once():
    # A pattern with a \s* on each side of every operator took exponential time on this sampled
    # text (20 repetitions ran for over a minute): this call would not return.
    calc = InlineCalculator("plain")
    assert calc.trigger("1 +  " * 40 + "x =") is None
    assert calc.trigger("then 12 13 + 4 =") == "13 + 4"


def test_a_numbered_list_item_is_not_part_of_the_expression():
    # Seen in the embedded model's answers: "3. 68 / 11 =" was read as "3. 68 / 11", refused.
    calc = InlineCalculator("plain")
    assert calc.trigger("3. 68 / 11 =") == "68 / 11"
    assert calc.trigger("2.  50 * 51 =") == "50 * 51"
    assert calc.trigger("so 1.5 * 4 =") == "1.5 * 4"


def spans(rollout, row: int) -> tuple[str, str]:
    """Row ``row``'s sampled text and the tools' text, each decoded from its own tokens."""
    tok = make_tokenizer()
    ids, real, sampled = (
        t[row].tolist() for t in (rollout.completion_ids, rollout.completion_mask, rollout.model_mask)
    )
    model = [i for i, r, s in zip(ids, real, sampled) if r and s]
    tool = [i for i, r, s in zip(ids, real, sampled) if r and not s]
    return tok.decode(model, skip_special_tokens=True), tok.decode(tool, skip_special_tokens=True)


def test_generate_stops_at_a_call_and_the_calculator_writes_the_answer():
    tok = make_tokenizer()
    # The model would write 7 after "<<2*3=": the 6 in the transcript is the calculator's.
    model = scripted(tok, "Q:<<2*3=7>> so 6")
    rollout = tool_sampler(tok)(model, ["Q:", "Q:"], GREEDY, 2)

    assert rollout.completions == ["<<2*3=6>> so 6"] * 4
    assert spans(rollout, 0) == ("<<2*3= so 6", "6>>")
    assert rollout.tool_stats["tool_calls"].tolist() == [1] * 4
    assert rollout.tool_stats["turns"].tolist() == [2] * 4
    assert rollout.tool_stats["tool_errors"].tolist() == [0] * 4
    # 6 tokens to the call, the 3 of the answer, 5 more and the EOS: all in the completion, the
    # answer's out of the loss, and the lengths count what the policy sampled.
    assert rollout.completion_mask.sum(dim=1).tolist() == [15] * 4
    assert rollout.loss_mask().sum(dim=1).tolist() == [12] * 4
    assert rollout.completion_lengths.tolist() == [12] * 4
    assert not rollout.truncation.any()
    assert not (rollout.loss_mask() & ~rollout.model_mask.bool()).any()


def test_the_round_stop_is_the_calculators_not_a_later_eos():
    tok = make_tokenizer()
    model = scripted(tok, "Q:<<2*3=7>> so 6")
    tail = CalculatorTail(InlineCalculator("annotation"), tok)
    prompt = torch.tensor([tok("Q:", add_special_tokens=False)["input_ids"]])
    stop = [CalculatorStop(tail, 2, [0], [True])]
    request = GenerationRequest(prompt, torch.ones_like(prompt), 1, GREEDY, stop_rule=stop)
    out = HFGenerate(tok.pad_token_id, [tok.eos_token_id]).generate(model, request).ids
    assert tok.decode(out[0].tolist(), skip_special_tokens=True) == "<<2*3="


class TextEngine:
    """A generation engine that continues each row's text (prompt and completion so far) with
    ``continuation(text)`` then EOS, G times; it knows no stopping criteria, so the sampler must cut
    each row at its call itself."""

    def __init__(self, tokenizer, continuation) -> None:
        self.tok, self.continuation, self.inputs = tokenizer, continuation, []

    capabilities = EngineCapabilities()

    def generate(self, model, request: GenerationRequest) -> Completions:
        rows = []
        for ids, mask in zip(request.prompt_ids.tolist(), request.prompt_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            self.inputs.append(text)
            new = self.tok(self.continuation(text), add_special_tokens=False)["input_ids"]
            rows += [[*new, self.tok.eos_token_id][: request.params.max_new_tokens]] * request.group_size
        width = max(len(r) for r in rows)
        return Completions(torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows]))

    def sync_weights(self, model) -> None:
        pass


def test_an_engine_without_stops_is_cut_at_the_call_and_the_reward_sees_the_answer():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: " ok" if text.endswith(">>") else "<<41+29=99>> no")
    rollout = tool_sampler(tok, engine)(make_model(len(tok)), ["Q:"], GREEDY, 2)

    assert rollout.completions == ["<<41+29=70>> ok"] * 2
    assert engine.inputs == ["Q:", "Q:<<41+29=70>>", "Q:<<41+29=70>>"]  # round 2: a row at a time
    assert spans(rollout, 1) == ("<<41+29= ok", "70>>")


def test_max_tool_calls_holds_and_a_later_call_is_just_text():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: "<<1+1=")
    rollout = tool_sampler(tok, engine, max_tool_calls=2)(make_model(len(tok)), ["Q:"], GREEDY, 2)

    assert rollout.completions == ["<<1+1=2>><<1+1=2>><<1+1="] * 2
    assert rollout.tool_stats["tool_calls"].tolist() == [2, 2]
    assert rollout.tool_stats["turns"].tolist() == [3, 3]


def test_a_malformed_expression_is_counted_and_the_episode_goes_on():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: " fine" if text.endswith("?>>") else "<<2+*3=")
    rollout = tool_sampler(tok, engine)(make_model(len(tok)), ["Q:"], GREEDY, 2)

    assert rollout.completions == ["<<2+*3=?>> fine"] * 2
    assert rollout.tool_stats["tool_errors"].tolist() == [1, 1]
    assert rollout.tool_stats["tool_calls"].tolist() == [1, 1]


def test_plain_style_calls_append_the_result_after_a_space():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: "." if text.endswith("70") else "41 + 29 =")
    rollout = tool_sampler(tok, engine, style="plain")(make_model(len(tok)), ["Q:"], GREEDY, 2)
    assert rollout.completions == ["41 + 29 = 70."] * 2


def test_an_answer_crossing_the_budget_is_cut_and_the_completion_truncated():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: "<<123*1000=")  # 11 tokens, then "123000>>"
    params = SamplingParams(max_new_tokens=13, greedy=True)
    rollout = tool_sampler(tok, engine)(make_model(len(tok)), ["Q:"], params, 2)

    assert rollout.completions == ["<<123*1000=12"] * 2
    assert rollout.completion_mask.sum(dim=1).tolist() == [13, 13]
    assert rollout.truncation.tolist() == [True, True]


def test_a_call_is_not_looked_for_in_the_prompt():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: " done")
    rollout = tool_sampler(tok, engine)(make_model(len(tok)), ["Q: <<2*3="], GREEDY, 2)
    assert rollout.completions == [" done"] * 2
    assert rollout.tool_stats["tool_calls"].tolist() == [0, 0]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "forge"])
def test_tool_tokens_get_exactly_zero_policy_and_kl_weight(loss_type):
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: " so" if text.endswith(">>") else "<<2*3=")
    rollout = tool_sampler(tok, engine)(make_model(len(tok)), ["Q:"], GREEDY, 2)
    mask, tool = rollout.loss_mask(), rollout.completion_mask.bool() & ~rollout.model_mask.bool()
    assert tool.sum() == 2 * 3  # "6>>" in each row
    settings = LossSettings(loss_type=loss_type, kl_beta=0.1)
    torch.manual_seed(0)
    logp = (-torch.rand(mask.shape, dtype=torch.float64)).requires_grad_()
    ref_logp, old_logp = -torch.rand_like(logp), logp.detach() - 0.05 * torch.rand_like(logp)
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)

    loss, _ = grpo_loss(logp, old_logp, ref_logp, advantages, mask, settings)
    loss.backward()
    assert (logp.grad[tool] == 0).all()
    assert (logp.grad[mask] != 0).any()
    shaken = logp.detach() + 5.0 * tool  # the tool's positions moved far, the rest unchanged
    again, _ = grpo_loss(shaken, old_logp, ref_logp, advantages, mask, settings)
    assert again.item() == loss.item()
    if loss_type == "dapo":  # a token-count normaliser counts the policy's tokens only
        assert loss_normalizer(settings, mask) == rollout.completion_mask.sum() - tool.sum()


def test_a_selected_group_keeps_its_model_mask_and_tool_counts():
    tok = make_tokenizer()
    engine = TextEngine(tok, lambda text: " so" if text.endswith(">>") else "<<2*3=")
    rollout = tool_sampler(tok, engine)(make_model(len(tok)), ["Q:", "R:"], GREEDY, 2)
    picked = rollout.select_groups(torch.tensor([False, True]))
    torch.testing.assert_close(picked.model_mask, rollout.model_mask[2:])
    assert picked.tool_stats["tool_calls"].tolist() == [1, 1]
    facts = picked.facts()
    assert facts["completion_lengths"] == [10, 10]  # "<<2*3=", " so", EOS: the policy's tokens
    assert [len(ids) for ids in facts["completion_ids"]] == [13, 13]  # with the tool's "6>>"


@pytest.mark.integration
def test_a_fit_with_the_calculator_trains_on_its_transcripts(tmp_path, trainer, loader):
    tok = make_tokenizer()
    seen: list[str] = []

    def reward(prompts, responses, **kwargs):
        seen.extend(responses)
        return [float("6>>" in r) + 0.1 * len(r) for r in responses]

    grpo = GRPOLightningModule(
        model=scripted(tok, "Q:<<2*3=7>> ok"),
        tokenizer=tok,
        reward=reward,
        calculator="annotation",
        group_size=2,
        max_new_tokens=16,
        kl_beta=0.0,
        temperature=1.0,
        learning_rate=1e-3,
        gradient_accumulation_steps=1,
    )
    fit = trainer(
        tmp_path,
        max_steps=2,
        callbacks=[RewardLogger(logging_steps=1)],
        num_sanity_val_steps=0,
        val_check_interval=2,
    )
    fit.fit(grpo, loader([{"prompt": "Q:"}] * 4), loader([{"prompt": "Q:", "reference": "6"}]))

    assert fit.global_step == 2
    assert isinstance(grpo.episodes, ToolRolloutSampler)
    assert any("<<2*3=6>>" in r for r in seen)
    metrics = grpo.last_step.metrics
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    # One call per completion, two rounds, and the answer's tokens a share of each completion.
    assert metrics["train/tool_calls"] == 1.0 and metrics["train/turns"] == 2.0
    assert metrics["train/tool_errors"] == 0.0
    assert 0.0 < metrics["train/tool_token_fraction"] < 1.0
    # The run's JSON lines carry them too, for curves drawn from the log.
    lines = [json.loads(line) for line in (tmp_path / "training_log.jsonl").read_text().splitlines()]
    assert [line["tool_calls"] for line in lines] == [1.0, 1.0] and lines[-1]["turns"] == 2.0
    # Validation runs the same loop (greedy); its answers hold the calls and the transcript.
    (answer,) = [
        json.loads(line) for line in (tmp_path / "validation" / "step-2.jsonl").read_text().splitlines()
    ]
    assert answer["completion"] == "<<2*3=6>> ok" and answer["correct"] == 1.0
    assert answer["tool_calls"] == [
        {"name": "calculator", "arguments": {"expression": "2*3"}, "result": "6", "ok": True}
    ]
    assert answer["messages"] == [{"role": "assistant", "content": "<<2*3=6>> ok"}]


def test_the_calculator_engine_takes_as_many_rounds_as_its_script_says():
    tok = make_tokenizer()
    rollout = tool_sampler(tok, CalculatorCalls(tok))(make_model(len(tok)), ["ab", "abc d"], GREEDY, 3)

    assert rollout.completions[:3] == ["#0 ok", "#1<<1+0=1>> okb", "#2<<2+0=2>><<2+1=3>> okaa"]
    assert rollout.completions[3:] == ["#0 ok", "#1 okb", "#2 okaa"]
    assert rollout.tool_stats["turns"].tolist() == [1, 2, 3, 1, 1, 1]


@pytest.mark.integration
def test_accumulated_tool_batches_give_the_gradient_of_one_batch_holding_them(step_gradients):
    # Prompt "ab" takes three rounds, "abc d" one: accumulation must still sum what one batch does.
    settings = dict(fixed="calculator", calculator="annotation", max_new_tokens=24, group_size=3)
    loss, one = step_gradients(batch_size=2, **settings)
    _, two = step_gradients(batch_size=1, gradient_accumulation_steps=2, **settings)
    assert any(g.abs().sum() > 0 for g in one)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


def test_a_resumed_run_cannot_change_its_tool_settings():
    from forge_lightning.run.resume import check_resume_settings
    from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME

    saved = {"calculator": "plain", "max_tool_calls": 4, "learning_rate": 1e-5}
    with pytest.raises(
        ValueError, match=r"(?s)model.calculator: 'plain' -> None.*model.max_tool_calls: 4 -> 2"
    ):
        check_resume_settings(
            saved,
            {"calculator": None, "max_tool_calls": 2, "learning_rate": 1e-5},
            changeable=CHANGEABLE_ON_RESUME,
        )


@pytest.mark.parametrize("group_size", [1, 3])
def test_rounds_going_on_from_the_cache_sample_what_rounds_read_whole_do(group_size):
    # A random model, greedy: any slip in the cached rounds' positions, masks or cache rows
    # changes its next tokens. Rows reach calls at different times, so rounds are cut mid-writing.
    tok = make_tokenizer()
    model = make_model(len(tok), seed=3, initializer_range=0.5)  # large weights: chaotic logits
    params = SamplingParams(max_new_tokens=30, greedy=True)
    rollouts = []
    for continues in (True, False):
        sampler = tool_sampler(tok, max_tool_calls=3)
        sampler.tools = CallsAtLengths(tok, {3, 9, 16})
        sampler._engine_continues = continues
        rollouts.append(sampler(model, ["ab", "hello there", "q"], params, group_size))
    cached, whole = rollouts
    assert cached.completions == whole.completions
    assert torch.equal(cached.completion_ids, whole.completion_ids)
    assert torch.equal(cached.model_mask, whole.model_mask)
    assert cached.tool_stats["tool_calls"].tolist() == whole.tool_stats["tool_calls"].tolist()
    assert cached.tool_stats["tool_calls"].sum() > 0


@pytest.mark.integration
def test_a_lora_policy_samples_and_trains_with_the_calculator(tmp_path, trainer, loader):
    pytest.importorskip("peft")
    from forge_lightning.models.lora import LoraSettings

    tok = make_tokenizer()
    grpo = GRPOLightningModule(
        model=scripted(tok, "Q:<<2*3=7>> ok"),
        tokenizer=tok,
        reward=lambda prompts, responses: [float(len(set(r))) for r in responses],
        calculator="annotation",
        peft=LoraSettings(r=4, alpha=8, dropout=0.0),
        group_size=2,
        max_new_tokens=16,
        kl_beta=0.05,  # the reference is the policy with its adapter off
        temperature=1.0,
        learning_rate=1e-2,
        gradient_accumulation_steps=1,
    )
    fit = trainer(tmp_path, max_steps=2)
    fit.fit(grpo, loader([{"prompt": "Q:"}] * 4))

    metrics = grpo.last_step.metrics
    assert fit.global_step == 2 and metrics["train/tool_calls"] == 1.0
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert any(".lora_" in n for n, _ in grpo.model.named_parameters())
