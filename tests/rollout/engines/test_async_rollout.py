"""Asynchronous rollouts: the worker process, the weight ring, the module's pipeline, shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model

from forge_lightning.callbacks import RewardLogger
from forge_lightning.rollout.async_worker import (
    RolloutWorker,
    WeightRing,
    WorkerSettings,
    rollout_seed,
)
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.engines.weight_ring import check_rollout_device, resolved_rollout_device
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.sampler import encode_prompts
from forge_lightning.rollout.types import Rollout, completion_mask
from forge_lightning.run.fit import FitShape
from forge_lightning.settings.checks import validate_hparams

TEMPERATURE = 0.9

TESTS = Path(__file__).resolve().parents[2]


def worker_for(tokenizer, max_staleness: int = 1, **device_settings) -> RolloutWorker:
    """A one-thread worker; ``device_settings``: WorkerSettings' ``device`` and ``memory_fraction``."""
    settings = WorkerSettings(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=(tokenizer.eos_token_id,),
        scoring_temperature=TEMPERATURE,
        prefix_sharing=True,
        logprob_chunk_size=8,
        threads=1,
        **device_settings,
    )
    return RolloutWorker(settings, max_staleness)


def log_probs(model, tokenizer, prompt_ids, prompt_mask, completion_ids, group_size) -> torch.Tensor:
    mask = completion_mask(completion_ids, [tokenizer.eos_token_id])
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, mask, group_size, [])
    return LogProbScorer(temperature=TEMPERATURE).log_probs_no_grad(model, rollout) * mask


def test_the_ring_refuses_a_version_it_no_longer_holds(tiny_model):
    ring = WeightRing(tiny_model, slots=2)
    for version in range(3):
        with torch.no_grad():
            next(tiny_model.parameters()).fill_(float(version))
        ring.write(tiny_model, version)
    reader = make_model(tiny_model.config.vocab_size, seed=1)
    ring.read_into(reader, 2)
    assert float(next(reader.parameters()).detach().flatten()[0]) == 2.0
    ring.read_into(reader, 1)
    with pytest.raises(RuntimeError, match="version 0 is not in the ring"):
        ring.read_into(reader, 0)  # slot 0 holds version 2 now
    with pytest.raises(ValueError, match="at least 2 slots"):
        WeightRing(tiny_model, slots=1)


@pytest.mark.integration
def test_each_rollout_is_sampled_from_the_version_asked_for_with_its_seed(tiny_model, tokenizer):
    worker = worker_for(tokenizer)
    params = SamplingParams(10, temperature=TEMPERATURE)
    ids, mask = encode_prompts(tokenizer, ["abc", "de"], use_chat_template=False)
    version0 = make_model(len(tokenizer))
    version0.load_state_dict(tiny_model.state_dict())
    try:
        worker.start(tiny_model, version=0)
        first = worker.collect(worker.submit(ids, mask, 4, params, seed=rollout_seed(7, 0)))
        with torch.no_grad():
            for p in tiny_model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        worker.sync_weights(tiny_model)  # version 1 in the other slot; version 0 stays whole
        again = worker.collect(worker.submit(ids, mask, 4, params, seed=rollout_seed(7, 0), version=0))
        newer = worker.collect(worker.submit(ids, mask, 4, params, seed=rollout_seed(7, 0)))
        other_seed = worker.collect(worker.submit(ids, mask, 4, params, seed=rollout_seed(7, 1), version=0))
    finally:
        worker.close()
    assert (first.version, again.version, newer.version) == (0, 0, 1)
    torch.testing.assert_close(again.completion_ids, first.completion_ids, rtol=0, atol=0)
    assert not torch.equal(other_seed.completion_ids, first.completion_ids)
    # Each rollout's log-probs are those of the version that sampled it, not of the newest.
    for done, weights in ((first, version0), (newer, tiny_model)):
        expected = log_probs(weights, tokenizer, ids, mask, done.completion_ids, 4)
        got = done.behav_logp * completion_mask(done.completion_ids, [tokenizer.eos_token_id])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    stale = log_probs(tiny_model, tokenizer, ids, mask, first.completion_ids, 4)
    assert not torch.allclose(first.behav_logp * (stale != 0), stale, atol=1e-3)


@pytest.mark.parametrize(
    ("device", "fraction", "message"),
    [
        ("gpu0", None, "rollout_device='gpu0' is not a device torch understands"),
        ("cuda:x", None, "rollout_device='cuda:x' is not a device torch understands"),
        ("mps", None, "rollout_device='mps': the rollout worker samples on 'cpu' or 'cuda', not 'mps'"),
        (0, None, "rollout_device must be a device string"),
        ("cuda", 0.0, r"rollout_memory_fraction=0.0 must be in \(0, 1\)"),
        ("cuda:1", 1.0, r"rollout_memory_fraction=1.0 must be in \(0, 1\)"),
        (None, 0.3, "rollout_memory_fraction=0.3 caps a CUDA rollout worker's memory"),
        ("cpu", 0.3, "rollout_memory_fraction=0.3 caps a CUDA rollout worker's memory"),
    ],
)
def test_rollout_device_settings_are_refused_by_name(tokenizer, device, fraction, message):
    with pytest.raises(ValueError, match=message):
        check_rollout_device(device, fraction)
    with pytest.raises(ValueError, match=message):  # the worker's settings check themselves
        worker_for(tokenizer, device=device, memory_fraction=fraction)


