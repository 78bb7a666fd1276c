"""A run owns its folder, resumes honestly or says why not, never saves a NaN, and stops cleanly
on SIGTERM: the red team's cases, each on a tiny model through the CLI."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.models import make_model, make_tokenizer
from lightning.pytorch.callbacks import ModelCheckpoint

from forge_lightning.callbacks import HFCheckpoint
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.run.folder import RunFolder, RunFolderError, remove_untracked_checkpoints

TESTS = Path(__file__).resolve().parents[1]

CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  max_steps: {steps}
  default_root_dir: {out}
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{every_n_train_steps: 1, save_last: true}}
    - class_path: forge_lightning.callbacks.RewardLogger
      init_args: {{logging_steps: 1}}
{extra_callbacks}model:
  model: {model}
  reward: helpers.faults.{reward}
  group_size: 4
  max_new_tokens: 6
  learning_rate: 0.01
  lr_schedule: constant
  gradient_accumulation_steps: {accumulation}
  kl_beta: 0.05
data:
  source: mock
  prompts_per_step: 2
"""


@pytest.fixture
def run(tmp_path, tiny_model_dir, monkeypatch):
    """``run(*args, steps=2, ...)``: ``forge-lightning fit`` in this process, in ``tmp_path/run``."""
    monkeypatch.setenv("FORGE_CALLS", str(tmp_path / "calls"))
    config = tmp_path / "run.yaml"

    def fit(
        *args: str, steps: int = 2, accumulation: int = 1, reward: str = "kill_on_call", callbacks: str = ""
    ):
        config.write_text(
            CONFIG.format(
                steps=steps,
                out=tmp_path / "run",
                model=tiny_model_dir,
                reward=reward,
                accumulation=accumulation,
                extra_callbacks=callbacks,
            )
        )
        build_cli(["fit", "--config", str(config), *args])
        return tmp_path / "run"

    fit.config = config
    return fit


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "training_log.jsonl").read_text().splitlines()]


