"""The multi-GPU overlays on two CPU processes (gloo): ``overlays/ddp.yaml`` launched by ``torchrun``,
``overlays/fsdp.yaml`` (FSDP2) launched by Lightning, each through the CLI on a tiny model. The same
on two GPUs where there are two; and the settings a sharded policy refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.models import make_model, make_tokenizer
from safetensors.torch import load_file

from forge_lightning.module import GRPOLightningModule

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def fit(launcher: list[str], overlay: str, model_dir: Path, out: Path, accelerator: str, *extra: str) -> None:
    """Two processes of ``forge-lightning fit`` of gsm8k.yaml with ``overlay``, in ``out`` (the
    configs' output paths are relative)."""
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"--trainer.accelerator={accelerator}",
        "--trainer.devices=2",
        "--trainer.precision=32-true",
        "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=false",
        f"--model.model={model_dir}",
        "--model.group_size=4",
        "--model.max_new_tokens=6",
        "--model.learning_rate=0.01",
        "--data.source=mock",
        *extra,
    ]
    configs = ["--config", str(CONFIGS / "gsm8k.yaml"), "--config", str(CONFIGS / "overlays" / overlay)]
    command = [*launcher, "-m", "forge_lightning", "fit", *configs, *overrides]
    run = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


def run_both(model_dir: Path, root: Path, accelerator: str) -> dict[str, dict[str, torch.Tensor]]:
    """Weights of the DDP and the FSDP run (both with the KL term), by HF parameter name: final
    and reference folders, and the FSDP run's Lightning checkpoint."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    fit(torchrun, "ddp.yaml", model_dir, root / "ddp", accelerator, "--model.kl_beta=0.5")
    # The FSDP run also validates, sampled, on three prompts after every batch: one rank's share
    # holds a repeat, which it must sample (the ranks gather weights together) and not count.
    validation = [
        "--trainer.limit_val_batches=1.0",
        "--trainer.val_check_interval=1",
        "--data.val_max_samples=3",
        "--data.val_batch_size=1",
        "--model.val_num_generations=2",
    ]
    fit([sys.executable], "fsdp.yaml", model_dir, root / "fsdp", accelerator, "--model.kl_beta=0.5",
        "--trainer.strategy.init_args.data_parallel_size=2", *validation)  # fmt: skip
    checkpoint = torch.load(root / "fsdp" / "forge_output" / "checkpoints" / "last.ckpt", weights_only=False)
    return {
        "initial": load_file(model_dir / "model.safetensors"),
        "ddp": load_file(root / "ddp" / "forge_output" / "final" / "model.safetensors"),
        "fsdp": load_file(root / "fsdp" / "forge_output" / "final" / "model.safetensors"),
        "fsdp_reference": load_file(root / "fsdp" / "forge_output" / "reference" / "model.safetensors"),
        "fsdp_checkpoint": {name.removeprefix("model."): w for name, w in checkpoint["state_dict"].items()},
        "fsdp_config": json.loads((root / "fsdp" / "forge_output" / "final" / "config.json").read_text()),
        "fsdp_validation": [
            [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted((root / "fsdp" / "forge_output" / "validation").iterdir())
        ],
    }


@pytest.fixture(scope="module")
def cpu_runs(tiny_model_dir, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    return run_both(tiny_model_dir, tmp_path_factory.mktemp("distributed"), "cpu")


@pytest.mark.integration
def test_ddp_config_under_torchrun_trains_and_writes_the_final_policy(cpu_runs):
    ddp, initial = cpu_runs["ddp"], cpu_runs["initial"]
    assert ddp.keys() == initial.keys()
    assert any(not torch.equal(ddp[name], initial[name]) for name in ddp)


@pytest.mark.integration
def test_fsdp_config_trains_the_sharded_policy_as_ddp_trains_the_whole_one(cpu_runs):
    # Same seed, data, steps and KL term: sharding changes where the weights (the reference's
    # too) live, not the training. Had the policy not been sharded, nothing would sync the ranks'
    # gradients and the runs would part; had the reference been wrong, the KL gradient would differ.
    ddp, fsdp = cpu_runs["ddp"], cpu_runs["fsdp"]
    assert fsdp.keys() == ddp.keys()
    assert any(not torch.equal(ddp[name], cpu_runs["initial"][name]) for name in ddp)
    # The tolerance only covers summation order (all-reduce vs reduce-scatter); one step of
    # unsynced training moves weights by about the learning rate, 1e-2.
    for name, weight in ddp.items():
        torch.testing.assert_close(fsdp[name], weight, rtol=1e-3, atol=1e-5)


@pytest.mark.integration  # the torchrun runs of cpu_runs
def test_fsdp_validation_counts_each_prompt_once_though_a_rank_samples_a_repeat(cpu_runs):
    files = cpu_runs["fsdp_validation"]
    assert len(files) >= 2  # one per optimizer step validated
    for answers in files:
        assert len(answers) == 3 and len({a["prompt"] for a in answers}) == 3
        assert all(len(a["samples"]) == 2 for a in answers)


@pytest.mark.integration  # the torchrun runs of cpu_runs
def test_fsdp_run_writes_whole_hf_folders_of_the_sharded_policy(cpu_runs):
    # The final folder is the gathered policy (what the Lightning checkpoint holds), under the HF
    # class name; the reference folder is the policy before training.
    assert cpu_runs["fsdp_config"]["architectures"] == ["LlamaForCausalLM"]
    for name, weight in cpu_runs["fsdp"].items():
        torch.testing.assert_close(cpu_runs["fsdp_checkpoint"][name], weight, rtol=0, atol=0)
    initial = cpu_runs["initial"]
    assert cpu_runs["fsdp_reference"].keys() == initial.keys()
    for name, weight in initial.items():
        torch.testing.assert_close(cpu_runs["fsdp_reference"][name], weight, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_both_configs_on_two_gpus(tiny_model_dir, tmp_path):
    runs = run_both(tiny_model_dir, tmp_path, "gpu")
    for name, weight in runs["ddp"].items():
        torch.testing.assert_close(runs["fsdp"][name], weight, rtol=1e-3, atol=1e-5)


def mesh(tensor_parallel: int) -> dict[str, SimpleNamespace]:
    return {
        "data_parallel": SimpleNamespace(size=lambda: 2),
        "tensor_parallel": SimpleNamespace(size=lambda: tensor_parallel),
    }


@pytest.mark.parametrize(
    ("settings", "tensor_parallel", "message"),
    [
        ({}, 2, "tensor_parallel_size"),
        ({"generation_backend": "vllm"}, 1, "generation_backend"),
        ({"peft": {"r": 4}}, 1, "LoRA"),
    ],
)
def test_sharding_refuses_what_it_cannot_do(settings, tensor_parallel, message):
    tok = make_tokenizer()
    grpo = GRPOLightningModule(model=make_model(len(tok)), tokenizer=tok, **settings)
    grpo._device_mesh = mesh(tensor_parallel)  # what ModelParallelStrategy sets before configure_model
    with pytest.raises(ValueError, match=message):
        grpo.configure_model()


def ddp_gradients(tmp_path: Path, *mode: str) -> None:
    """Run tests/helpers/ddp_gradients.py on two gloo processes, writing into ``tmp_path``."""
    tests = Path(__file__).resolve().parents[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [
            *torchrun,
            str(tests / "helpers" / "ddp_gradients.py"),
            str(tmp_path),
            str(tmp_path / "runs"),
            *mode,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])},
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.integration
def test_ddp_dynamic_sampling_with_ranks_out_of_step_matches_one_batch_of_the_informative(
    tmp_path, step_gradients
):
    from helpers.ddp_gradients import DYNAMIC_RECORDS, flat_or_live

    # Round 1: rank 0 has nothing to train (a zero-weight backward keeps DDP in step), rank 1 one
    # group; round 2: one group each; 3 of the 2 x 1 x 1 needed: the step takes all three.
    ddp_gradients(tmp_path, "dynamic")
    ddp = torch.load(tmp_path / "dynamic.pt")
    live = [r for r in DYNAMIC_RECORDS if r["kind"] == "live"]
    _, one = step_gradients(records=live, batch_size=3, fixed=True, reward=flat_or_live)
    assert any(g.abs().sum() > 0 for g in one)
    for a, b in zip(ddp, one):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


@pytest.mark.integration
def test_ddp_curriculum_dropping_a_ranks_only_group_matches_one_batch_of_the_other_ranks(
    tmp_path, step_gradients
):
    from helpers.ddp_gradients import RECORDS

    # Rank 0's one prompt is remembered as always solved: it trains nothing (its zero-weight
    # backward joins rank 1's all-reduce), and the step is rank 1's group alone.
    ddp_gradients(tmp_path, "curriculum")
    ddp = torch.load(tmp_path / "curriculum.pt")
    _, one = step_gradients(records=RECORDS[1:], batch_size=1, fixed=True)
    assert any(g.abs().sum() > 0 for g in one)
    for a, b in zip(ddp, one):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    # Both ranks remember both prompts' groups: rank zero's state, the one saved, is every rank's.
    histories = [torch.load(tmp_path / f"curriculum-history-{rank}.pt") for rank in (0, 1)]
    assert histories[0] == histories[1] and len(histories[0]) == 2


@pytest.mark.integration
def test_ddp_step_gradient_equals_one_process_holding_both_ranks_rollouts(tmp_path, step_gradients):
    ddp_gradients(tmp_path)
    for loss_type in ("grpo", "dapo", "dr_grpo", "forge"):
        ddp = torch.load(tmp_path / f"{loss_type}.pt")
        _, one = step_gradients(batch_size=2, fixed=True, loss_type=loss_type)  # both prompts, one batch
        assert any(g.abs().sum() > 0 for g in one)
        for a, b in zip(ddp, one):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
        # steps_per_generation 2, two prompts per rank: the first step trains each rank's first
        # prompt, normalised over both ranks' shares, as the one process holding both does.
        within = torch.load(tmp_path / f"spg-{loss_type}.pt")
        for a, b in zip(within, one):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
        if loss_type == "grpo":
            # Token-budget micro-batches, 2 on rank 0 and 3 on rank 1 (its two long rows apart, its
            # short ones a run that shares their prompt): rank 0 adds a zero-weight backward, so
            # that both join DDP's all-reduce of each. Other micro-batches than the one process's
            # agree only to float32's precision, even in float64: transformers' LlamaRMSNorm
            # computes in float32 (kept in float64, any two micro-batchings of a float64 model agree
            # to 1e-15), so an element is within about 1e-8 of the largest, 0.57 here.
            packed = torch.load(tmp_path / "tokens-grpo.pt")
            for a, b in zip(packed, one):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.integration
def test_ddp_step_gradient_of_each_lever_equals_one_process_holding_both_ranks_rollouts(
    tmp_path, step_gradients
):
    from helpers.ddp_gradients import LEVERS

    # reinforce_pp's std is of both ranks' rewards (gathered), rloo's and kl_in_reward's advantages
    # and the loss types' normalisers are over both ranks' rollouts, as in the one process.
    ddp_gradients(tmp_path, "levers")
    for name, settings in LEVERS.items():
        ddp = torch.load(tmp_path / f"lever-{name}.pt")
        _, one = step_gradients(batch_size=2, fixed=True, **settings)
        assert any(g.abs().sum() > 0 for g in one)
        for a, b in zip(ddp, one):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.integration
def test_ddp_tool_rollouts_with_ranks_taking_different_rounds_match_one_batch(tmp_path, step_gradients):
    from helpers.ddp_gradients import TOOL_SETTINGS

    # Rank 0's completions call the calculator up to twice (three generate rounds), rank 1's never.
    ddp_gradients(tmp_path, "tools")
    for loss_type in ("grpo", "dapo"):
        ddp = torch.load(tmp_path / f"tools-{loss_type}.pt")
        _, one = step_gradients(batch_size=2, fixed="calculator", loss_type=loss_type, **TOOL_SETTINGS)
        assert any(g.abs().sum() > 0 for g in one)
        for a, b in zip(ddp, one):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
