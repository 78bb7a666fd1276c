"""The trainer's engine over rollout servers (serving/client.py), against fake servers that speak the
wire format for real (helpers/fake_rollout_server.py): the split of a request, the seeds and the
generator state, the weight push, the fingerprint check, and what happens when a server dies."""

from __future__ import annotations

import pytest
import torch
from helpers.fake_rollout_server import FakeRolloutServer
from helpers.models import make_model

from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.types import left_pad
from forge_lightning.serving.balance import balanced
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.connection import ServerError
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig
from forge_lightning.serving.wire import SECRET_ENV

SECRET = "test-secret"
PARAMS = SamplingParams(max_new_tokens=6)


@pytest.fixture
def servers(tokenizer):
    """``servers(n, **model_overrides)``: n started fake servers, stopped after the test."""
    started: list[FakeRolloutServer] = []

    def start(n: int, **overrides) -> list[FakeRolloutServer]:
        for _ in range(n):
            started.append(
                FakeRolloutServer(make_model(len(tokenizer), seed=5, **overrides), tokenizer, SECRET)
            )
        return started[-n:]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def engine(monkeypatch, tokenizer, tiny_model):
    """``engine(servers)``: a connected RemoteEngine over the fake ``servers``, closed after the test."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    made: list[RemoteEngine] = []

    def connect(fakes: list[FakeRolloutServer], **kwargs) -> RemoteEngine:
        placement = Placement([s.address for s in fakes], ServeConfig({}))
        made.append(RemoteEngine(placement, tokenizer, probe_timeout_s=0.2, probe_every_s=0.05, **kwargs))
        made[-1].connect(tiny_model)
        return made[-1]

    yield connect
    for remote in made:
        remote.close()


def request(tokenizer, prompts: list[str], group_size: int = 2, logprobs: bool = False) -> GenerationRequest:
    ids, mask = left_pad([tokenizer(p)["input_ids"] for p in prompts], tokenizer.pad_token_id)
    return GenerationRequest(ids, mask, group_size, PARAMS, logprobs=logprobs)


def test_one_server_samples_with_the_trainers_generator_and_hands_its_state_back(
    servers, engine, tokenizer, tiny_model
):
    (fake,) = servers(1)
    remote = engine([fake])
    torch.manual_seed(11)
    sent = torch.get_rng_state()
    out = remote.generate(tiny_model, request(tokenizer, ["ab", "c"], logprobs=True))
    # The server sampled from the trainer's state, and the trainer goes on from the state after.
    expected = fake.sample(fake.calls[0])
    assert torch.equal(torch.get_rng_state(), _state_after(sent, fake))
    assert fake.calls[0].seed is None and fake.calls[0].min_version == 0
    rows = expected.completions
    assert out.ends.tolist() == [len(r) for r in rows]
    for row, ids, logp, end in zip(rows, out.ids, out.logp, out.ends):
        assert ids[:end].tolist() == row and (ids[end:] == tokenizer.pad_token_id).all()
        assert torch.allclose(logp[:end], torch.full((int(end),), -0.5))


def _state_after(state: torch.Tensor, fake: FakeRolloutServer) -> torch.Tensor:
    """The generator state after the fake sampled its first call from ``state``."""
    generator = torch.Generator()
    generator.set_state(state)
    for prompt in fake.calls[0].prompts:
        for _ in range(fake.calls[0].group_size):
            length = int(torch.randint(2, PARAMS.max_new_tokens + 1, (), generator=generator))
            torch.randint(4, len(fake.tokenizer), (length - 1,), generator=generator)
    return generator.get_state()


def test_several_servers_share_the_prompts_each_with_a_seed_and_the_rows_keep_their_order(
    servers, engine, tokenizer, tiny_model
):
    fakes = servers(2)
    remote = engine(fakes)
    prompts = ["a", "bb", "ccc", "dddd", "e"]
    out = remote.generate(tiny_model, request(tokenizer, prompts))
    calls = [call for fake in fakes for call in fake.calls]
    assert all(call.rng_state is None and call.seed is not None for call in calls)
    assert len({call.seed for call in calls}) == 2
    assert sorted(len(call.prompts) for call in calls) == [2, 3]
    firsts = [tokenizer(p)["input_ids"][0] for p in prompts]
    assert out.ids[:, 0].tolist() == [first for first in firsts for _ in range(2)]


def test_a_server_that_refuses_connections_is_marked_dead_and_the_others_take_its_prompts(
    servers, engine, tokenizer, tiny_model
):
    fakes = servers(2)
    remote = engine(fakes)
    fakes[0].stop()
    with pytest.warns(UserWarning, match=f"rollout server {fakes[0].address} is marked dead"):
        out = remote.generate(tiny_model, request(tokenizer, ["a", "b", "c"]))
    assert out.ids.shape[0] == 6 and remote.failures == 1
    # Its share, refused at the request, went to the other server in a second call: each prompt once.
    answered = sorted(p for call in fakes[1].calls for p in call.prompts)
    assert len(fakes[1].calls) == 2 and answered == sorted(tokenizer(p)["input_ids"] for p in "abc")
    assert remote.take_failures() == 1 and remote.take_failures() == 0


@pytest.mark.parametrize("how", ["abort", "hang"])
def test_a_server_that_dies_mid_request_has_its_share_sampled_once_by_another(
    servers, engine, tokenizer, tiny_model, how
):
    fakes = servers(2)
    remote = engine(fakes)
    fakes[0].fail = how
    prompts = ["a", "bb", "ccc", "dddd"]
    with pytest.warns(UserWarning, match="marked dead .*prompt\\(s\\) go to the other servers"):
        out = remote.generate(tiny_model, request(tokenizer, prompts))
    firsts = [tokenizer(p)["input_ids"][0] for p in prompts]
    assert out.ids[:, 0].tolist() == [first for first in firsts for _ in range(2)]
    lost = [p for call in fakes[0].calls for p in call.prompts]
    answered = [p for call in fakes[1].calls for p in call.prompts]
    assert lost and sorted(answered) == sorted(tokenizer(p)["input_ids"] for p in prompts)
    assert remote.failures == 1


def test_with_no_server_left_the_error_names_them_all(servers, engine, tokenizer, tiny_model):
    fakes = servers(2)
    remote = engine(fakes)
    for fake in fakes:
        fake.stop()
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="no rollout server is left") as err:
        remote.generate(tiny_model, request(tokenizer, ["a"]))
    assert all(fake.address in str(err.value) for fake in fakes)
    assert len(str(err.value).splitlines()) == 1


def test_a_server_holding_another_model_is_refused_naming_what_differs(servers, engine):
    (fake,) = servers(1, hidden_size=16, intermediate_size=32)
    with pytest.raises(ValueError, match="model.hidden_size: 32 here, 16 there"):
        engine([fake])


def test_a_wrong_secret_is_the_servers_one_line_refusal(servers, engine, tokenizer, tiny_model):
    (fake,) = servers(1)
    fake.secret = "another"
    with pytest.raises(ServerError, match="refused GET /info \\(401\\): wrong or missing secret"):
        engine([fake])


def test_the_weights_go_to_every_server_as_version_0_then_one_version_per_step(servers, engine, tiny_model):
    fakes = servers(2)
    remote = engine(fakes)
    assert [f.updates for f in fakes] == [[0], [0]]
    with torch.no_grad():
        tiny_model.lm_head.weight.add_(1.0)
    remote.sync_weights(tiny_model)
    assert remote.version == 1 and [f.updates for f in fakes] == [[0, 1], [0, 1]]
    for fake in fakes:
        for (name, mine), (_, theirs) in zip(tiny_model.named_parameters(), fake.model.named_parameters()):
            assert torch.equal(mine, theirs), name


def test_a_server_dead_at_the_push_is_marked_and_the_others_get_the_weights(servers, engine, tiny_model):
    fakes = servers(2)
    remote = engine(fakes)
    fakes[1].stop()
    with pytest.warns(UserWarning, match=f"rollout server {fakes[1].address} is marked dead"):
        remote.sync_weights(tiny_model)
    assert fakes[0].updates == [0, 1] and remote.failures == 1


def test_requests_ask_for_the_newest_version_or_the_lag_allowed_behind(
    servers, engine, tokenizer, tiny_model
):
    (fake,) = servers(1)
    remote = engine([fake])
    remote.sync_weights(tiny_model)
    remote.sync_weights(tiny_model)
    remote.generate(tiny_model, request(tokenizer, ["a"]))
    remote.lag = 1
    ids, mask = request(tokenizer, ["b"]).prompt_ids, request(tokenizer, ["b"]).prompt_mask
    finished = remote.collect(remote.submit(ids, mask, 2, PARAMS, seed=7))
    assert [c.min_version for c in fake.calls] == [2, 1]
    assert fake.calls[1].seed == 7 and finished.version == 2
    assert finished.behav_logp.shape == finished.completion_ids.shape


def test_prompts_go_to_the_server_with_the_fewest_tokens_outstanding():
    # Costliest first, each to the least loaded: 9 and 11 tokens.
    assert balanced([4, 6, 3, 3, 4], [0, 0]) == [[1, 2], [0, 3, 4]]
    # A server still busy with 9 tokens of an earlier request gets less of this one.
    assert balanced([2, 2, 2], [9, 0]) == [[], [0, 1, 2]]
    assert balanced([5], [0, 0, 0]) == [[0], [], []]