def subprocess_fit(
    config: Path, env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge_lightning", "fit", "--config", str(config), *args],
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- 1. one run per folder ------------------------------------------------------------------------


@pytest.mark.integration
def test_a_second_process_in_a_held_folder_is_refused_naming_the_holder(run, tmp_path):
    root = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from forge_lightning.run.folder import RunFolder; "
         f"RunFolder({str(root)!r}).lock(); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=f"in use by another run \\(PID {holder.pid}\\)"):
            run()
        assert not (root / "training_log.jsonl").exists()
    finally:
        holder.kill()  # a killed holder releases the lock
        holder.wait()
    run()
    assert steps_logged(root) == [1, 2]


@pytest.mark.integration
def test_a_fresh_fit_over_a_run_is_refused_and_overwrite_replaces_it(run):
    out = run()
    log_before = (out / "training_log.jsonl").read_text()
    with pytest.raises(SystemExit, match="already holds a run.*--ckpt_path last.*--overwrite true"):
        run()
    assert (out / "training_log.jsonl").read_text() == log_before
    run("--overwrite", "true", steps=3)
    assert steps_logged(out) == [1, 2, 3]  # one run's steps, not 1, 2, 1, 2, 3


def needs_difficulty(prompts: list[str], responses: list[str], difficulty: list[str]) -> list[float]:
    return [0.0] * len(responses)


@pytest.mark.integration
def test_a_fit_that_took_no_step_leaves_the_folder_free(run):
    # Refused at the first batch (the data has no difficulty column), after reference/ is written.
    with pytest.raises(ValueError, match="needs difficulty"):
        run("--model.reward", "test_run_folder.needs_difficulty")
    assert (run.config.parent / "run" / "reference").is_dir()
    out = run()  # the corrected command is a fresh run, not "already holds a run"
    assert steps_logged(out) == [1, 2]


def test_checkpoint_folders_outside_the_run_folder_are_owned_too(tmp_path, tiny_model_dir):
    shared = tmp_path / "shared_ckpts"
    first = RunFolder(tmp_path / "a", [shared])
    first.lock()
    with pytest.raises(RunFolderError, match=f"{shared} is in use"):
        RunFolder(tmp_path / "b", [shared]).lock()
    first.unlock()
    shared.mkdir(exist_ok=True)
    (shared / "epoch=0-step=1.ckpt").write_bytes(b"run a's")
    with pytest.raises(RunFolderError, match="already holds a run"):
        RunFolder(tmp_path / "b", [shared]).prepare(resume=False)


# -- 2. resume continues this run, or says why not -----------------------------------------------


@pytest.mark.integration
def test_ckpt_path_last_without_last_ckpt_resumes_from_the_newest_complete_checkpoint(run, tmp_path):
    out = run()
    checkpoints = out / "checkpoints"
    (checkpoints / "last.ckpt").unlink()  # killed before last.ckpt was copied
    (checkpoints / ".last.ckpt.tmp-123-0123abcd").write_bytes(b"a torn write")
    run("--ckpt_path", "last", steps=3)
    assert steps_logged(out) == [1, 2, 3]  # went on from step 2, not from 1 nor from scratch
    assert not list(checkpoints.glob(".*tmp-*"))


@pytest.mark.integration
def test_ckpt_path_last_with_no_checkpoint_starts_a_new_run_with_the_old_log_aside(run, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "training_log.jsonl").write_text('{"step": 1, "reward": 0.5}\n')  # killed before any checkpoint
    run("--ckpt_path", "last")
    assert steps_logged(out) == [1, 2]
    aside = list(out.glob("training_log.before-*.jsonl"))
    assert len(aside) == 1 and aside[0].read_text() == '{"step": 1, "reward": 0.5}\n'


@pytest.mark.integration
def test_ckpt_path_last_with_checkpoints_sent_elsewhere_refuses_and_keeps_the_finished_run(run, tmp_path):
    out = run()
    kept = {p: p.read_bytes() for p in [out / "training_log.jsonl", *sorted(out.glob("*/*.safetensors"))]}
    elsewhere = tmp_path / "elsewhere"
    moved = tmp_path / "moved.yaml"
    moved.write_text(
        run.config.read_text().replace("save_last: true", f"save_last: true, dirpath: {elsewhere}")
    )
    said = (
        f"(?s)in {elsewhere}, but {out} holds a run \\(.*{out / 'checkpoints'}.*dirpath at {out}/checkpoints"
    )
    with pytest.raises(SystemExit, match=said):
        build_cli(["fit", "--config", str(moved), "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert {p: p.read_bytes() for p in kept} == kept  # final/, reference/ and the log untouched
    assert not list(out.glob("training_log.before-*"))


@pytest.mark.parametrize("left", ["final", "2", "checkpoints/epoch=0-step=2.ckpt"])
def test_ckpt_path_last_finding_no_checkpoint_never_starts_over_on_a_runs_outputs(tmp_path, left):
    root = tmp_path / "run"
    (root / "reference").mkdir(parents=True)
    (root / "training_log.jsonl").write_text('{"step": 2}\n')
    (root / left).parent.mkdir(parents=True, exist_ok=True)
    if left.endswith(".ckpt"):
        (root / left).write_bytes(b"a checkpoint")
    else:
        (root / left).mkdir()
        (root / left / "config.json").write_text("{}")
    folder = RunFolder(root, [tmp_path / "elsewhere"])
    with pytest.raises(
        RunFolderError, match=f"(?s)no checkpoint to resume from in {tmp_path / 'elsewhere'}.*{root}"
    ):
        folder.prepare(resume=True)
    assert (root / "training_log.jsonl").is_file() and (root / left).exists()
    # What a run killed before its first checkpoint leaves (log, reference) starts over, as before.
    assert RunFolder(tmp_path / "other", [tmp_path / "other" / "checkpoints"]).prepare(resume=True) is None
    assert folder.prepare(resume=True, overwrite=True) is None  # --overwrite true: replaced
    assert not (root / left).exists()


@pytest.mark.integration
def test_resume_refuses_settings_a_run_cannot_change_and_names_each(run, tmp_path):
    out = run()
    versions = sorted((out / "tensorboard").iterdir())
    with pytest.raises(SystemExit, match=r"(?s)group_size: 4 -> 2.*kl_beta: 0.05 -> 0.2"):
        run("--ckpt_path", "last", "--model.group_size", "2", "--model.kl_beta", "0.2", steps=3)
    with pytest.raises(SystemExit, match=r"seed: 42 -> 3"):
        run("--ckpt_path", "last", "--data.seed", "3", steps=3)
    with pytest.raises(SystemExit, match=r"(?s)model.group_size: 4 -> 2.*data.seed: 42 -> 3 \(the data pos"):
        run("--ckpt_path", "last", "--model.group_size", "2", "--data.seed", "3", steps=3)  # both at once
    assert sorted((out / "tensorboard").iterdir()) == versions  # no config.yaml of a run that never ran
    assert steps_logged(out) == [1, 2]


@pytest.mark.integration
def test_resume_refuses_another_reward_and_loading_needs_none(run):
    from forge_lightning.module import GRPOLightningModule

    out = run()
    with pytest.raises(
        SystemExit, match=r"reward: 'helpers.faults.kill_on_call' -> 'helpers.faults.flat_on_odd_calls'"
    ):
        run("--ckpt_path", "last", reward="flat_on_odd_calls", steps=3)
    assert steps_logged(out) == [1, 2]
    from helpers import faults

    loaded = GRPOLightningModule.load_from_checkpoint(out / "checkpoints" / "last.ckpt")
    assert loaded.reward is faults.kill_on_call  # the checkpoint holds it by import path


@pytest.mark.integration
def test_validate_from_a_checkpoint_may_use_other_settings(run):
    out = run()
    ckpt = str(out / "checkpoints" / "last.ckpt")
    args = ["--config", str(run.config), "--ckpt_path", ckpt, "--trainer.limit_val_batches", "1"]
    cli = build_cli(["validate", *args, "--model.max_new_tokens", "9", "--data.seed", "3"])
    assert "val/accuracy" in cli.trainer.callback_metrics


@pytest.mark.integration
def test_a_new_learning_rate_on_resume_takes_effect_and_says_so(run):
    out = run()
    with pytest.warns(UserWarning, match="resumed with learning_rate 0.02"):
        run("--ckpt_path", "last", "--model.learning_rate", "0.02", "--trainer.max_steps", "3", steps=3)
    lrs = [json.loads(line)["lr"] for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.01, 0.01, 0.02])


@pytest.mark.integration
def test_validate_from_a_checkpoint_file_keeps_the_command_lines_module_settings(run):
    out = run()
    ckpt = str(out / "checkpoints" / "last.ckpt")
    args = ["--config", str(run.config), "--ckpt_path", ckpt, "--trainer.limit_val_batches", "1"]
    cli = build_cli(["validate", *args, "--data.val_batch_size", "1", "--model.val_num_generations", "2"])
    assert cli.model.hparams.val_num_generations == 2  # not the checkpoint's 0 laid over the flag
    assert "val/pass@2" in cli.trainer.callback_metrics
    saved = Path(cli.trainer.log_dir) / "config.yaml"
    assert "val_num_generations: 2" in saved.read_text()


@pytest.mark.integration
def test_validate_from_a_checkpoint_file_takes_what_the_command_line_leaves_out_from_it(run):
    out = run()
    ckpt = str(out / "checkpoints" / "last.ckpt")
    args = ["--data.source", "mock", "--data.val_batch_size", "1", "--trainer.default_root_dir", str(out)]
    args += ["--ckpt_path", ckpt, "--trainer.limit_val_batches", "1"]
    cli = build_cli(["validate", *args, "--model.val_num_generations", "2"])
    assert cli.model.hparams.group_size == 4  # the checkpoint's, not the default 8
    assert cli.model.hparams.val_num_generations == 2


@pytest.mark.integration
def test_fit_from_a_checkpoint_file_takes_a_new_learning_rate_as_last_does(run):
    out = run()
    ckpt = str(out / "checkpoints" / "last.ckpt")
    with pytest.warns(UserWarning, match="resumed with learning_rate 0.02"):
        run("--ckpt_path", ckpt, "--model.learning_rate", "0.02", steps=3)
    lrs = [json.loads(line)["lr"] for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.01, 0.01, 0.02])


@pytest.mark.integration
def test_fit_from_a_checkpoint_file_refuses_settings_a_run_cannot_change_by_name(run):
    out = run()
    ckpt = str(out / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit, match=r"(?s)group_size: 4 -> 2.*kl_beta: 0.05 -> 0.2"):
        run("--ckpt_path", ckpt, "--model.group_size", "2", "--model.kl_beta", "0.2", steps=3)
    assert steps_logged(out) == [1, 2]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("cosine", [0.01, 0.005, 0.005, 0.01 * 0.5 * (1 + math.cos(math.pi * 3 / 4))]),
        ("constant", [0.01, 0.005, 0.01, 0.01]),
    ],
)
def test_extending_a_finished_cosine_run_keeps_training_and_says_how(run, schedule, expected):
    out = run("--model.lr_schedule", "cosine", steps=2)  # its rate reaches 0 at step 2
    with pytest.warns(UserWarning, match="sized for this run's 4 steps"):
        run("--ckpt_path", "last", "--model.lr_schedule", schedule, steps=4)
    lrs = [json.loads(line)["lr"] for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx(expected)  # never steps 3 and 4 at 0


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["replaced", "truncated"])
def test_a_reference_that_is_not_the_runs_own_is_refused(run, damage):
    out = run()
    weights = out / "reference" / "model.safetensors"
    if damage == "replaced":  # another model of the same shape
        make_model(len(make_tokenizer()), seed=99).save_pretrained(weights.parent)
    else:
        weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(
        RuntimeError, match=r"reference policy in .*reference \(model.safetensors\) is not the one"
    ):
        run("--ckpt_path", "last", steps=3)


