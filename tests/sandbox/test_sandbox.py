"""The sandbox's pool (sandbox/pool.py): calls in fresh, limited worker processes, a hung call
killed with everything it started, a call's own exit or crash that call's named error, what cannot
cross refused by name at the start, sandboxed rewards at once, and a machine without the
mechanisms refused with the reason."""

from __future__ import annotations

import os
import time

import pytest
from helpers import hostile
from helpers.sandbox import processes_naming

from forge_lightning.rewards.batch_scoring import score
from forge_lightning.rewards.library import BaseReward, CompositeReward, RewardModel
from forge_lightning.sandbox import isolation
from forge_lightning.sandbox.pool import (
    Sandbox,
    SandboxCallError,
    SandboxLimits,
    SandboxTimeout,
    SandboxUnavailable,
)

# A test that starts sandboxed workers runs where the machine can isolate them (conftest.py).
pytestmark = pytest.mark.usefixtures("isolating_machine")


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.01)
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


@pytest.fixture
def pool():
    sandbox = Sandbox(workers=1, limits=SandboxLimits(memory_mb=256, cpu_seconds=5))
    sandbox.prepare({"hostile": hostile.where})
    yield sandbox
    sandbox.close()


@pytest.mark.integration
def test_a_hung_call_is_killed_with_every_process_it_started_and_its_worker_replaced(pool):
    token = f"forge-sandbox-test-{os.getpid()}-{time.monotonic_ns()}"
    pool.call(hostile.where, (), {}, 5.0, "warm-up")
    workers = pool.worker_pids()
    start = time.monotonic()
    with pytest.raises(SandboxTimeout, match="'spinner' ran past its 1s in the sandbox and was killed"):
        pool.call(hostile.hangs_with_children, (token,), {}, 1.0, "'spinner'")
    assert time.monotonic() - start < 2.0  # the timeout + 1 s
    assert gone_within(workers, 1.0), "the worker outlived its timeout"
    assert processes_naming(token) == [], "a process the call started outlived it"
    assert pool.call(hostile.where, (), {}, 5.0, "after")["files"] == []  # the batch goes on
    assert pool.worker_pids() and set(pool.worker_pids()).isdisjoint(workers)  # in a new worker


@pytest.mark.integration
@pytest.mark.parametrize(
    "fn, cause",
    [
        (hostile.quits, r"raised SystemExit\(3\) from its own code"),
        (hostile.interrupts, r"raised KeyboardInterrupt\(\) from its own code"),
        (hostile.dies_hard, "exited with code 7 without answering"),
        (hostile.segfaults, "was killed by signal SIGSEGV"),
    ],
    ids=["SystemExit", "KeyboardInterrupt", "os._exit", "segfault"],
)
def test_a_calls_own_exit_or_crash_is_that_calls_named_error(pool, fn, cause, caplog):
    with pytest.raises(SandboxCallError, match=f"^reward 'r' {cause}"):
        pool.call(fn, (), {}, 5.0, "reward 'r'")
    assert "reward 'r'" in caplog.text  # the cause is in the log too
    with pytest.raises(ValueError, match="no good: 3"):  # a raise crosses as itself
        pool.call(hostile.raises, (3,), {}, 5.0, "raises")
    assert pool.call(hostile.where, (), {}, 5.0, "after")["files"] == []


@pytest.mark.integration
def test_workers_are_fresh_interpreters_and_each_call_starts_in_an_empty_folder(pool, monkeypatch):
    monkeypatch.setattr(hostile, "MARK", "set in the trainer")
    assert pool.call(hostile.mark, (), {}, 5.0, "mark") == "as imported"  # not a fork of this process
    folder = pool.call(hostile.leave_a_file, (), {}, 5.0, "leaves")
    seen = pool.call(hostile.where, (), {}, 5.0, "where")
    assert seen["cwd"] == folder and seen["files"] == []
    assert seen["pid"] > 1  # in a pid namespace of its own, under the worker (its pid 1)


@pytest.mark.integration
def test_what_cannot_be_pickled_is_refused_by_name_at_the_start():
    def local(prompts, responses):
        return [0.0] * len(responses)

    sandbox = Sandbox(1)
    with pytest.raises(TypeError, match="reward 'local' cannot run under sandbox: process"):
        sandbox.prepare({"reward 'local'": local})
    with pytest.raises(TypeError, match="tool 'lambda' cannot run under sandbox: process"):
        sandbox.prepare({"tool 'lambda'": lambda x: x})
    assert sandbox.worker_pids() == []  # refused before any worker started


