"""Generation settings beyond temperature/top_p/top_k: stop strings (where a completion, its mask
and its text end), min_p, repetition_penalty and generation_kwargs, on HF generate and vLLM (a
fake engine)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.engines import FixedCompletions
from helpers.models import make_model, make_tokenizer
from transformers import LlamaForCausalLM

from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.generation_settings import (
    HF_OWNED,
    MAX_STOP_STRINGS,
    VLLM_OWNED,
    check_generation_kwargs,
    check_sampling_settings,
)
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.engines.vllm import VLLMGenerate, vllm_sampling_params
from forge_lightning.rollout.sampler import PromptFormat, RolloutSampler
from forge_lightning.rollout.tool_sampler import ToolRolloutSampler
from forge_lightning.rollout.tools import InlineCalculator
from forge_lightning.rollout.types import completion_mask

# What the bigram model writes: each character's next one; any other character leads to "3", so
# that a prompt without these characters is answered "3+4=7" and then EOS.
CHAIN = {"3": "+", "+": "4", "4": "=", "=": "7", "7": "<eos>", "=7": "<eos>", "a": "b", "b": "a"}


def bigram_model(tokenizer, chain: dict[str, str] = CHAIN, default: str = "3") -> LlamaForCausalLM:
    """A tiny Llama whose next token depends on the current one alone, along ``chain``, with a
    logit of 30 (sampling at temperature 1 follows it all but surely): its attention and MLP
    outputs are zeroed, its embedding one-hot."""
    size, width = len(tokenizer), 128
    model = make_model(size, hidden_size=width, intermediate_size=64, tie_word_embeddings=False)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(size, width))
        head = torch.zeros(size, width)
        for token in range(size):
            following = chain.get(tokenizer.convert_ids_to_tokens(token), default)
            # The final RMSNorm scales a one-hot row to sqrt(width).
            head[ids(following), token] = 30.0 / width**0.5
        model.lm_head.weight.copy_(head)
    return model


def sampler(tokenizer, generator=None) -> RolloutSampler:
    eos = [tokenizer.eos_token_id]
    generator = generator or HFGenerate(tokenizer.pad_token_id, eos, tokenizer)
    return RolloutSampler(tokenizer, generator, eos, PromptFormat(use_chat_template=False))


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- stop strings on HF generate --


@pytest.mark.parametrize("group_size", [1, 3])  # 3: the prompt is prefilled once for the group
@pytest.mark.parametrize("greedy", [False, True])
def test_a_stop_string_ends_the_mask_at_the_token_that_completes_it_though_pad_is_eos(group_size, greedy):
    tok = make_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id  # the case stop ends exist for
    params = SamplingParams(10, greedy=greedy, stop=("+4",))
    # "xy" is answered "3+4=7", "ab" with "abab..." (no stop): the first's rows are padded.
    rollout = sampler(tok)(bigram_model(tok), ["xy", "ab"], params, group_size)
    stopped, going = slice(0, group_size), slice(group_size, None)

    assert rollout.completions == ["3+4"] * group_size + ["ab" * 5] * group_size
    assert rollout.completion_mask.sum(dim=1).tolist() == [3] * group_size + [10] * group_size
    assert rollout.completion_ids[stopped, :3].tolist() == [ids_of(tok, "3+4")] * group_size
    # After the stop the row is padded with the EOS: read from it, the mask would take one more.
    assert (rollout.completion_ids[stopped, 3:] == tok.eos_token_id).all()
    eos_mask = completion_mask(rollout.completion_ids[stopped], [tok.eos_token_id])
    assert eos_mask.sum(dim=1).tolist() == [4] * group_size
    assert rollout.truncated.tolist() == [False] * group_size + [True] * group_size
    assert rollout.facts()["completion_ids"][stopped] == [ids_of(tok, "3+4")] * group_size
    assert rollout.completion_mask[going].all()


def test_an_earlier_eos_ends_a_row_and_a_stop_string_reaching_into_the_prompt_does_not():
    tok = make_tokenizer()
    # "x" is answered "3+4=7", "4" is answered "=7": its "4=" begins in the prompt.
    rollout = sampler(tok)(bigram_model(tok), ["x", "4"], SamplingParams(10, stop=("4=",)), 1)

    assert rollout.completions == ["3+4=", "=7"]
    assert rollout.completion_mask.sum(dim=1).tolist() == [4, 3]  # "=7" then its EOS
    assert rollout.completion_ids[1, 2].item() == tok.eos_token_id
    assert rollout.truncated.tolist() == [False, False]


def test_a_stop_string_that_completes_on_the_padding_after_an_eos_leaves_the_eos_end():
    tok = make_tokenizer()
    # "><" completes across "<eos><eos>": on the first pad after the row's EOS, which comes first.
    params = SamplingParams(10, stop=("><",))
    rollout = sampler(tok)(bigram_model(tok), ["=", "ab"], params, 1)
    assert rollout.completions == ["7", "ab" * 5]
    assert rollout.completion_mask.sum(dim=1).tolist() == [2, 10]
    assert rollout.truncated.tolist() == [False, True]


@pytest.mark.parametrize(("cap", "truncated"), [(3, True), (4, False)])
def test_a_row_is_truncated_only_when_the_cap_comes_before_its_stop_string(cap, truncated):
    tok = make_tokenizer()
    rollout = sampler(tok)(bigram_model(tok), ["x"], SamplingParams(cap, stop=("=",)), 2)

    assert rollout.completions == ["3+4="[:cap]] * 2
    assert rollout.completion_mask.sum(dim=1).tolist() == [cap] * 2
    assert rollout.truncated.tolist() == [truncated] * 2


def test_the_text_ends_with_the_stop_string_when_the_last_token_writes_past_it():
    tok = make_tokenizer()
    tok.add_tokens(["=7"])  # one token holding the stop's last character and one more
    chain = {**CHAIN, "4": "=7"}
    rollout = sampler(tok)(bigram_model(tok, chain), ["x"], SamplingParams(10, stop=("4=",)), 2)

    assert rollout.completion_ids[0, 3].item() == tok.convert_tokens_to_ids("=7")
    assert rollout.completion_mask.sum(dim=1).tolist() == [4, 4]  # through the "=7" token
    assert rollout.completions == ["3+4="] * 2  # its "7" is dropped from the text
    assert rollout.truncated.tolist() == [False, False]


def test_the_text_ends_with_the_stop_string_that_completes_first():
    tok = make_tokenizer()
    tok.add_tokens(["=7"])  # completes both stop strings, "4=" one character before "=7"
    chain = {**CHAIN, "4": "=7"}
    rollout = sampler(tok)(bigram_model(tok, chain), ["x"], SamplingParams(10, stop=("=7", "4=")), 1)
    assert rollout.completions == ["3+4="]
    assert rollout.completion_mask.sum(dim=1).tolist() == [4]


def test_engine_logprobs_follow_the_stop_and_score_the_sampled_tokens():
    tok = make_tokenizer()
    params = SamplingParams(10, stop=("+4",))
    model = bigram_model(tok)
    rollout = sampler(tok)(model, ["xy", "a"], params, 2, engine_logprobs=True)

    assert rollout.completions == ["3+4"] * 2 + ["ba" * 5] * 2  # the second without its stop
    assert rollout.completion_mask.sum(dim=1).tolist() == [3, 3, 10, 10]
    assert rollout.truncated.tolist() == [False, False, True, True]
    assert rollout.old_logp.shape == rollout.completion_ids.shape
    kept = rollout.old_logp[rollout.completion_mask.bool()]
    assert (kept > -1e-3).all() and (kept <= 0).all()  # each token the model all but surely writes
    request = GenerationRequest(rollout.prompt_ids, rollout.prompt_mask, 2, params, logprobs=True)
    out = HFGenerate(tok.pad_token_id, [tok.eos_token_id], tok).generate(model, request)
    assert torch.equal(out.ids, rollout.completion_ids)


def test_stop_strings_without_a_tokenizer_are_refused():
    tok = make_tokenizer()
    engine = HFGenerate(tok.pad_token_id, [tok.eos_token_id])
    with pytest.raises(ValueError, match="tokenizer"):
        sampler(tok, engine)(bigram_model(tok), ["x"], SamplingParams(4, stop=("=",)), 1)


def test_an_engine_that_does_not_report_ends_is_refused_for_stop_strings():
    tok = make_tokenizer()
    engine = FixedCompletions(len(tok), tok.eos_token_id)
    with pytest.raises(ValueError, match="stop_strings"):
        sampler(tok, engine)(make_model(len(tok)), ["x"], SamplingParams(4, stop=("=",)), 2)


def test_assembling_stopped_completions_without_their_ends_is_refused():
    tok = make_tokenizer()
    ids = torch.tensor([ids_of(tok, "3+4=") + [tok.eos_token_id]])
    with pytest.raises(ValueError, match="ends"):
        sampler(tok).assemble(ids[:, :1], torch.ones_like(ids[:, :1]), ids, 1, SamplingParams(5, stop=("=",)))


def test_a_lone_string_is_not_taken_for_a_list_of_its_characters():
    with pytest.raises(TypeError, match="stop"):
        SamplingParams(4, stop="###")


def test_tool_rollouts_refuse_stop_strings():
    tok = make_tokenizer()
    tools = ToolRolloutSampler(sampler(tok), InlineCalculator("annotation"))
    with pytest.raises(ValueError, match="stop"):
        tools(bigram_model(tok), ["x"], SamplingParams(4, stop=("=",)), 2)


# -- min_p, repetition_penalty and generation_kwargs on HF generate --


def test_sampling_knobs_and_generation_kwargs_reach_the_generation_config():
    engine = HFGenerate(1, [1])
    params = SamplingParams(4, min_p=0.1, repetition_penalty=1.3, extra={"no_repeat_ngram_size": 2})
    config = engine._config(params, 3, False)
    assert (config.min_p, config.repetition_penalty, config.no_repeat_ngram_size) == (0.1, 1.3, 2)
    off = engine._config(SamplingParams(4), 3, False)
    assert (off.min_p, off.repetition_penalty) == (None, None) and not off.no_repeat_ngram_size
    greedy = engine._config(
        SamplingParams(4, greedy=True, min_p=0.1, extra={"no_repeat_ngram_size": 2}), 1, False
    )
    assert (greedy.do_sample, greedy.min_p) == (False, None) and not greedy.no_repeat_ngram_size


def test_min_p_near_one_leaves_only_the_likeliest_token():
    tok = make_tokenizer()
    model, prompts = make_model(len(tok)), ["ab", "cd"]
    greedy = sampler(tok)(model, prompts, SamplingParams(8, greedy=True), 1).completions
    torch.manual_seed(0)
    free = sampler(tok)(model, prompts, SamplingParams(8, temperature=1.5), 1).completions
    torch.manual_seed(0)
    cut = sampler(tok)(model, prompts, SamplingParams(8, temperature=1.5, min_p=0.999), 1).completions
    assert free != greedy and cut == greedy


@pytest.mark.parametrize(
    "setting", [{"repetition_penalty": 1e4}, {"extra": {"no_repeat_ngram_size": 2}}], ids=["penalty", "ngram"]
)
def test_a_setting_against_repeats_changes_what_a_looping_model_writes(setting):
    tok = make_tokenizer()
    model = bigram_model(tok, default="a")  # writes "abab..." from any prompt
    torch.manual_seed(0)
    plain = sampler(tok)(model, ["xy"], SamplingParams(8), 1).completions
    torch.manual_seed(0)
    changed = sampler(tok)(model, ["xy"], SamplingParams(8, **setting), 1).completions
    assert plain == ["abababab"] and changed != plain


# -- generation_kwargs and sampling settings checks --


@pytest.mark.parametrize(
    ("backend", "key"),
    [
        ("hf", "no_such_setting"),
        ("hf", "presence_penalty"),
        ("vllm", "no_such_setting"),
        ("vllm", "num_beams"),
    ],
)
def test_unknown_generation_kwargs_are_refused_by_name(backend, key):
    with pytest.raises(ValueError, match=rf"generation_kwargs\.{key} is not"):
        check_generation_kwargs({key: 1}, backend)


HF_REFUSED = [
    "max_new_tokens",
    "max_length",
    "num_return_sequences",
    "do_sample",
    "eos_token_id",
    "pad_token_id",
    "output_scores",
    "output_logits",
    "return_dict_in_generate",
    "use_cache",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_strings",
    "synced_gpus",
    "streamer",
]
VLLM_REFUSED = ["n", "max_tokens", "seed", "logprobs", "stop_token_ids", "detokenize", "temperature"]
VLLM_REFUSED += ["top_p", "top_k", "min_p", "repetition_penalty", "stop", "include_stop_str_in_output"]


@pytest.mark.parametrize(
    ("backend", "key"), [("hf", k) for k in HF_REFUSED] + [("vllm", k) for k in VLLM_REFUSED]
)
def test_settings_the_engine_owns_are_refused_by_name(backend, key):
    with pytest.raises(ValueError, match=rf"generation_kwargs\.{key} is refused"):
        check_generation_kwargs({key: 1}, backend)


@pytest.mark.parametrize(("backend", "key"), [("hf", "min_p"), ("hf", "stop_strings"), ("vllm", "stop")])
def test_a_refused_sampling_setting_names_the_model_setting_to_use(backend, key):
    owned = HF_OWNED if backend == "hf" else VLLM_OWNED
    expected = {"min_p": "model.min_p", "stop_strings": "model.stop", "stop": "model.stop"}[key]
    assert expected in owned[key]
    with pytest.raises(ValueError, match=expected):
        check_generation_kwargs({key: 0.1}, backend)


@pytest.mark.parametrize(
    "value",
    [(1, 2), {(1,): 2.0}, object(), [1, {"a": {3.0}}]],
    ids=["tuple", "tuple-key", "object", "nested-set"],
)
def test_values_that_are_not_plain_data_are_refused_by_name(value):
    with pytest.raises(ValueError, match=r"generation_kwargs\.suppress_tokens must be plain data"):
        check_generation_kwargs({"suppress_tokens": value}, "hf")


def test_good_generation_kwargs_come_back_as_a_new_dict():
    kwargs = {"no_repeat_ngram_size": 3, "suppress_tokens": [5, 6], "sequence_bias": [[[4], -1.0]]}
    checked = check_generation_kwargs(kwargs, "hf")
    assert checked == kwargs and checked is not kwargs
    assert check_generation_kwargs({"presence_penalty": 0.5, "logit_bias": {5: -2.0}}, "vllm") == {
        "presence_penalty": 0.5,
        "logit_bias": {5: -2.0},
    }
    assert check_generation_kwargs(None, "hf") == {}


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        ((1.0, 1.0, []), "min_p"),
        ((-0.1, 1.0, []), "min_p"),
        ((0.0, 0.0, []), "repetition_penalty"),
        ((0.0, 1.0, "###"), "stop"),
        ((0.0, 1.0, [""]), "stop"),
        ((0.0, 1.0, ["a"] * (MAX_STOP_STRINGS + 1)), "stop"),
    ],
)
def test_sampling_settings_out_of_range_are_refused_by_name(settings, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        check_sampling_settings(*settings)


def test_sampling_settings_in_range_pass():
    check_sampling_settings(0.0, 1.0, [])
    check_sampling_settings(0.05, 1.2, ["</answer>", "\n\n"])


# -- vLLM, through a fake module and engine --


def fake_vllm(fields: tuple[str, ...] | None = None) -> SimpleNamespace:
    """``vllm`` as vllm_sampling_params sees it; ``fields``: its SamplingParams' (a msgspec Struct's
    ``__struct_fields__``), None for a class whose fields cannot be read."""

    class Params(SimpleNamespace):
        pass

    if fields is not None:
        Params.__struct_fields__ = fields
    return SimpleNamespace(SamplingParams=Params)


def test_vllm_gets_min_p_repetition_penalty_stop_strings_and_generation_kwargs():
    params = SamplingParams(
        5, 0.7, min_p=0.05, repetition_penalty=1.2, stop=("</a>",), extra={"min_tokens": 2}
    )
    (request,) = vllm_sampling_params(fake_vllm(), params, 1, 3, [1], logprobs=False)
    assert (request.min_p, request.repetition_penalty, request.min_tokens) == (0.05, 1.2, 2)
    assert request.stop == ["</a>"] and request.include_stop_str_in_output is True
    assert request.detokenize is True  # vLLM matches stop strings on its own text
    assert (request.n, request.max_tokens, request.stop_token_ids) == (3, 5, [1])

    greedy = SamplingParams(
        5, greedy=True, min_p=0.05, repetition_penalty=1.2, stop=("</a>",), extra={"min_tokens": 2}
    )
    (request,) = vllm_sampling_params(fake_vllm(), greedy, 1, 1, [1], logprobs=False)
    assert not {"min_p", "repetition_penalty", "min_tokens"} & set(vars(request))
    assert request.stop == ["</a>"] and request.temperature == 0.0


def test_vllm_generation_kwargs_are_checked_against_the_installed_sampling_params():
    params = SamplingParams(5, extra={"presence_penalty": 0.5})
    (request,) = vllm_sampling_params(fake_vllm(("n", "presence_penalty")), params, 1, 2, [1], False)
    assert request.presence_penalty == 0.5
    with pytest.raises(ValueError, match=r"generation_kwargs\.presence_penalty is not"):
        vllm_sampling_params(fake_vllm(("n", "max_tokens")), params, 1, 2, [1], False)


class ScriptedLLM:
    """``vllm.LLM``'s ``generate``: completion j of every prompt is ``texts[j]``'s tokens."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.rows = [ids_of(tokenizer, t.replace("<eos>", "")) + [1] * t.endswith("<eos>") for t in texts]
        self.requests: list[Any] = []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.requests.append(sampling_params)
        return [
            SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=row, logprobs=None) for row in self.rows[: p.n]]
            )
            for p in sampling_params
        ]

    def apply_model(self, func):
        return []

    def reset_prefix_cache(self) -> None:
        pass