def test_leftovers_of_a_kill_mid_swap_are_recovered_or_removed(tmp_path):
    root = tmp_path / "run"
    (root / ".final.old-4242").mkdir(parents=True)  # killed between the two renames of final/
    (root / ".final.old-4242" / "config.json").write_text("{}")
    (root / ".2.tmp-4242-0badcafe").mkdir()  # a step folder half written
    (root / "reference").mkdir()
    (root / ".reference.old-17").mkdir()  # swap finished, old copy not yet deleted
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / ".epoch=0-step=3.ckpt.tmp-4242-00ff00ff").write_bytes(b"x" * 100)
    (root / "checkpoints" / "last.ckpt").write_bytes(b"complete")
    RunFolder(root, [root / "checkpoints"]).clean_leftovers()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoints", "final", "reference"]
    assert (root / "final" / "config.json").read_text() == "{}"
    assert [p.name for p in (root / "checkpoints").iterdir()] == ["last.ckpt"]


@pytest.mark.integration
def test_save_total_limit_keeps_the_newest_step_folders(tmp_path, module, trainer, loader, count_a):
    grpo = module(reward=count_a, gradient_accumulation_steps=1)
    fit = trainer(tmp_path, callbacks=[HFCheckpoint(save_steps=1, save_total_limit=2)], max_steps=4)
    fit.fit(grpo, loader([{"prompt": "q"}] * 4))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-deleted
    assert (tmp_path / "final" / "config.json").is_file()
    with pytest.raises(ValueError, match="save_total_limit"):
        HFCheckpoint(save_total_limit=0)


