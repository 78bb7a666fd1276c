"""What async rollouts on rollout servers take and refuse (settings/checks.py's SERVERS_NEED and
SERVERS_ASYNC_NEED): what the in-process worker cannot do and the servers can is accepted with
``rollout_servers`` and still refused without; what neither can is refused by name with its reason.
And ``rollout_device`` as the devices of the servers the trainer starts (serving/placement.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from forge_lightning.cli.serve import main as serve_main
from forge_lightning.rollout.in_flight import Finished, InFlight, restored_in_flight, saved_in_flight
from forge_lightning.serving import placement as placement_module
from forge_lightning.serving import ray_actors
from forge_lightning.serving.placement import Placement
from forge_lightning.serving.processes import ServeConfig, serve_command
from forge_lightning.serving.requests import not_built
from forge_lightning.serving.wire import SECRET_ENV
from forge_lightning.settings.checks import validate_hparams

ASYNC = {"rollout_mode": "async"}
SERVERS = {"rollout_servers": ["local:1"]}

# Each setting the in-process rollout worker refused and the servers serve (async mode's own
# local:1 server too, now that no worker samples).
LIFTED = [
    {"top_p": 0.9},
    {"top_k": 5},
    {"min_p": 0.1},
    {"repetition_penalty": 1.2},
    {"stop": ["\n", "Answer:"]},
    {"generation_kwargs": {"low_memory": True}},  # a GenerationConfig field the servers' loop takes
    {"peft": {"r": 4, "alpha": 8}},
    {"use_engine_logprobs": True},
]


@pytest.mark.parametrize("setting", LIFTED, ids=lambda s: next(iter(s)))
def test_what_the_servers_serve_is_taken_in_async_mode_with_servers_listed_or_not(setting):
    validate_hparams({**ASYNC, **SERVERS, **setting})
    validate_hparams({**ASYNC, **setting})  # on its own local:1 server


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"dynamic_sampling": True}, "a batch's step is known only from the rewards"),
        ({"num_iterations": 2}, "counts one optimizer step per batch it hands over"),
        ({"steps_per_generation": 2}, "counts one optimizer step per batch it hands over"),
        ({"loss_type": "forge", "kl_beta": 0.04}, "which loss_type='forge' does not take"),
        ({"environment_factory": "mypkg.Env"}, "the batches in flight go into checkpoints"),
        ({"agent": "forge_lightning.examples.calculator_agent.agent"}, "an agent's endpoint reports none"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_what_async_rollouts_on_servers_cannot_do_is_refused_by_name_with_its_reason(setting, reason):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=rf"with rollout_mode='async' cannot take {name}=.*: .*{reason}"):
        validate_hparams({**ASYNC, **SERVERS, **setting})
    with pytest.raises(ValueError, match=rf"\(on its local:1 server\) cannot take {name}=.*: .*{reason}"):
        validate_hparams({**ASYNC, **setting})


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"generation_backend": "vllm"}, "the servers sample with the engine each was started with"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_what_no_server_does_is_refused_in_either_mode(setting, reason, mode):
    with pytest.raises(ValueError, match=rf"rollout_servers=\['local:1'\] cannot take .*: .*{reason}"):
        validate_hparams({"rollout_mode": mode, **SERVERS, **setting})


@pytest.mark.parametrize(
    "setting",
    [{"calculator": "plain"}, {"tools": ["json.dumps"]}, {"tools": ["json.dumps"], "sandbox": "process"}],
    ids=["calculator", "tools", "tools-in-the-sandbox"],
)
def test_tools_run_in_async_mode_on_servers_their_loop_on_the_trainers_side(setting):
    validate_hparams({**ASYNC, **SERVERS, **setting})


def test_generation_kwargs_the_servers_loop_builds_no_processor_for_are_refused_as_the_server_would():
    kwargs = {"typical_p": 0.5, "low_memory": True, "epsilon_cutoff": 3e-4}
    assert not_built(kwargs.get) == ["typical_p", "epsilon_cutoff"]  # the server's own list
    with pytest.raises(ValueError, match="cannot take generation_kwargs typical_p, epsilon_cutoff: "):
        validate_hparams({**SERVERS, "generation_kwargs": kwargs})
    validate_hparams({**ASYNC, **SERVERS, "generation_kwargs": {"typical_p": 1.0}})  # 1: off


def test_sync_rollouts_on_servers_keep_what_only_async_ones_refuse():
    validate_hparams({**SERVERS, "dynamic_sampling": True, "loss_type": "forge", "kl_beta": 0.04})
    validate_hparams({**SERVERS, "num_iterations": 2, "gradient_accumulation_steps": 1})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rollout_device_lists_the_started_servers_devices_in_either_mode(mode):
    validate_hparams(
        {"rollout_mode": mode, "rollout_servers": ["local:2"], "rollout_device": "cuda:0, cuda:1"}
    )
    with pytest.raises(ValueError, match="'mps': a rollout server samples on 'cpu' or 'cuda'"):
        validate_hparams(
            {"rollout_mode": mode, "rollout_servers": ["local:2"], "rollout_device": "cuda:0,mps"}
        )
    with pytest.raises(ValueError, match="these entries start none"):
        validate_hparams(
            {"rollout_mode": mode, "rollout_servers": ["node7:8000"], "rollout_device": "cuda:1"}
        )


def test_without_servers_rollout_device_places_async_modes_own_server_and_nothing_in_sync_mode():
    with pytest.raises(
        ValueError, match="place the rollout servers the trainer starts: set rollout_mode='async'"
    ):
        validate_hparams({"rollout_device": "cuda:1"})
    validate_hparams({**ASYNC, "rollout_device": "cuda:1", "rollout_memory_fraction": 0.4})
    with pytest.raises(ValueError, match="is not a device torch understands"):
        validate_hparams({**ASYNC, "rollout_device": "cuda:0,cuda:x"})


def test_the_local_servers_get_the_devices_round_robin_on_their_command_line(tmp_path, monkeypatch):
    spawned = []

    def spawn(config, port, secret, threads, log, host="127.0.0.1", device=None):
        spawned.append(serve_command(config, port, host, device))
        return SimpleNamespace(pid=len(spawned), poll=lambda: 0)  # a process that has ended

    monkeypatch.setattr(placement_module, "spawn_server", spawn)
    monkeypatch.setattr(placement_module, "wait_until_healthy", lambda *args, **kwargs: None)
    config = ServeConfig({}, devices=("cuda:0", "cuda:1"))
    placement = Placement(["local:3"], config, spec="random:x", folder=tmp_path)
    try:
        assert len(placement.start(model=None, tokenizer=None)) == 3
    finally:
        placement.close()
    assert [command[-2:] for command in spawned] == [["--device", d] for d in ("cuda:0", "cuda:1", "cuda:0")]
    assert placement.config.devices == ("cuda:0", "cuda:1")  # kept when the model spec is filled in
    assert "--device" not in serve_command(tmp_path / "serve.yaml", 4321)  # none given: the server's choice


@pytest.mark.parametrize(
    ("devices", "gpus", "device"), [(("cuda:1", "cuda:2"), 1, "cuda"), (("cpu",), 0, "cpu"), ((), 0, None)]
)
def test_ray_servers_ask_ray_for_a_gpu_each_where_rollout_device_names_cuda(
    tmp_path, monkeypatch, devices, gpus, device
):
    asked = []

    class Remote:  # what ray.remote(...)(ServerActor) gives: .remote() makes an actor handle
        def __init__(self, options):
            self.options = options

        def __call__(self, cls):
            return SimpleNamespace(
                remote=lambda *args: (
                    asked.append((self.options, args))
                    or SimpleNamespace(start=SimpleNamespace(remote=lambda: "10.0.0.2:9000"))
                )
            )

    fake = SimpleNamespace(
        is_initialized=lambda: True,
        remote=lambda **options: Remote(options),
        get=lambda refs: refs,
        kill=lambda actor: None,
    )
    monkeypatch.setattr(ray_actors, "_ray", lambda: fake)
    monkeypatch.setattr(ray_actors, "end_servers", lambda actors: None)
    placement = Placement(
        ["ray:2"], ServeConfig({}, threads=3, devices=devices), spec="random:x", folder=tmp_path
    )
    assert [address for _, address in placement.start(model=None, tokenizer=None)] == ["10.0.0.2:9000"] * 2
    assert [options for options, _ in asked] == [{"num_cpus": 3, "num_gpus": gpus}] * 2
    assert [args[-1] for _, args in asked] == [device] * 2  # each actor's serve --device
    validate_hparams({"rollout_servers": ["ray:2"], "rollout_device": "cuda"})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_servers_sample_with_the_runs_low_precision_copy_in_either_mode(module, mode):
    setting = {"rollout_precision": "bf16", "rollout_correction": "truncate"}
    validate_hparams({"rollout_mode": mode, **SERVERS, **setting})
    grpo = module(rollout_servers=["local:1"], rollout_mode=mode, **setting)
    assert grpo.engine.placement.config.model["rollout_precision"] == "bf16"  # serve's model section


def test_a_gpu_share_goes_to_each_started_server_on_the_cuda_devices_listed(
    module, tmp_path, monkeypatch, capsys
):
    validate_hparams({**SERVERS, "rollout_memory_fraction": 0.4, "rollout_device": "cuda"})
    grpo = module(**SERVERS, rollout_memory_fraction=0.4, rollout_device="cuda:0,cuda:1")
    assert grpo.engine.placement.config.model["rollout_memory_fraction"] == 0.4
    with pytest.raises(ValueError, match="caps each started server's share of its GPU: set rollout_device"):
        validate_hparams({**SERVERS, "rollout_memory_fraction": 0.4})
    with pytest.raises(ValueError, match="caps a CUDA rollout server's memory, but rollout_device='cpu'"):
        validate_hparams({**SERVERS, "rollout_memory_fraction": 0.4, "rollout_device": "cpu"})
    # A server started by hand on the CPU with a share in its config refuses before it loads a model.
    monkeypatch.setenv(SECRET_ENV, "s")
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  model: random:x\n  rollout_memory_fraction: 0.4\n")
    with pytest.raises(SystemExit):
        serve_main(["--config", str(config), "--port", "0", "--device", "cpu"])
    assert "rollout_memory_fraction=0.4 caps a CUDA rollout server's memory" in capsys.readouterr().err


def test_the_module_hands_rollout_device_to_the_servers_it_starts(module):
    grpo = module(rollout_servers=["local:2"], rollout_device="cuda:1,cuda:2", rollout_mode="async")
    assert grpo.engine.placement.config.devices == ("cuda:1", "cuda:2")
    assert module(rollout_servers=["local:1"]).engine.placement.config.devices == ()
    own = module(rollout_mode="async", rollout_device="cuda", rollout_memory_fraction=0.3).engine.placement
    assert own.entries == ["local:1"] and own.config.devices == ("cuda",)  # async mode's own server
    assert own.config.model["rollout_memory_fraction"] == 0.3


def test_a_batch_in_flight_keeps_where_the_servers_ended_its_rows_across_a_checkpoint():
    ids, ends = torch.tensor([[5, 6, 1], [7, 1, 1]]), torch.tensor([3, 1])  # the second cut at a stop string
    finished = Finished(ids, torch.zeros(2, 3), 4, ends=ends)
    item = InFlight(["q"], {}, 0, index=0, ticket=1, finished=finished)
    [back] = restored_in_flight(saved_in_flight([item]))
    assert back.finished.ends.tolist() == [3, 1]
    [old] = restored_in_flight([{k: v for k, v in saved_in_flight([item])[0].items() if k != "ends"}])
    assert old.finished.ends is None  # a checkpoint from before: rows end at their EOS