def test_a_cuda_device_setting_is_checked_without_a_gpu_and_resolved_against_the_machine(monkeypatch):
    check_rollout_device("cuda:1", 0.3)  # a well-formed setting needs no GPU to pass the check
    assert resolved_rollout_device(None, torch.device("cpu")) == torch.device("cpu")
    assert resolved_rollout_device("cpu", torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # "cuda" without an index is the trainer's own GPU.
    assert resolved_rollout_device("cuda", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert resolved_rollout_device("cuda:0", torch.device("cuda", 1)) == torch.device("cuda", 0)
    beyond = r"rollout_device='cuda:3' asks for GPU 3, but torch.cuda.device_count\(\) is 2"
    with pytest.raises(ValueError, match=beyond):
        resolved_rollout_device("cuda:3", torch.device("cpu"))


def test_asking_for_a_gpu_this_machine_lacks_is_refused_before_a_worker_is_spawned(
    monkeypatch, tiny_model, tokenizer
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    worker = worker_for(tokenizer, device="cuda", memory_fraction=0.3)
    with pytest.raises(ValueError, match=r"rollout_device='cuda' asks for a CUDA GPU, but .*is False"):
        worker.start(tiny_model)
    assert not worker.running and worker.process is None


@pytest.mark.integration
def test_a_cpu_device_setting_samples_what_the_default_samples(tiny_model, tokenizer):
    ids, mask = encode_prompts(tokenizer, ["abc", "de"], use_chat_template=False)
    params = SamplingParams(8, temperature=TEMPERATURE)
    workers = [worker_for(tokenizer), worker_for(tokenizer, device="cpu")]
    try:
        for worker in workers:  # both spawn before either is waited for
            worker.start(tiny_model)
        tickets = [worker.submit(ids, mask, 3, params, seed=rollout_seed(5, 0)) for worker in workers]
        default, cpu = (worker.collect(ticket) for worker, ticket in zip(workers, tickets))
    finally:
        for worker in workers:
            worker.close()
    assert workers[1].device == torch.device("cpu")
    torch.testing.assert_close(cpu.completion_ids, default.completion_ids, rtol=0, atol=0)
    torch.testing.assert_close(cpu.behav_logp, default.behav_logp, rtol=0, atol=0)


@pytest.mark.integration
def test_a_worker_that_dies_is_an_error_that_names_it(tiny_model, tokenizer):
    worker = worker_for(tokenizer)
    ids, mask = encode_prompts(tokenizer, ["abc"], use_chat_template=False)
    worker.start(tiny_model)
    worker.collect(worker.submit(ids, mask, 2, SamplingParams(4), seed=1))  # up and running
    os.kill(worker.process.pid, signal.SIGKILL)
    ticket = worker.submit(ids, mask, 2, SamplingParams(4), seed=2)
    with pytest.raises(RuntimeError, match=r"rollout worker process .* died with exit code -9"):
        worker.collect(ticket)
    assert not worker.running


@pytest.mark.integration
def test_a_failure_inside_the_worker_comes_back_with_its_traceback(tiny_model, tokenizer):
    worker = worker_for(tokenizer)
    worker.start(tiny_model)
    too_big = torch.full((1, 3), tiny_model.config.vocab_size + 5)  # no such token
    try:
        with pytest.raises(RuntimeError, match=r"(?s)rollout worker failed on batch 1.*Traceback"):
            worker.collect(worker.submit(too_big, torch.ones_like(too_big), 2, SamplingParams(4), seed=1))
    finally:
        worker.close()
    assert not worker.running


@pytest.mark.integration
def test_the_worker_exits_when_its_trainer_is_killed(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path[:0] = [{str(TESTS)!r}, {str(Path(__file__).resolve().parent)!r}]\n"
        "from helpers.models import make_model, make_tokenizer\n"
        "from test_async_rollout import worker_for\n"
        "if __name__ == '__main__':\n"
        "    tok = make_tokenizer()\n"
        "    worker = worker_for(tok)\n"
        "    worker.start(make_model(len(tok)))\n"
        "    print(worker.process.pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    pid = int(done.stdout.split()[0])
    assert wait_until_gone(pid, seconds=30), f"worker {pid} outlived its killed trainer"


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
def test_async_trains_every_batch_once_one_step_behind_and_stops_its_worker(fit_async):
    pids: list[int] = []

    class WorkerPid(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pids.append(pl_module.engine.process.pid)

    with pytest.warns(UserWarning, match="no trainer.max_steps: the fit's last 2 optimizer steps"):
        grpo, trainer, logged = fit_async(records=5, callbacks=[WorkerPid()])
    assert trainer.global_step == 5  # the fit's last batch also trains the one still in flight
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    # The first rollout is sampled by the weights it trains; every later one, one step older.
    assert [r["staleness"] for r in logged] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert "correction_weight_mean" not in logged[0]
    assert all(0.5 < r["correction_weight_mean"] < 2.0 for r in logged[1:])
    assert sum(r["num_tokens"] > 0 for r in logged) == 5
    assert all(r["regenerated"] == 0 for r in logged)
    assert not grpo.engine.running
    assert wait_until_gone(pids[0], seconds=10)


@pytest.mark.integration
def test_stale_rollouts_are_sampled_again_and_counted(fit_async):
    class SkipVersions(pl.Callback):
        """Writes two extra weight versions after batch 1, so that the rollout in flight, sampled
        before them, is three versions old when due: beyond max_staleness 1."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                worker = pl_module.engine
                for item in pl_module.rollout_source.in_flight:
                    item.finished = item.finished or worker.collect(item.ticket)
                worker.sync_weights(pl_module.model)
                worker.sync_weights(pl_module.model)

    _, _, logged = fit_async(records=4, callbacks=[SkipVersions()])
    # Step 2 trains batch 1, handed before the extra versions: sampled again, from the newest.
    assert [r["regenerated"] for r in logged] == [0.0, 1.0, 0.0, 0.0]
    assert logged[1]["staleness"] == 0.0
    assert max(r["staleness_max"] for r in logged) <= 1


@pytest.mark.parametrize(
    "setting",
    [
        {"top_p": 0.9},
        {"top_k": 5},
        {"generation_backend": "vllm"},
        {"dynamic_sampling": True},
        {"num_iterations": 2},
    ],
)
def test_async_refuses_what_it_does_not_support_yet(setting):
    with pytest.raises(ValueError, match="rollout_mode='async' does not support"):
        validate_hparams({"rollout_mode": "async", **setting})


def test_async_refuses_several_devices(module):
    grpo = module(rollout_mode="async")
    with pytest.raises(ValueError, match="one device for now: it does not support DDP or FSDP"):
        grpo.rollout_source.on_fit_start(FitShape(world_size=2), grpo.model, sharded=False)
    assert not grpo.engine or not grpo.engine.running


@pytest.mark.integration
def test_a_failing_fit_stops_the_worker(tmp_path, module, trainer, loader):
    calls = []

    def fails_on_second_call(prompts, responses):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("reward exploded")
        return [0.5] * len(responses)

    grpo = module(
        rollout_mode="async", reward=fails_on_second_call, kl_beta=0.0, gradient_accumulation_steps=1
    )
    with pytest.raises(Exception, match="reward exploded"):
        trainer(tmp_path).fit(grpo, loader([{"prompt": f"q{i}"} for i in range(4)]))
    assert not grpo.engine.running


def test_worker_threads_split_the_trainers(module):
    from forge_lightning.rollout.async_worker import split_threads

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
def test_the_worker_samples_validation_from_the_batchs_seed(tmp_path, module, trainer, loader):
    """Sampled validation goes through the worker, seeded from (seed, step, batch) as in-process
    sampling is: the same prompt in two batches gets two draws, and a second validation of the
    same weights repeats them whatever the global RNG holds."""
    records = [{"prompt": "1 + 2 =", "reference": "3"}] * 2  # one prompt, two batches
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
        assert isinstance(grpo.engine, RolloutWorker)  # the worker sampled them
    finally:
        grpo.stop_rollout_worker()
    assert draws[0] == draws[1]
    assert draws[0][0] != draws[0][1]  # batch 0's seed is not batch 1's


@pytest.mark.integration
def test_a_worker_with_a_precision_samples_with_a_copy_of_each_version(tiny_model, tokenizer):
    worker = worker_for(tokenizer, precision="int8")
    params = SamplingParams(8, temperature=TEMPERATURE)
    ids, mask = encode_prompts(tokenizer, ["abc", "de"], use_chat_template=False)
    try:
        worker.start(tiny_model, version=0)
        first = worker.collect(worker.submit(ids, mask, 3, params, seed=rollout_seed(7, 0)))
        with torch.no_grad():
            tiny_model.lm_head.weight.mul_(3.0)
        worker.sync_weights(tiny_model)
        newer = worker.collect(worker.submit(ids, mask, 3, params, seed=rollout_seed(7, 1)))
    finally:
        worker.close()
    # The int8 copy's log-probs: near the version's own, not equal to them.
    policy = log_probs(tiny_model, tokenizer, ids, mask, newer.completion_ids, 3)
    gap = newer.behav_logp * (policy != 0) - policy
    assert newer.version == 1 and 1e-4 < gap.abs().max() < 0.5
    assert first.version == 0


@pytest.mark.integration
def test_async_with_an_int8_sampler_corrects_by_its_logprobs(fit_async):
    _, _, logged = fit_async(records=3, rollout_precision="int8", rollout_correction="truncate")
    # The int8 copy's gap (about 3e-7 here); the worker's float32 policy's is about 1e-14.
    assert len(logged) == 3 and all(r["sampler_kl"] > 1e-9 for r in logged)
