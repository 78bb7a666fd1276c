"""Tool-call formats on their model families' real chat templates (fixtures/: Llama 3.1's and
Qwen3-Coder's, as published): the prompt shows the tools, a call written in the family's format
runs and is answered with the template's tool turn, the parser reads every call, a call ends where
the format says, and ``chat_template_kwargs`` reach every rendering."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch
from helpers.engines import TurnEngine
from helpers.tools import GREEDY, SEEN, TOOL_TEMPLATE, add, chat_tokenizer, sampler, split, tiny
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.tools import CALL_FORMATS, FunctionTools, ParsedCall
from forge_lightning.rollout.tools.call_ends import CallStop
from forge_lightning.rollout.tools.protocol import Episode

FIXTURES = Path(__file__).parent / "fixtures"
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))


def family_tokenizer(template: str, special: list[str], added: list[str], eos: str, bos: str | None):
    """One token per printable character, the family's special tokens and its added (not special)
    ones, as its real tokenizer has them; the template read from fixtures/."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", *special, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=eos, pad_token="<pad>", unk_token="<unk>", bos_token=bos
    )
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.add_tokens(added)
    tok.chat_template, tok.name_or_path = (FIXTURES / template).read_text(), template
    return tok


def llama_tokenizer():
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
    return family_tokenizer(
        "llama3.1_chat_template.jinja", [*special, "<|python_tag|>"], [], "<|eot_id|>", "<|begin_of_text|>"
    )


def qwen_coder_tokenizer():
    added = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    return family_tokenizer(
        "qwen3_coder_chat_template.jinja", ["<|im_start|>", "<|im_end|>"], added, "<|im_end|>", None
    )


# Each family: its tokenizer, its format, what begins a tool turn in its template, and what the
# tools add after a call of 2 + 3 (the policy ended its turn with its end-of-turn token).
FAMILIES = {
    "llama3.1": (
        llama_tokenizer,
        "llama3_json",
        "<|start_header_id|>ipython",
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    ),
    "qwen3-coder": (
        qwen_coder_tokenizer,
        "qwen3_coder",
        "<tool_response>",
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n",
    ),
}


def ids_of(tok, text: str) -> list[int]:
    """``text`` as the model writes it: the family's tokens where it has them."""
    return tok(text, add_special_tokens=False)["input_ids"]


def written(tok, turns: list[str]) -> list[list[int]]:
    return [ids_of(tok, turn) for turn in turns]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_call_in_the_familys_format_runs_and_is_answered_with_its_templates_tool_turn(family):
    make, call_format, marker, answer = FAMILIES[family]
    tok = make()
    fmt = CALL_FORMATS[call_format]()
    engine = TurnEngine(tok, written(tok, [fmt.write("add", {"a": 2, "b": 3}), "It is 5."]), marker)
    SEEN.clear()
    rollout = sampler(tok, [add], engine, call_format=call_format)(tiny(tok), ["What is 2+3?"], GREEDY, 2)

    assert SEEN == [{"a": 2, "b": 3}] * 2
    prompt = engine.inputs[0]
    assert '"name": "add"' in prompt or "<name>add</name>" in prompt  # the template shows the tool
    sampled, tools_wrote = split(tok, rollout, 0)
    assert tools_wrote == answer
    assert sampled.startswith(fmt.write("add", {"a": 2, "b": 3})) and sampled.endswith(
        "It is 5." + tok.eos_token
    )
    assert rollout.facts()["tool_calls"][0][0]["result"] == "5"
    assert rollout.tool_stats["turns"].tolist() == [2, 2]


def test_the_llama_parser_reads_every_call_of_the_turn():
    parser = CALL_FORMATS["llama3_json"]()
    turn = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": "{\\"y\\": 2}"}'
    assert parser.parse(turn) == [ParsedCall("a", {"x": 1}), ParsedCall("b", {"y": 2})]
    good, bad = parser.parse('{"name": "a", "parameters": {}} {"name": "b", "parameters": {"x": 1,}}')
    assert good == ParsedCall("a", {}) and bad.startswith("the call is not valid JSON")
    assert parser.parse("It is 5.")[0].startswith("no call found")
    assert parser.has_calls(' {"name": "a", "parameters": {}}')
    assert not parser.has_calls("It is {5}.") and not parser.has_calls('{"answer": 5}')  # no call


def test_the_qwen3_coder_parser_reads_each_value_by_its_schemas_type():
    schemas = FunctionTools(qwen_coder_tokenizer(), [add, echo], call_format="qwen3_coder").schemas[None]
    parser = CALL_FORMATS["qwen3_coder"](schemas)
    turn = (
        "Let me add.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n-3\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=echo>\n<parameter=text>\n12\n"
        "two lines\n</parameter>\n</function>\n</tool_call>"
    )
    assert parser.parse(turn) == [
        ParsedCall("add", {"a": 2, "b": -3}),
        ParsedCall("echo", {"text": "12\ntwo lines"}),
    ]
    assert parser.parse("<tool_call>oops</tool_call>")[0].startswith("a call is <tool_call><function=name>")
    assert parser.parse(parser.write("add", {"a": 1, "b": 2})) == [ParsedCall("add", {"a": 1, "b": 2})]
    on = {"function": {"name": "f", "parameters": {"properties": {"on": {"type": "boolean"}}}}}
    flag = "<tool_call><function=f><parameter=on>\nTrue\n</parameter></function></tool_call>"
    assert CALL_FORMATS["qwen3_coder"]([on]).parse(flag) == [ParsedCall("f", {"on": True})]  # Python's True