@pytest.mark.integration
def test_sandboxed_rewards_run_at_once_and_their_scores_come_back_in_order():
    sandbox = Sandbox(workers=3)
    sandbox.prepare({"sleeps": hostile.sleeps})
    composite = CompositeReward(
        [(hostile.sleeps, 1.0, "a"), (hostile.awaits, 1.0, "b"), (hostile.sleeps, 1.0, "c")]
    )
    try:
        score(composite, ["p"], ["r"], sandbox=sandbox)  # the workers start
        start = time.perf_counter()
        scored = score(composite, ["p"], ["r"], sandbox=sandbox, reward_timeout=5.0)
        wall = time.perf_counter() - start
    finally:
        sandbox.close()
    assert scored.components == {"a": [1.0], "b": [2.0], "c": [1.0]}
    assert wall < 1.4, f"3 rewards of 0.6 s took {wall:.2f}s: not at once (sum 1.8 s)"


def test_a_machine_without_the_mechanisms_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(isolation, "_probed", [])
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="needs the unshare command"):
        Sandbox(1).check()
    monkeypatch.setattr(isolation.shutil, "which", lambda name: "/usr/bin/unshare")
    monkeypatch.setattr(isolation, "abi_version", lambda: 0)
    with pytest.raises(SandboxUnavailable, match="needs Landlock"):
        Sandbox(1).check()


class HoldsAModel(BaseReward):
    """Stands for a RewardModel: a reward that stays in the trainer's process under a sandbox."""

    in_process = True

    def __call__(self, prompts, responses, **kwargs):
        return [float(os.getpid())] * len(responses)


@pytest.mark.integration
def test_a_reward_that_holds_a_model_stays_in_process_beside_sandboxed_ones():
    assert RewardModel.in_process
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"code": hostile.counts})
    try:
        scored = score(CompositeReward([(HoldsAModel(), 1.0, "model"), (hostile.counts, 1.0, "code")]),
                       ["p"], ["abc"], sandbox=sandbox)  # fmt: skip
    finally:
        sandbox.close()
    assert scored.components == {"model": [float(os.getpid())], "code": [3.0]}


@pytest.mark.integration
def test_the_module_refuses_at_its_start_what_cannot_run_in_its_sandbox(module):
    def local(prompts, responses):
        return [0.0] * len(responses)

    with pytest.raises(TypeError, match="reward 'local' cannot run under sandbox: process"):
        module(reward=local, sandbox="process")
    with pytest.raises(TypeError, match="reward 'wants_log_metric' takes log_metric, which cannot cross"):
        module(reward=wants_log_metric, sandbox="process")

    class Local(hostile.Counter):
        pass

    with pytest.raises(ValueError, match="environment_factory takes importable functions and classes"):
        module(environment_factory=Local, sandbox="process")
    assert module(environment_factory="helpers.hostile.Counter", sandbox="process").sandbox is not None
    assert module(reward=hostile.counts, sandbox="process").sandbox.worker_pids() == []  # none yet


def wants_log_metric(prompts, responses, log_metric):
    return [0.0] * len(responses)


def test_a_resumed_run_may_move_its_rewards_into_the_sandbox_or_out():
    from forge_lightning.run.resume import resume_differences
    from forge_lightning.settings.groups import CHANGEABLE_ON_RESUME

    saved = {"sandbox": "thread", "sandbox_workers": 2, "sandbox_memory_mb": 2048, "sandbox_cpu_seconds": 60}
    current = {"sandbox": "process", "sandbox_workers": 4, "sandbox_memory_mb": 512, "sandbox_cpu_seconds": 5}
    fixed, changeable = resume_differences(saved, current, CHANGEABLE_ON_RESUME)
    assert fixed == [] and len(changeable) == 4


@pytest.mark.integration
def test_a_sandboxed_reward_reads_trainer_state_and_goes_without_log_metric():
    from forge_lightning.rewards.extras import RewardExtras

    extras = RewardExtras(7, 1, 10).arguments()  # trainer_state and log_metric, a bound method
    sandbox = Sandbox(workers=1)
    sandbox.prepare({"reads_state": hostile.reads_state})
    try:
        scored = score(hostile.reads_state, ["p"], ["r"], sandbox=sandbox, reward_timeout=5.0, **extras)
    finally:
        sandbox.close()
    assert scored.total == [7.0]
