"""Asynchronous rollouts through the module: without ``rollout_servers`` one ``local:1`` rollout
server (a ``forge-lightning serve`` child process) samples while the trainer trains; the pipeline
(rollout/sources.py's AsyncRollouts) hands batches over, trains them at most ``max_staleness``
steps later, samples a staler one again, keeps the trainer's threads apart from the server's, and
stops the server when the fit ends, however it ends. The servers themselves are tested in
tests/serving/."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from forge_lightning.callbacks import RewardLogger
from forge_lightning.rollout.in_flight import split_threads
from forge_lightning.serving.client import RemoteEngine
from forge_lightning.settings.checks import validate_hparams


def wait_until_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "Z" in _state(pid):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def server_pids(grpo) -> list[int]:
    return [process.pid for process in grpo.engine.placement.processes]


# -- the module's pipeline ---------------------------------------------------------------------


@pytest.fixture
def fit_async(tmp_path, module, trainer, loader):
    """``fit_async(records, callbacks, **settings)``: a fit of ``records`` one-prompt batches in
    async mode; the module, the trainer and its JSONL records."""

    def fit(records: int, callbacks=(), **settings):
        pl.seed_everything(3)
        grpo = module(rollout_mode="async", gradient_accumulation_steps=1, kl_beta=0.0, **settings)
        fitted = trainer(tmp_path, callbacks=[RewardLogger(logging_steps=1), *callbacks])
        fitted.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(records)]))
        lines = (tmp_path / "training_log.jsonl").read_text().splitlines()
        return grpo, fitted, [json.loads(line) for line in lines]

    return fit


@pytest.mark.integration
def test_async_trains_every_batch_once_one_step_behind_on_its_own_server_and_stops_it(fit_async):
    pids: list[int] = []
    threads: list[int] = []

    class ServerPid(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pids.extend(server_pids(pl_module))
            threads.append(torch.get_num_threads())

    before = torch.get_num_threads()
    with pytest.warns(UserWarning, match="no trainer.max_steps: the fit's last 2 optimizer steps"):
        grpo, trainer, logged = fit_async(records=5, callbacks=[ServerPid()])
    assert isinstance(grpo.engine, RemoteEngine) and len(pids) == 1  # one local:1 server sampled
    # The server takes half of the trainer's threads while the fit runs; the trainer gets them back.
    assert threads == [split_threads(before, None)[0]] and torch.get_num_threads() == before
    assert trainer.global_step == 5  # the fit's last batch also trains the one still in flight
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    # The first rollout is sampled by the weights it trains; every later one, one step older.
    assert [r["staleness"] for r in logged] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert "correction_weight_mean" not in logged[0]
    assert all(0.5 < r["correction_weight_mean"] < 2.0 for r in logged[1:])
    assert sum(r["num_tokens"] > 0 for r in logged) == 5
    assert all(r["regenerated"] == 0 for r in logged)
    assert not grpo.engine.running
    assert wait_until_gone(pids[0], seconds=15)


@pytest.mark.integration
def test_stale_rollouts_are_sampled_again_and_counted(fit_async):
    class SkipVersions(pl.Callback):
        """Writes two extra weight versions after batch 1, so that the rollout in flight, sampled
        before them, is three versions old when due: beyond max_staleness 1."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                servers = pl_module.engine
                for item in pl_module.rollout_source.in_flight:
                    item.finished = item.finished or servers.collect(item.ticket)
                servers.sync_weights(pl_module.model)
                servers.sync_weights(pl_module.model)

    _, _, logged = fit_async(records=4, callbacks=[SkipVersions()])
    # Step 2 trains batch 1, handed before the extra versions: sampled again, from the newest.
    assert [r["regenerated"] for r in logged] == [0.0, 1.0, 0.0, 0.0]
    assert logged[1]["staleness"] == 0.0
    assert max(r["staleness_max"] for r in logged) <= 1


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"generation_backend": "vllm"}, "the servers sample with the engine each was started with"),
        ({"dynamic_sampling": True}, "a batch's step is known only from the rewards"),
        ({"num_iterations": 2}, "one optimizer step per batch"),
        ({"loss_type": "forge"}, "loss_type='forge' does not take"),
    ],
)
def test_async_refuses_what_its_server_cannot_do_by_name_with_the_reason(setting, reason):
    with pytest.raises(
        ValueError, match=rf"rollout_mode='async' \(on its local:1 server\) cannot take .*{reason}"
    ):
        validate_hparams({"rollout_mode": "async", **setting})


