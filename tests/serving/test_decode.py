"""The rollout server's decode loop (serving/decode.py): the in-process engine's samples exactly,
continuous admission, a generator per request, min_version, and weight updates with partial rows."""

from __future__ import annotations

import pytest
import torch
from helpers.serving import run_until

from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate, eos_token_ids
from forge_lightning.rollout.engines.quantized import QuantizedGenerate
from forge_lightning.rollout.types import completion_mask
from forge_lightning.serving.decode import DecodeLoop
from forge_lightning.serving.wire import GenerateCall, decode_rng_state, encode_rng_state
from forge_lightning.testing.tiny import tiny_policy

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]  # of two widths: the shorter is left-padded


@pytest.fixture(scope="module")
def policy():
    return tiny_policy(seed=0, max_position_embeddings=256)


def padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def call(request_id: str, params: SamplingParams, group_size: int = 2, **fields) -> GenerateCall:
    return GenerateCall(request_id, fields.pop("prompts", PROMPTS), group_size, params, True, **fields)


@pytest.mark.parametrize(
    ("params", "group_size"),
    [
        (SamplingParams(10, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2), 3),
        (SamplingParams(10, stop=("a", "bc")), 2),
        (SamplingParams(6, greedy=True, repetition_penalty=1.3), 1),
    ],
)
def test_a_request_with_the_trainers_rng_state_samples_what_the_in_process_engine_samples(
    policy, params, group_size
):
    model, tokenizer = policy.model, policy.tokenizer
    engine = HFGenerate(tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer)
    ids, mask = padded(PROMPTS, tokenizer.pad_token_id)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    expected = engine.generate(model, GenerationRequest(ids, mask, group_size, params, logprobs=True))
    state_after = torch.get_rng_state()

    loop = DecodeLoop(model, tokenizer)
    future = loop.submit(call("r", params, group_size, rng_state=encode_rng_state(state)))
    run_until(loop, future)
    answer = future.result()

    ends = (
        expected.ends
        if expected.ends is not None
        else completion_mask(expected.ids, engine.eos_token_ids).sum(1)
    )
    assert answer.completions == [expected.ids[i, :end].tolist() for i, end in enumerate(ends.tolist())]
    for row, end, logp in zip(expected.logp, ends.tolist(), answer.logp, strict=True):
        assert torch.allclose(torch.tensor(logp), row[:end], atol=1e-6, rtol=0)
    assert torch.equal(decode_rng_state(answer.rng_state), state_after)
    assert answer.versions == [[0] * len(c) for c in answer.completions]


def test_a_request_joins_the_batch_while_another_decodes(policy):
    loop = DecodeLoop(policy.model, policy.tokenizer)
    first = loop.submit(call("first", SamplingParams(12), seed=1))
    loop.step()
    loop.step()
    second = loop.submit(call("second", SamplingParams(4), seed=2))
    run_until(loop, first, second)
    at = {(event, rid): step for step, event, rid in loop.record}
    assert at[("admit", "first")] < at[("admit", "second")] < at[("finish", "first")]
    assert len(loop.jobs) == 0 and loop.cache is None  # every row left the batch


def test_a_request_whose_caller_went_away_leaves_the_batch(policy):
    loop = DecodeLoop(policy.model, policy.tokenizer)
    kept = loop.submit(call("kept", SamplingParams(6), seed=1))
    dropped = loop.submit(call("dropped", SamplingParams(6), seed=2))
    loop.step()
    assert dropped.cancel()
    run_until(loop, kept)
    assert ("cancel", "dropped") in [(event, rid) for _, event, rid in loop.record]
    assert len(kept.result().completions) == 4 and loop.jobs == []


def test_a_seed_gives_the_same_completions_whatever_else_is_in_the_batch(policy):
    alone = DecodeLoop(policy.model, policy.tokenizer)
    only = alone.submit(call("b", SamplingParams(8), seed=7))
    run_until(alone, only)

    crowded = DecodeLoop(policy.model, policy.tokenizer)
    other = crowded.submit(call("a", SamplingParams(12), seed=3, prompts=[[20, 21, 22, 23, 24, 25, 26]]))
    crowded.step()
    among = crowded.submit(call("b", SamplingParams(8), seed=7))
    run_until(crowded, other, among)

    assert among.result().completions == only.result().completions
    assert other.result().completions != among.result().completions