def echo(text: str) -> str:
    """Answers its text.

    Args:
        text: anything.
    """
    return text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_turn_of_two_calls_runs_both(family):
    make, call_format, marker, _ = FAMILIES[family]
    tok = make()
    fmt = CALL_FORMATS[call_format]()
    calls = fmt.write("add", {"a": 1, "b": 2}), fmt.write("add", {"a": 3, "b": 4})
    turn = "; ".join(calls) if call_format == "llama3_json" else "\n".join(calls)
    engine = TurnEngine(tok, written(tok, [turn, "3 and 7."]), marker)
    SEEN.clear()
    rollout = sampler(tok, [add], engine, call_format=call_format)(tiny(tok), ["Q"], GREEDY, 1)
    assert sorted(SEEN, key=str) == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [c["result"] for c in rollout.facts()["tool_calls"][0]] == ["3", "7"]
    assert split(tok, rollout, 0)[1].count(marker) == 2  # a result each


def test_a_qwen3_coder_turn_is_read_at_its_end_not_at_its_closing_tag_token():
    tok = qwen_coder_tokenizer()
    tools = FunctionTools(tok, [add], call_format="qwen3_coder")
    call = ids_of(tok, tools.format.write("add", {"a": 2, "b": 3}))
    assert call[-1] == tok.convert_tokens_to_ids("</tool_call>")  # one token, as the model writes it
    eos = [tok.eos_token_id]
    stop = lambda row, enabled=True: CallStop(tools.ends, 0, [0], [enabled], eos)(  # noqa: E731
        torch.tensor([row]), None
    ).tolist()
    assert stop(call) == [False]  # another call may follow
    assert stop([*call, *eos]) == [True]  # generate stops here: the turn ended with its call
    assert stop([*call, *eos], enabled=False) == [False]  # no calls left


def test_a_llama_call_ends_with_its_turn_and_never_mid_turn():
    tok = llama_tokenizer()
    tools = FunctionTools(tok, [add], call_format="llama3_json")
    call = ids_of(tok, tools.format.write("add", {"a": 2, "b": 3}))
    # Nothing stops generate mid-turn: the JSON may go on, and only the end-of-turn token ends it.
    eos = [tok.eos_token_id]
    assert CallStop(tools.ends, 0, [0], [True], eos)(torch.tensor([call]), None).tolist() == [False]
    assert CallStop(tools.ends, 0, [0], [True], eos)(torch.tensor([call + eos]), None).tolist() == [True]
    # At the end of the turn, the turn is the call; prose is no call.
    assert tools.call_at(Episode(), call) == tools.format.write("add", {"a": 2, "b": 3})
    assert tools.call_at(Episode(), ids_of(tok, "It is 5.")) is None


KWARG_TEMPLATE = TOOL_TEMPLATE.replace(
    "<|im_start|>{{ m['role'] }}", "<|im_start|>{{ tool_role if m['role'] == 'tool' else m['role'] }}"
).replace("{%- if tools %}", "{%- if tools %}{{ preamble }}")


def test_chat_template_kwargs_reach_the_prompt_and_every_tool_turn():
    tok = chat_tokenizer(KWARG_TEMPLATE)
    kwargs = {"tool_role": "observation", "preamble": "Today is Monday."}
    engine = TurnEngine(tok, [CALL_FORMATS["hermes"]().write("add", {"a": 1, "b": 1}), "2."], "observation")
    rollout = sampler(tok, [add], engine, template_kwargs=kwargs)(tiny(tok), ["Q"], GREEDY, 1)
    assert engine.inputs[0].startswith("Today is Monday.<|im_start|>system\nTools: add")
    assert split(tok, rollout, 0)[1] == "\n<|im_start|>observation\n2<|im_end|>\n<|im_start|>assistant\n"


def test_llama_31s_tools_in_user_message_kwarg_moves_the_tools_to_the_system_message():
    tok = llama_tokenizer()
    kwargs = {"tools_in_user_message": False, "date_string": "01 Jan 2030"}
    engine = TurnEngine(tok, written(tok, ["It is 2."]), "<|start_header_id|>ipython")
    sampler(tok, [add], engine, call_format="llama3_json", template_kwargs=kwargs)(
        tiny(tok), ["Q"], GREEDY, 1
    )
    system, user = engine.inputs[0].split("<|start_header_id|>user")
    assert "Today Date: 01 Jan 2030" in system and '"name": "add"' in system and "add" not in user


def test_chat_template_kwargs_is_a_module_setting_every_prompt_gets():
    tok = llama_tokenizer()
    kwargs = {"date_string": "01 Jan 2030"}
    grpo = GRPOLightningModule(
        model=tiny(tok), tokenizer=tok, chat_template_kwargs=kwargs, max_prompt_length=500
    )
    grpo.configure_model()
    ids, mask = grpo.episodes.encode(["Q"], torch.device("cpu"))  # training's and validation's prompts
    assert "Today Date: 01 Jan 2030" in tok.decode(ids[0][mask[0].bool()])
    with_tools = GRPOLightningModule(
        model=tiny(tok),
        tokenizer=tok,
        tools=[add],
        tool_call_format="llama3_json",
        chat_template_kwargs=kwargs,
    )
    with_tools.configure_model()
    assert with_tools.episodes.tools.template_kwargs == kwargs
    with pytest.raises(ValueError, match="chat_template_kwargs must be None or a dict"):
        GRPOLightningModule(
            model=tiny(tok), tokenizer=tok, chat_template_kwargs={"add_generation_prompt": False}
        )
