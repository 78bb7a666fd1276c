"""Resume after SIGKILL: same steps, same learning rate, same next prompts, same reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forge_lightning.run.checkpoint_io import AtomicCheckpointIO

TESTS = Path(__file__).resolve().parents[1]

CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  max_steps: 5
  default_root_dir: {out}
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{every_n_train_steps: 1, save_last: true}}
    - class_path: forge_lightning.callbacks.RewardLogger
      init_args: {{logging_steps: 1}}
model:
  model: {model}
  reward: helpers.faults.kill_on_call
  group_size: 4
  max_new_tokens: 6
  learning_rate: 0.01
  warmup_steps: 2
  gradient_accumulation_steps: 1
  kl_beta: 0.05
data:
  source: mock
  prompts_per_step: 2
"""


VALIDATION_EVERY_2 = "  enable_progress_bar: false\n  val_check_interval: 2\n  num_sanity_val_steps: 0\n"


def fit(config: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    (done,) = side_by_side((config, env, *extra))
    return done


def side_by_side(*runs: tuple) -> list[subprocess.CompletedProcess]:
    """``forge-lightning fit`` for each ``(config, env, *extra)`` at once, one CPU thread each (the
    tiny runs' time is mostly Python's imports, which two cores run two at a time)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "forge_lightning", "fit", "--config", str(config), *extra],
            env={**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for config, env, *extra in runs
    ]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]


def run_dir(tmp_path: Path, name: str, model: Path) -> tuple[Path, Path]:
    out = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG.format(out=out, model=model))
    return out, config


@pytest.mark.integration
@pytest.mark.parametrize("rollout_mode", ["sync", "async", "tools", "async_tools"])
def test_resume_after_sigkill_continues_exactly_where_it_stopped(request, tmp_path, rollout_mode):
    # "tools": sync rollouts whose completions call the plain calculator (conftest's bigram model
    # writes "3+4=" most of the time); the tool is deterministic and has no timeout in play.
    # "async_tools": the same, the rollout worker running the tool loop.
    tools = rollout_mode in ("tools", "async_tools")
    model = request.getfixturevalue("calculator_model_dir" if tools else "tiny_model_dir")
    settings = "  calculator: plain\n  max_new_tokens: 10\n" if tools else ""
    if rollout_mode != "tools":
        settings += f"  rollout_mode: {rollout_mode.removesuffix('_tools')}\n"

    def config(name: str) -> tuple[Path, Path]:
        out, path = run_dir(tmp_path, name, model)
        text = path.read_text().replace("  kl_beta: 0.05\n", "  kl_beta: 0.05\n" + settings)
        if rollout_mode == "sync":  # a sampled validation every 2 batches: one before the kill, one after
            text = text.replace("  enable_progress_bar: false\n", VALIDATION_EVERY_2)
            text = text.replace("  kl_beta: 0.05\n", "  kl_beta: 0.05\n  val_num_generations: 2\n")
        if tools:  # a smaller step, so that the policy keeps calling
            text = text.replace("  max_new_tokens: 6\n", "").replace(
                "learning_rate: 0.01", "learning_rate: 0.002"
            )
        path.write_text(text)
        return out, path

    straight, straight_cfg = config("straight")
    killed, killed_cfg = config("killed")
    tag = f"forge-resume-{os.getpid()}-{rollout_mode}"
    # SIGKILL inside step 4's reward (async: step 4 trains the rollout of batch 4, handed at step 3;
    # the checkpoint of step 3 holds that rollout, finished); sync: the validation after step 2
    # calls the reward too.
    kill_at = "5" if rollout_mode == "sync" else "4"
    env = {"FORGE_CALLS": str(tmp_path / "calls_b"), "FORGE_KILL_AT": kill_at, "FORGE_TEST_TAG": tag}
    done, crash = side_by_side((straight_cfg, {"FORGE_CALLS": str(tmp_path / "calls_a")}), (killed_cfg, env))
    assert done.returncode == 0, done.stderr[-3000:]
    assert crash.returncode == -9
    assert [r["step"] for r in records(killed)] == [1, 2, 3]
    outlived = no_process_with(tag, seconds=30)
    assert not outlived, f"processes of the killed run outlived it by 30 s: {outlived}"

    resumed = fit(killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_c")}, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    after, expected = records(killed), records(straight)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]  # no duplicates, never backwards
    for got, want in zip(after, expected):
        keys = ("loss", "reward", "kl", "lr", "grad_norm", "completion_length", "num_tokens")
        for key in keys + (("tool_calls", "turns") if tools else ()):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)
    if tools:
        assert all(r["tool_calls"] > 0 for r in expected), [r["tool_calls"] for r in expected]
    if rollout_mode == "sync":  # the validation after the resume sampled what the straight run's did
        validated = {p.name: p.read_text() for p in (straight / "validation").iterdir()}
        assert sorted(validated) == ["step-2.jsonl", "step-4.jsonl"]
        for name, text in validated.items():
            assert (killed / "validation" / name).read_text() == text, name
    # The reference the resumed run used is the original policy, not the step-3 one.
    original = load_file(model / "model.safetensors")
    reference = load_file(killed / "reference" / "model.safetensors")
    for key, value in original.items():
        torch.testing.assert_close(reference[key], value)


def no_process_with(tag: str, seconds: float) -> list[str]:
    """The live processes that, after ``seconds``, still have ``FORGE_TEST_TAG={tag}`` in their
    environment (each as its pid, state and command line); empty as soon as none has."""
    import time

    needle = f"FORGE_TEST_TAG={tag}".encode()
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and needle in (proc / "environ").read_bytes():
                    state = (proc / "stat").read_text().split(") ")[1].split()[0]
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    alive += [] if state == "Z" else [f"{proc.name} ({state}): {command.strip()}"]
            except (OSError, IndexError):
                continue
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.3)


def test_a_crash_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, target)

    def torn_save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError(28, "killed mid-write")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="mid-write"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, target)
    monkeypatch.undo()
    assert io.load_checkpoint(target)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.integration
def test_resume_with_dynamic_sampling_after_a_kill_in_a_steps_second_round(tiny_model_dir, tmp_path):
    def config(name: str) -> tuple[Path, Path]:
        out, path = run_dir(tmp_path, name, tiny_model_dir)
        text = path.read_text().replace(
            "reward: helpers.faults.kill_on_call", "reward: helpers.faults.flat_on_odd_calls"
        )
        path.write_text(text.replace("  kl_beta: 0.05\n", "  kl_beta: 0.05\n  dynamic_sampling: true\n"))
        return out, path

    straight, straight_cfg = config("straight")
    killed, killed_cfg = config("killed")
    done, crash = side_by_side(
        (straight_cfg, {"FORGE_CALLS": str(tmp_path / "calls_a")}),
        (killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_b"), "FORGE_KILL_AT": "4"}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = records(straight)
    # A flat round, then an informative one (after the epoch's validation call, the order shifts).
    assert [r["sampling_rounds"] for r in expected][:4] == [2.0] * 4
    assert [r["groups_dropped"] for r in expected][:4] == [2.0] * 4

    assert crash.returncode == -9  # inside step 2's second round
    assert [r["step"] for r in records(killed)] == [1]
    resumed = fit(killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_c")}, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = records(killed)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    for got, want in zip(after, expected):
        for key in ("loss", "reward", "kl", "lr", "grad_norm", "sampling_rounds", "groups_dropped"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)


@pytest.mark.integration
def test_resume_of_a_generation_split_into_steps_redoes_the_generation_killed(tiny_model_dir, tmp_path):
    # steps_per_generation 2: each batch of 4 prompts is one generation (one reward call) for two
    # optimizer steps; checkpoints fall between generations, every 2 steps.
    def config(name: str) -> tuple[Path, Path]:
        out, path = run_dir(tmp_path, name, tiny_model_dir)
        text = (
            path.read_text()
            .replace("max_steps: 5", "max_steps: 6")
            .replace("prompts_per_step: 2", "prompts_per_step: 4")
        )
        text = text.replace("every_n_train_steps: 1", "every_n_train_steps: 2")
        path.write_text(text.replace("  kl_beta: 0.05\n", "  kl_beta: 0.05\n  steps_per_generation: 2\n"))
        return out, path

    straight, straight_cfg = config("straight")
    killed, killed_cfg = config("killed")
    done, crash = side_by_side(
        (straight_cfg, {"FORGE_CALLS": str(tmp_path / "calls_a")}),
        (killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_b"), "FORGE_KILL_AT": "3"}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = records(straight)
    assert [r["step"] for r in expected] == [2, 4, 6]

    assert crash.returncode == -9  # inside the third generation's reward, after step 4's checkpoint
    assert [r["step"] for r in records(killed)] == [2, 4]
    resumed = fit(killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_c")}, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = records(killed)
    assert [r["step"] for r in after] == [2, 4, 6]
    for got, want in zip(after, expected):
        for key in ("loss", "reward", "kl", "lr", "grad_norm", "completion_length", "num_tokens"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)


def test_checkpoints_are_written_beside_their_destination_not_through_tmpdir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmpdir"))  # a $TMPDIR that fails
    target = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 3, "w": torch.ones(2)}, target)
    assert AtomicCheckpointIO().load_checkpoint(target)["step"] == 3


def test_a_failed_checkpoint_write_names_the_file(tmp_path, monkeypatch):
    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    target = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    with pytest.raises(OSError, match=r"could not write .*checkpoints/epoch=0-step=2.ckpt.*No space left"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, target)
    assert list(target.parent.iterdir()) == []


ACCUMULATION_CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  max_steps: 3
  default_root_dir: {out}
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  callbacks:
    - class_path: forge_lightning.callbacks.KillPoint
hf_checkpoint:
  save_steps: 1
checkpoint:
  every_n_train_steps: 1
  save_last: true
reward_logger:
  logging_steps: 1
model:
  model: {model}
  reward: helpers.faults.kill_on_call
  group_size: 4
  max_new_tokens: 6
  learning_rate: 0.01
  warmup_steps: 1
  lr_schedule: cosine
  gradient_accumulation_steps: 2
  kl_beta: 0.05
data:
  source: mock
  prompts_per_step: 2
"""


@pytest.fixture(scope="module")
def uninterrupted_accumulation_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    config = out.parent / f"{out.name}.yaml"
    config.write_text(ACCUMULATION_CONFIG.format(out=out, model=tiny_model_dir))
    done = fit(config, {"FORGE_CALLS": str(out.parent / f"{out.name}.calls")})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# Each chain's first kill lands at a moment that matters in step 2 (its reward calls are 3 and 4:
# one per batch); the next start resumes from step 1 and is killed in its first step's second
# batch, after the first one ended; the last start runs to the end.
@pytest.mark.integration
@pytest.mark.parametrize(
    "first_kill",
    [
        {"FORGE_KILL_AT": "4"},  # between step 2's two batches
        {"FORGE_KILL_POINT": "write@2/last.ckpt"},  # while step 2's Lightning checkpoint is written
        {"FORGE_KILL_POINT": "write@2/2"},  # while step 2's HF folder is written
    ],
    ids=["between-batches", "lightning-checkpoint", "hf-folder"],
)
def test_kill_chains_with_gradient_accumulation_resume_exactly(
    uninterrupted_accumulation_run, tiny_model_dir, tmp_path, first_kill
):
    out = tmp_path / "killed"
    config = tmp_path / "killed.yaml"
    config.write_text(ACCUMULATION_CONFIG.format(out=out, model=tiny_model_dir))
    resume = ("--ckpt_path", "last")
    starts = [({**first_kill}, ()), ({"FORGE_KILL_AT": "2"}, resume), ({}, resume)]
    for i, (env, args) in enumerate(starts):
        run = fit(config, {"FORGE_CALLS": str(tmp_path / f"calls{i}"), **env}, *args)
        assert run.returncode == (0 if i == len(starts) - 1 else -9), (i, run.stderr[-3000:])

    straight = uninterrupted_accumulation_run
    got, want = records(out), records(straight)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        for key in ("loss", "reward", "kl", "lr", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    for name in ("1", "2", "3", "final"):
        weights = load_file(out / name / "model.safetensors")
        for key, value in load_file(straight / name / "model.safetensors").items():
            torch.testing.assert_close(weights[key], value, msg=f"{name}/{key}")
    # Only what the uninterrupted run keeps: no step checkpoint left behind by a kill.
    kept = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert kept == ["epoch=0-step=3.ckpt", "last.ckpt"]


CURRICULUM = """    - class_path: forge_lightning.callbacks.SettledPromptFilter
      init_args: {window: 2, min_visits: 1, threshold: 0.7}
"""


@pytest.mark.integration
def test_resume_with_the_difficulty_curriculum_drops_what_the_uninterrupted_run_drops(
    tiny_model_dir, tmp_path
):
    def config(name: str) -> tuple[Path, Path]:
        out, path = run_dir(tmp_path, name, tiny_model_dir)
        text = path.read_text().replace(
            "reward: helpers.faults.kill_on_call", "reward: helpers.faults.solved_below_13"
        )
        text = text.replace(
            "      init_args: {logging_steps: 1}\n", "      init_args: {logging_steps: 1}\n" + CURRICULUM
        )
        # Four prompts (two always solved), two batches an epoch; no validation: call n is batch n's.
        text = text.replace(
            "  enable_model_summary: false\n", "  enable_model_summary: false\n  limit_val_batches: 0\n"
        )
        path.write_text(text + "  max_samples: 4\n")
        return out, path

    straight, straight_cfg = config("straight")
    killed, killed_cfg = config("killed")
    done, crash = side_by_side(
        (straight_cfg, {"FORGE_CALLS": str(tmp_path / "calls_a")}),
        (killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_b"), "FORGE_KILL_AT": "4"}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = records(straight)
    # Nothing is known in the first epoch; then prompts whose groups all passed (or failed) go, from
    # the history in the checkpoint after the kill. (A step with every group dropped has no loss.)
    assert [r["groups_filtered"] for r in expected] == [0.0, 0.0, 1.0, 1.0, 2.0]

    assert crash.returncode == -9  # inside step 4's reward
    assert [r["step"] for r in records(killed)] == [1, 2, 3]
    resumed = fit(killed_cfg, {"FORGE_CALLS": str(tmp_path / "calls_c")}, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = records(killed)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    for got, want in zip(after, expected):
        assert got.keys() == want.keys(), got["step"]
        for key in ("loss", "reward", "kl", "lr", "grad_norm", "num_tokens", "groups_filtered"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)
