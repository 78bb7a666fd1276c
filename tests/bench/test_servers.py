"""The rollout-server bench's driver: it reads the step from the run's config, gives both sides the
same step with their own threads, interleaves them, and divides the servers' trained tokens per
second by sync's round by round. The processes themselves are the throughput bench's (its own
tests run them); here they are stood in for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_lightning.bench import servers
from forge_lightning.bench import throughput as bench
from forge_lightning.data.arithmetic import generate, write_task
from forge_lightning.data.gsm8k import load_gsm8k

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = ROOT / "configs" / "arithmetic_cpu.yaml"


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_step_is_the_arithmetic_configs_and_the_defaults_fill_the_rest():
    step = servers.step_of(servers.yaml.safe_load(ARITHMETIC.read_text()))
    flags = step.flags
    picked = [flags[flag] for flag in ("--model", "--group", "--max-new-tokens", "--prompts-per-step")]
    assert picked == ["embedded", 8, 96, 4]
    assert (flags["--temperature"], flags["--kl-beta"], flags["--seed"]) == (0.8, 0.0, 42)
    assert flags["--system-prompt"].startswith("Solve the problem")
    assert step.settings()["max_new_tokens"] == 96 and step.data["source"] == "arithmetic"
    bare = servers.step_of({"model": {"init_args": {"group_size": 4}}}).flags
    assert (bare["--group"], bare["--max-new-tokens"], bare["--prompts-per-step"]) == (4, 512, 1)
    assert "--system-prompt" not in servers.step_of({}).arguments()  # unset: the bench's own None


def test_both_sides_run_the_same_step_each_on_its_own_threads(tmp_path):
    args = servers.parse_args(["--config", str(ARITHMETIC), "--steps", "2"])
    step = servers.step_of(servers.yaml.safe_load(ARITHMETIC.read_text()))
    sides = servers.commands(args, step, str(tmp_path))
    sync, remote = (bench.parse_args(sides[side][3:]) for side in ("sync", "servers"))  # after `-m bench`
    for name in ("data", "model", "prompts_per_step", "group", "max_new_tokens", "temperature", "kl_beta"):
        assert getattr(sync, name) == getattr(remote, name), name
    assert sync.system_prompt == remote.system_prompt == step.flags["--system-prompt"]
    assert (sync.steps, sync.no_references, sync.max_new_tokens, sync.prompts_per_step) == (2, True, 96, 4)
    assert (sync.rollout_mode, sync.threads, sync.rollout_servers) == ("sync", 2, None)
    assert (remote.rollout_mode, remote.threads, remote.worker_threads) == ("async", 1, 1)
    assert remote.rollout_servers == ["local:1"] and remote.max_staleness == 1


def test_the_bench_times_servers_in_async_mode_only(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--data", str(tmp_path), "--rollout-servers", "local:1"])
    assert "--rollout-mode async" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        servers.parse_args(["--config", str(ARITHMETIC), "--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_the_prompts_are_the_arithmetic_runs_own_train_problems(tmp_path):
    step = servers.step_of(servers.yaml.safe_load(ARITHMETIC.read_text()))
    folder = servers.prompts_folder(step, tmp_path)
    written = load_gsm8k("train", max_samples=None, path=folder)
    assert written == [p.sample() for p in generate(variant="add_sub_small")["train"]]  # the datamodule's
    with pytest.raises(SystemExit, match="data source 'mock'"):
        servers.prompts_folder(servers.step_of({"data": {"source": "mock"}}), tmp_path)


def test_each_rounds_ratio_pairs_its_own_two_sides_whatever_ran_first():
    lines = [
        {"round": 0, "side": "sync", "completion_tokens_per_s": 10.0},
        {"round": 0, "side": "servers", "completion_tokens_per_s": 15.0},
        {"round": 1, "side": "servers", "completion_tokens_per_s": 12.0},
        {"round": 1, "side": "sync", "completion_tokens_per_s": 8.0},
        {"round": 2, "side": "sync", "completion_tokens_per_s": 9.0},  # its other side never came
    ]
    assert servers.round_ratios(lines) == [1.5, 1.5]
    assert [servers.order(r) for r in range(3)] == [
        ("sync", "servers"),
        ("servers", "sync"),
        ("sync", "servers"),
    ]


def test_the_driver_interleaves_the_sides_and_appends_every_line(tmp_path, monkeypatch):
    speeds = iter([10.0, 14.0, 13.0, 10.0, 10.0, 20.0])  # round 0 sync, servers; 1 servers, sync; ...
    ran: list[tuple[str, int]] = []

    def fake_side(side: str, command: list[str], round_: int) -> dict:
        ran.append((side, round_))
        return {"completion_tokens_per_s": next(speeds), "side": side, "round": round_}

    monkeypatch.setattr(servers, "run_side", fake_side)
    out = tmp_path / "figures" / "servers_cpu.jsonl"
    argv = ["--config", str(ARITHMETIC), "--rounds", "3", "--out", str(out)]
    result = servers.main(argv)
    assert ran == [("sync", 0), ("servers", 0), ("servers", 1), ("sync", 1), ("sync", 2), ("servers", 2)]
    assert result["vs_sync_rounds"] == [1.4, 1.3, 2.0] and result["vs_sync"] == 1.4
    assert result["label"] == "servers-local:1" and result["command"].endswith(" ".join(argv))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 7 and lines[-1] == result
    assert result["settings"]["trainer_threads"] == result["settings"]["server_threads"] == 1


@pytest.mark.integration  # starts a rollout server process
def test_the_bench_times_async_steps_on_a_server_it_starts(tiny_model_dir, tmp_path, capsys):
    write_task(tmp_path, variant="add_sub_small")
    args = ["--model", str(tiny_model_dir), "--data", str(tmp_path), "--steps", "2", "--group", "2"]
    servers_side = ["--rollout-mode", "async", "--rollout-servers", "local:1", "--worker-threads", "1"]
    result = bench.main([*args, "--max-new-tokens", "4", "--threads", "1", *servers_side])

    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["completion_tokens_per_s"] > 0 and result["completion_tokens_per_step"] > 0
    settings = result["settings"]
    assert settings["rollout_servers"] == ["local:1"] and settings["rollout_mode"] == "async"
    assert settings["trainer_threads"] == settings["worker_threads"] == 1
    assert 0 <= result["trainer_wait_share"] <= 1 and "worker_wait_share" not in result  # none reported