# -- 3. no non-finite update is saved ------------------------------------------------------------


@pytest.mark.integration
def test_an_update_that_makes_weights_non_finite_stops_before_any_checkpoint(
    tmp_path, module, trainer, loader, count_a
):
    grpo = module(reward=count_a, gradient_accumulation_steps=1)
    configure = grpo.configure_optimizers

    def poisoned() -> dict:
        setup = configure()
        optimizer, step = setup["optimizer"], setup["optimizer"].step

        def step_then_overflow(*args, **kwargs):
            out = step(*args, **kwargs)
            if optimizer.state[optimizer.param_groups[0]["params"][0]]["step"] >= 2:
                with torch.no_grad():
                    optimizer.param_groups[0]["params"][0].mul_(float("inf"))
            return out

        optimizer.step = step_then_overflow
        return setup

    grpo.configure_optimizers = poisoned
    checkpoints = tmp_path / "checkpoints"
    saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1, save_last=True)
    with pytest.raises(RuntimeError, match="optimizer step 2 left parameters non-finite"):
        trainer(tmp_path, callbacks=[saver], max_steps=4, enable_checkpointing=True).fit(
            grpo, loader([{"prompt": "q"}] * 4)
        )
    saved = sorted(p.name for p in checkpoints.iterdir())
    assert saved == ["epoch=0-step=1.ckpt", "last.ckpt"]
    for name in saved:
        state = torch.load(checkpoints / name, weights_only=True)["state_dict"]
        assert all(torch.isfinite(w).all() for w in state.values())


# -- 4. signals and hangs ------------------------------------------------------------------------


