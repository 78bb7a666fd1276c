"""The rollout server's wire format (serving/wire.py): messages survive JSON, malformed ones are
refused naming the field, the door's header, and fingerprints that name what differs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.serving.wire import (
    GenerateAnswer,
    GenerateCall,
    Health,
    Info,
    UpdateCall,
    WireError,
    auth_header,
    authorized,
    decode_rng_state,
    differences,
    encode_rng_state,
    fingerprint,
    parameter_specs,
)
from forge_lightning.testing.tiny import tiny_model, tiny_tokenizer


def through_json(message):
    return type(message).from_json(json.loads(json.dumps(message.to_json())))


def test_every_message_survives_json():
    params = SamplingParams(9, temperature=0.7, top_k=5, stop=("\n\n", "Answer:"), extra={"typical_p": 1.0})
    generator_state = torch.Generator().manual_seed(5).get_state()
    state = encode_rng_state(generator_state)
    messages = [
        GenerateCall(
            "r1", [[1, 2, 3], [4]], 4, params, True, seed=None, rng_state=state, min_version=3, partial=True
        ),
        GenerateAnswer("r1", [[5, 6], []], [[-0.5, -1.25], []], [[2, 3], []], [False, True], state),
        Info({"model": {"a": 1}}, 4, parameter_specs(tiny_model().named_parameters())),
        UpdateCall(5, "disk", "/tmp/weights"),
        Health(2, 1, 0),
    ]
    for message in messages:
        assert through_json(message) == message
    assert torch.equal(decode_rng_state(state), generator_state)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"group_size": "4"}, "'group_size' must be int"),
        ({"prompts": [[1, "2"]]}, "'prompts' must be a list of lists of integers"),
        ({"logprobs": 1}, "'logprobs' must be bool"),
        ({"params": {"max_new_tokens": 4, "bogus": 1}}, "unknown SamplingParams fields ['bogus']"),
        ({"rng_state": "not base64!"}, "rng_state is not base64"),
        ({"group_size": 0}, "'group_size' must be at least 1"),
    ],
)
def test_a_malformed_request_is_refused_naming_its_field(change, named):
    body = GenerateCall("r", [[1, 2]], 2, SamplingParams(4)).to_json()
    with pytest.raises(WireError, match=re.escape(named)):
        GenerateCall.from_json({**body, **change})


def test_an_update_from_disk_needs_its_folder():
    with pytest.raises(WireError, match="needs the folder in 'path'"):
        UpdateCall.from_json({"version": 1, "via": "disk", "path": None})


def test_the_door_takes_only_the_secret():
    header = auth_header("s3cret")["Authorization"]
    assert authorized(header, "s3cret")
    assert not authorized(header, "other")
    assert not authorized(None, "s3cret")
    assert not authorized("s3cret", "s3cret")  # the scheme is part of it


def test_differences_name_what_differs_between_two_fingerprints():
    tokenizer = tiny_tokenizer()
    mine = fingerprint(tiny_model(len(tokenizer)), tokenizer)
    assert (
        differences(mine, fingerprint(tiny_model(len(tokenizer), seed=3), tokenizer)) == []
    )  # weights aside
    theirs = fingerprint(tiny_model(len(tokenizer), hidden_size=64), tokenizer)
    named = differences(mine, theirs)
    assert "model.hidden_size: 32 here, 64 there" in named
    assert any(line.startswith("model.parameters_sha256:") for line in named)
    tokenizer.pad_token = "<|im_start|>"
    assert [
        d.split(":")[0] for d in differences(mine, fingerprint(tiny_model(len(tokenizer)), tokenizer))
    ] == ["tokenizer.pad_token_id"]