def test_vllm_completion_lengths_are_the_ends_though_pad_is_eos(monkeypatch):
    monkeypatch.setattr("forge_lightning.rollout.engines.vllm.import_vllm", lambda: fake_vllm())
    tok = make_tokenizer()
    engine = ScriptedLLM(tok, ["3+4=", "7<eos>", "3+4+3"])  # a stop, an EOS, the cap
    generator = VLLMGenerate(tok, [1], engine_factory=lambda *args: engine)
    rollout = sampler(tok, generator)(make_model(len(tok)), ["x"], SamplingParams(5, stop=("=",)), 3)

    assert engine.requests[0][0].stop == ["="]
    assert rollout.completion_ids[0, 4].item() == tok.eos_token_id  # its padding
    assert rollout.completion_mask.sum(dim=1).tolist() == [4, 2, 5]
    assert rollout.completions == ["3+4=", "7", "3+4+3"]
    assert rollout.truncated.tolist() == [False, False, True]


@pytest.mark.integration
def test_a_fit_with_stop_strings_trains_and_rewards_each_completion_up_to_its_stop(
    tmp_path, module, trainer, loader
):
    seen: list[tuple[str, list[int], bool]] = []

    def spy(prompts, responses, completion_ids, truncated):
        seen.extend(zip(responses, completion_ids, truncated))
        return [float(len(r)) for r in responses]

    torch.manual_seed(0)
    grpo = module(
        reward=spy, stop=["a", "e", "o"], max_new_tokens=24, group_size=8, gradient_accumulation_steps=1
    )
    trainer(tmp_path, max_steps=1).fit(grpo, loader([{"prompt": "ab"}, {"prompt": "hello"}], batch_size=2))
    decode = grpo.tokenizer.decode
    stopped = [(text, ids, cut) for text, ids, cut in seen if any(s in text for s in "aeo")]
    assert stopped, "no completion wrote a stop string: pick more common ones"
    for text, ids, cut in stopped:
        # The reward's text ends with the stop string; the trained tokens (the mask) run exactly
        # through the token that completes it.
        assert text[-1] in "aeo" and not any(s in text[:-1] for s in "aeo"), text
        assert any(s in decode(ids) for s in "aeo") and not any(s in decode(ids[:-1]) for s in "aeo")
        assert not cut
    assert grpo.last_step.metrics["train/num_tokens"] == sum(len(ids) for _, ids, _ in seen)