@pytest.mark.integration
def test_sigterm_finishes_the_optimizer_step_saves_and_exits_143(run, tmp_path):
    callbacks = "    - class_path: helpers.faults.TermAtBatch\n      init_args: {batch: 2}\n"
    # Build the config file, then run it in a subprocess (the signal goes to that process).
    with pytest.raises(SystemExit):
        run("--print_config", steps=3, accumulation=2, callbacks=callbacks)
    env = {"FORGE_CALLS": str(tmp_path / "calls_term")}
    stopped = subprocess_fit(run.config, env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    out = tmp_path / "run"
    # SIGTERM arrived as step 2 began (batch 2 of 2-batch steps): step 2 finished, then saved.
    assert steps_logged(out) == [1, 2]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert "--ckpt_path last" in stopped.stderr
    run.config.write_text(run.config.read_text().replace("batch: 2", "batch: 1000"))
    resumed = subprocess_fit(run.config, env, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps_logged(out) == [1, 2, 3]


@pytest.mark.integration
def test_sigterm_during_a_blocking_reward_stops_the_run_at_once(run, tmp_path):
    with pytest.raises(SystemExit):
        run("--print_config", reward="term_on_call")
    env = {"FORGE_CALLS": str(tmp_path / "calls_term"), "FORGE_TERM_AT": "2", "FORGE_SLEEP": "600"}
    start = time.monotonic()
    stopped = subprocess_fit(run.config, env, timeout=120)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert time.monotonic() - start < 100  # not the reward's 600 s
    assert "SIGTERM during a reward call" in stopped.stderr
    assert steps_logged(tmp_path / "run") == [1]


def test_the_model_spec_is_never_read_as_a_file(tmp_path, capsys):
    spec = tmp_path / "x.gguf"
    spec.write_text("just text\n")
    with pytest.raises(SystemExit):
        build_cli(
            [
                "fit",
                "--config",
                str(TESTS.parent / "configs" / "smoke.yaml"),
                f"--model.model={spec}",
                "--print_config",
            ]
        )
    assert f"model: {spec}" in capsys.readouterr().out


def test_signal_handler_is_restored_after_reward_calls():
    from forge_lightning.run.signals import sigterm_interrupts

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_interrupts():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_lock_file_names_its_holder(tmp_path):
    folder = RunFolder(tmp_path)
    folder.lock()
    assert (tmp_path / ".forge.lock").read_text().strip() == str(os.getpid())
    folder.unlock()
    again = RunFolder(tmp_path)
    again.lock()  # released: taken again at once
    again.unlock()


def test_overwrite_removes_the_previous_runs_validation_answers(tmp_path):
    (tmp_path / "training_log.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "step-0.jsonl").write_text('{"prompt": "q"}\n')
    RunFolder(tmp_path).prepare(resume=False, overwrite=True)
    assert sorted(tmp_path.iterdir()) == []


def test_tensorboard_logs_alone_are_no_run_and_overwrite_clears_them_with_one(tmp_path):
    (tmp_path / "tensorboard" / "version_0").mkdir(parents=True)  # e.g. a validate before any fit
    assert RunFolder(tmp_path).prepare(resume=False) is None
    assert (tmp_path / "tensorboard" / "version_0").is_dir()
    (tmp_path / "training_log.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "2024").mkdir()  # a folder of the user's, not an HF step folder
    RunFolder(tmp_path).prepare(resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2024"]


@pytest.mark.parametrize("save_top_k", [1, -1])
def test_resume_removes_step_checkpoints_the_resumed_state_no_longer_tracks(tmp_path, save_top_k):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    callback = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True, save_top_k=save_top_k)
    state = {
        "dirpath": str(folder),
        "best_model_path": str(folder / "epoch=0-step=3.ckpt"),
        "last_model_path": str(folder / "last.ckpt"),
        "kth_best_model_path": "",
        "best_k_models": {},
    }
    torch.save({"global_step": 3, "callbacks": {callback.state_key: state}}, folder / "last.ckpt")
    # step 4's checkpoint, written before a kill cut its last.ckpt; a version and an old step
    # the killed run's removal missed; and the user's own files
    names = ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "epoch=0-step=3-v1.ckpt", "epoch=0-step=4.ckpt"]
    for name in [*names, "best-by-hand.ckpt", "notes.txt"]:
        (folder / name).write_bytes(b"x")
    saved = torch.load(folder / "last.ckpt", weights_only=True)
    removed = remove_untracked_checkpoints(folder / "last.ckpt", saved, [callback])
    kept = {"epoch=0-step=3.ckpt", "last.ckpt", "best-by-hand.ckpt", "notes.txt"}
    if save_top_k == -1:  # it keeps every step: only the one past the resumed step goes
        kept |= {"epoch=0-step=2.ckpt", "epoch=0-step=3-v1.ckpt"}
    assert {p.name for p in folder.iterdir()} == kept
    assert {p.name for p in removed} == set(names) - kept
    # Another callback's state (other settings) is not judged by this one's.
    other = ModelCheckpoint(dirpath=folder, every_n_train_steps=5)
    (folder / "epoch=0-step=1.ckpt").write_bytes(b"x")
    assert remove_untracked_checkpoints(folder / "last.ckpt", saved, [other]) == []
