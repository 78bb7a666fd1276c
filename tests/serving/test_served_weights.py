"""What the trainer pushes to a rollout server (serving/served_weights.py): a plain model's
parameters, a LoRA policy's merged weights under the base model's names, and an FSDP2 policy's
full tensors, gathered one at a time."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist

from forge_lightning.serving import weights
from forge_lightning.serving.fingerprint import fingerprint
from forge_lightning.serving.served_weights import served_names, served_shapes, served_tensors
from forge_lightning.serving.wire import parameter_specs
from forge_lightning.testing.tiny import tiny_model, tiny_tokenizer


def lora_policy(modules_to_save: list[str] | None = None):
    """A tiny Llama with a rank-4 adapter whose B matrices are not zero (a fresh adapter's are, and
    would merge into the base weights unchanged), and changed copies of ``modules_to_save``."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=modules_to_save
    )
    model = peft.get_peft_model(tiny_model(seed=0), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                param.add_(torch.randn_like(param))
    return model


def test_a_plain_model_yields_its_own_parameters():
    model = tiny_model(seed=0)
    pushed = list(served_tensors(model))
    own = list(model.named_parameters())
    assert [name for name, _ in pushed] == [name for name, _ in own]
    assert all(a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(pushed, own, strict=True))
    assert served_names(model) == [name for name, _ in own]


@pytest.mark.parametrize("modules_to_save", [None, ["norm"]])
def test_a_lora_policy_yields_what_merge_and_unload_gives_under_the_base_names(modules_to_save):
    policy = lora_policy(modules_to_save)
    before = {name: param.detach().clone() for name, param in policy.named_parameters()}
    merged = copy.deepcopy(policy).merge_and_unload()

    pushed = list(served_tensors(policy))

    expected = list(merged.named_parameters())
    assert [name for name, _ in pushed] == [name for name, _ in expected]
    assert [name for name, _ in pushed] == [name for name, _ in tiny_model(seed=0).named_parameters()]
    for (name, got), (_, want) in zip(pushed, expected, strict=True):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
    changed = [
        name
        for name, got in pushed
        if not torch.equal(got, dict(tiny_model(seed=0).named_parameters())[name])
    ]
    assert any("q_proj" in name for name in changed)  # the adapters did change what is pushed
    if modules_to_save:
        assert "model.norm.weight" in changed  # the trained copy goes, not the original
    # The policy itself is untouched: same tensors, adapters still in place.
    assert all(torch.equal(before[name], param) for name, param in policy.named_parameters())
    assert [(name, tensor.shape) for name, tensor in pushed] == list(served_shapes(policy))


def test_a_lora_policys_push_lands_in_a_servers_plain_model_merged():
    """Over a real gloo group, in the server's parameter order (what the pusher sends)."""
    policy = lora_policy(["norm"])
    merged = copy.deepcopy(policy).merge_and_unload()
    served = tiny_model(seed=3)
    specs = parameter_specs(served.named_parameters())
    store = weights.open_store("127.0.0.1", 0, master=True, timeout_s=20)

    def receive() -> None:
        group = weights.open_group("127.0.0.1", store.port, "p/", weights.SERVER_RANK, 20)
        weights.receive_parameters(group, served, [spec.name for spec in specs])

    server = threading.Thread(target=receive)
    server.start()
    group = weights.open_group("127.0.0.1", store.port, "p/", weights.TRAINER_RANK, 20, store=store)
    weights.WeightSender(group, specs).send(served_tensors(policy))
    server.join(timeout=30)
    for (name, got), (_, want) in zip(served.named_parameters(), merged.named_parameters(), strict=True):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


def test_a_lora_policy_has_the_fingerprint_of_its_base_model():
    tokenizer = tiny_tokenizer()
    assert fingerprint(lora_policy(["norm"]), tokenizer) == fingerprint(tiny_model(seed=0), tokenizer)


@pytest.fixture
def one_rank_world(tmp_path):
    """A gloo world of one process, torch.distributed's default group."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_tiny_model():
    """A tiny Llama sharded with FSDP2 over a one-rank CPU mesh (as models/sharding.py shards the
    policy), and an unsharded copy of it taken before."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from forge_lightning.models.sharding import shard_policy

    model = tiny_model(seed=0)
    plain = copy.deepcopy(model)
    shard_policy(model, init_device_mesh("cpu", (1,)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return model, plain


def test_an_fsdp2_policy_yields_each_full_tensor_on_rank_zero(one_rank_world):
    model, plain = sharded_tiny_model()

    pushed = list(served_tensors(model))

    expected = list(plain.named_parameters())
    assert [name for name, _ in pushed] == [name for name, _ in expected]
    for (name, got), (_, want) in zip(pushed, expected, strict=True):
        assert type(got) is torch.Tensor, name  # a plain tensor the sender can cast and send
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    assert list(served_shapes(model)) == [(name, p.shape) for name, p in expected]


def test_an_fsdp2_policy_yields_nothing_on_the_other_ranks(one_rank_world, monkeypatch):
    """Another rank walks every gather too (they are collectives) but has nothing to send."""
    model, _ = sharded_tiny_model()
    gathered = []
    from torch.distributed.tensor import DTensor

    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self: gathered.append(1) or full_tensor(self))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    assert list(served_tensors(model)) == []
    assert len(gathered) == len(list(model.parameters()))