def test_a_request_waits_for_the_weight_version_it_asks_for(policy):
    loop = DecodeLoop(policy.model, policy.tokenizer)
    future = loop.submit(call("late", SamplingParams(3), seed=1, min_version=1))
    for _ in range(3):
        loop.step()
    assert not future.done() and loop.health() == {"version": 0, "active": 0, "queued": 1}
    loop.update(1, lambda model: None)
    run_until(loop, future)
    assert future.result().versions[0] == [1, 1, 1]


def test_an_update_lets_a_whole_request_finish_with_the_old_weights_and_holds_new_ones(policy):
    loop = DecodeLoop(policy.model, policy.tokenizer)
    whole = loop.submit(call("whole", SamplingParams(6), seed=1))
    loop.step()
    updated = loop.update(1, lambda model: None)
    waiting = loop.submit(call("next", SamplingParams(2), seed=2))
    run_until(loop, whole, waiting)
    events = [(event, rid) for _, event, rid in loop.record]
    assert events.index(("finish", "whole")) < events.index(("update", "1")) < events.index(("admit", "next"))
    assert updated.result() == 1
    assert {v for row in whole.result().versions for v in row} == {0}


def test_a_partial_request_goes_on_with_the_new_weights_each_token_keeping_its_version(policy):
    model, tokenizer = policy.model, policy.tokenizer
    old = {name: p.detach().clone() for name, p in model.named_parameters()}
    new_model = tiny_policy(seed=1, max_position_embeddings=256).model
    new = {name: p.detach().clone() for name, p in new_model.named_parameters()}
    loop = DecodeLoop(model, tokenizer)
    future = loop.submit(call("p", SamplingParams(8), seed=5, partial=True, prompts=[[30, 31, 32, 33]]))
    for _ in range(3):  # three tokens sampled, the fourth's logits computed: version 0
        loop.step()

    def load(m):
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(new[name])

    try:
        loop.update(1, load)
        run_until(loop, future)
        answer = future.result()
        events = [event for _, event, _ in loop.record]
        assert events == ["admit", "pause", "update", "resume", "finish"]
        for row, versions, logp in zip(answer.completions, answer.versions, answer.logp, strict=True):
            assert len(row) == 8, "the tiny model drew its EOS: pick another seed"
            assert versions == [0, 0, 0, 0, 1, 1, 1, 1]
            sequence = torch.tensor([[30, 31, 32, 33, *row]])
            for weights, part in ((old, slice(0, 4)), (new, slice(4, 8))):
                load_into(new_model, weights)
                with torch.no_grad():
                    logits = new_model(sequence).logits[0, 3:-1].float()  # (8, V): each token's
                scored = logits.log_softmax(-1).gather(1, torch.tensor(row)[:, None])[:, 0]
                assert torch.allclose(torch.tensor(logp)[part], scored[part], atol=1e-5, rtol=0)
    finally:
        load_into(model, old)


def load_into(model, weights) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_loop_with_a_precision_samples_with_that_copy_remade_after_each_update(precision):
    policy = tiny_policy(seed=0, max_position_embeddings=256)
    model, tokenizer = policy.model, policy.tokenizer
    engine = QuantizedGenerate(tokenizer.pad_token_id, eos_token_ids(tokenizer, model), tokenizer, precision)
    params = SamplingParams(6, greedy=True)
    ids, mask = padded(PROMPTS, tokenizer.pad_token_id)
    expected = engine.generate(model, GenerationRequest(ids, mask, 1, params, logprobs=True))
    loop = DecodeLoop(model, tokenizer, precision=precision)
    assert loop.weights is model and loop.model is not model  # the copy samples, the weights stay
    future = loop.submit(call("q", params, 1))
    run_until(loop, future)
    answer = future.result()
    assert [row for row in answer.completions] == [
        r[m.bool()].tolist() for r, m in zip(expected.ids, mask_of(expected))
    ]
    copy_before = loop.model
    new = tiny_policy(seed=1, max_position_embeddings=256).model.state_dict()
    loop.update(1, lambda weights: weights.load_state_dict(new))
    loop.step()
    assert loop.model is not copy_before and loop.version == 1
    assert torch.equal(
        model.state_dict()["model.norm.weight"], new["model.norm.weight"]
    )  # loaded into the weights


def mask_of(completions) -> torch.Tensor:
    """Each row's sampled tokens: up to its end (through EOS)."""
    width = completions.ids.shape[1]
    return (
        torch.arange(width)[None, :] < completions.ends[:, None]
        if completions.ends is not None
        else torch.ones_like(completions.ids)
    )