def test_async_takes_what_the_in_process_worker_refused(module):
    # The server samples with the cuts, stop strings and the penalty, and reports the log-probs of
    # what it sampled from; a LoRA policy's weights reach it merged.
    for setting in (
        {"top_p": 0.9},
        {"top_k": 5},
        {"min_p": 0.1},
        {"repetition_penalty": 1.2},
        {"stop": ["\n"]},
    ):
        validate_hparams({"rollout_mode": "async", **setting})
    validate_hparams({"rollout_mode": "async", "use_engine_logprobs": True})


@pytest.mark.integration
def test_a_failing_fit_stops_its_server(tmp_path, module, trainer, loader):
    calls = []

    def fails_on_second_call(prompts, responses):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("reward exploded")
        return [0.5] * len(responses)

    grpo = module(
        rollout_mode="async", reward=fails_on_second_call, kl_beta=0.0, gradient_accumulation_steps=1
    )
    pids: list[int] = []

    class ServerPid(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pids.extend(server_pids(pl_module))

    with pytest.raises(Exception, match="reward exploded"):
        trainer(tmp_path, callbacks=[ServerPid()]).fit(grpo, loader([{"prompt": f"q{i}"} for i in range(4)]))
    assert not grpo.engine.running and len(pids) == 1
    assert wait_until_gone(pids[0], seconds=15)


def test_the_servers_threads_split_the_trainers(module):
    assert split_threads(2, None) == (1, 1)
    assert split_threads(16, 4) == (12, 4)
    assert split_threads(1, None) == (1, 1)
    with pytest.raises(ValueError, match="rollout_worker_threads"):
        module(rollout_mode="async", rollout_worker_threads=0)


@pytest.mark.integration
def test_async_step_cadence_callbacks_see_every_step_across_an_epoch_boundary(
    tmp_path, module, trainer, loader
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from forge_lightning.callbacks import HFCheckpoint

    pl.seed_everything(3)
    grpo = module(rollout_mode="async", gradient_accumulation_steps=1, kl_beta=0.0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=1, save_top_k=-1)
    callbacks = [RewardLogger(logging_steps=1), HFCheckpoint(save_steps=1, save_final=False), checkpoints]
    fitted = trainer(tmp_path, max_epochs=-1, max_steps=5, enable_checkpointing=True, callbacks=callbacks)
    fitted.fit(grpo, loader([{"prompt": f"q{i}"} for i in range(3)]))  # 3 batches an epoch
    assert fitted.global_step == 5
    # The rollout in flight at epoch 0's end trains in epoch 1's first batch: no step is skipped.
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1, 2, 3, 4, 5]
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == [f"epoch={int(s > 2)}-step={s}.ckpt" for s in range(1, 6)]  # epoch 0: a batch fills
    lines = (tmp_path / "training_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]


@pytest.mark.integration
def test_the_server_samples_validation_from_the_batchs_seed(tmp_path, module, trainer, loader, monkeypatch):
    """Sampled validation goes through the server, seeded from (seed, step, batch) as in-process
    sampling is: the same prompt in two batches gets two draws, and a second validation of the
    same weights repeats them whatever the global RNG holds."""
    records = [{"prompt": "1 + 2 =", "reference": "3"}] * 2  # one prompt, two batches
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    grpo = module(rollout_mode="async", val_num_generations=4, max_new_tokens=6)
    draws = []
    try:
        for i, global_seed in enumerate([1, 2]):
            torch.manual_seed(global_seed)
            root = tmp_path / str(i)
            trainer(root, callbacks=[RewardLogger()]).validate(grpo, loader(records))
            (path,) = (root / "validation").iterdir()
            draws.append(
                [
                    [s["completion"] for s in json.loads(line)["samples"]]
                    for line in path.read_text().splitlines()
                ]
            )
        assert isinstance(grpo.engine, RemoteEngine)  # the server sampled them
        # No fit told it a run folder: its files went to a temporary folder, not the working directory.
        folder = grpo.engine.placement.folder
        assert (folder / "server-1.log").is_file() and not folder.is_relative_to(tmp_path)
        assert not (tmp_path / "cwd" / "servers").exists()
    finally:
        grpo.stop_rollout_worker()
    assert draws[0] == draws[1]
    assert draws[0][0] != draws[0][1]  # batch 0's seed is not batch 1's


@pytest.mark.integration
def test_async_with_an_int8_sampler_corrects_by_its_logprobs(fit_async):
    _, _, logged = fit_async(records=3, rollout_precision="int8", rollout_correction="truncate")
    # The server's int8 copy's gap (about 3e-7 here); a float32 server's is about 1e-14.
    assert len(logged) == 3 and all(r["sampler_kl"] > 1e-9 for r in logged)
