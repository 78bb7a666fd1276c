"""A trainer and a rollout server (``forge-lightning serve``) on GPUs: both on the one GPU (each
process takes its share of its memory), and where two GPUs are visible the server on the second.
Each fit runs two optimizer steps whose rollouts the server samples; the weights it holds after are
the trained ones (version 2: the connect's push, then one per step), pushed from the GPU over gloo.

Skipped without CUDA, as test_gpu.py is; ``bash tests/gpu/check.sh OUT_DIR`` runs it (the server
process needs jsonargparse, which check.py installs from the carried wheels where it is missing).
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer
from helpers.rewards import varied
from helpers.serve_process import start_serve, stop_serve
from helpers.serving import call

from forge_lightning.callbacks import RewardLogger
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.serving.wire import SECRET_ENV, GenerateAnswer, GenerateCall

# FORGE_GPU_TEST_DEVICE=cpu rehearses these on the CPU (trainer and server both there).
DEVICE = os.environ.get("FORGE_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.integration,  # a Trainer, and a server process
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SECRET = "gpu-check-secret"
PROMPTS = [{"prompt": p} for p in ("aa b", "c", "ab ab", "d a")]


def fit_two_steps(module, loader, root, **settings) -> tuple[pl.LightningModule, list[dict]]:
    """Two seeded optimizer steps of the tiny module on DEVICE; it and its training_log.jsonl."""
    pl.seed_everything(3)
    grpo = module(reward=varied, learning_rate=1e-2, gradient_accumulation_steps=1, **settings)
    trainer = pl.Trainer(
        accelerator="gpu" if DEVICE == "cuda" else DEVICE,
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[RewardLogger(logging_steps=1)],
    )
    trainer.fit(grpo, loader(PROMPTS, batch_size=2))
    log = [json.loads(line) for line in (root / "training_log.jsonl").read_text().splitlines()]
    return grpo, log


def test_local_server_on_the_trainers_gpu(tmp_path, module, loader):
    """``rollout_servers: ['local:1']``: the trainer starts the server, which takes the GPU there is."""
    _, log = fit_two_steps(module, loader, tmp_path, rollout_servers=["local:1"])
    assert [r["step"] for r in log] == [1, 2]
    assert all(r["server_failures"] == 0 and r["num_tokens"] > 0 for r in log)
    assert "listening on" in (tmp_path / "servers" / "server-1.log").read_text()


def test_async_mode_samples_on_its_own_server_with_a_share_of_the_trainers_gpu(tmp_path, module, loader):
    """``rollout_mode: async`` without servers listed: its one ``local:1`` server on the trainer's
    GPU (``rollout_device: cuda``), taking ``rollout_memory_fraction`` of its memory."""
    on_gpu = dict(rollout_device="cuda", rollout_memory_fraction=0.3) if DEVICE == "cuda" else {}
    grpo, log = fit_two_steps(module, loader, tmp_path, rollout_mode="async", kl_beta=0.0, **on_gpu)
    assert [r["step"] for r in log] == [1, 2] and [r["staleness"] for r in log] == [0.0, 1.0]
    assert all(r["server_failures"] == 0 and r["num_tokens"] > 0 for r in log)
    assert "listening on" in (tmp_path / "servers" / "server-1.log").read_text()
    assert not grpo.engine.running


@pytest.mark.parametrize("server_device", [DEVICE, "cuda:1"])
def test_a_server_started_apart_samples_a_fit_and_holds_its_trained_weights(
    tmp_path, monkeypatch, module, loader, server_device
):
    """A server started with ``forge-lightning serve --device D`` and given to the trainer as
    ``host:port``: D the trainer's GPU, then the second GPU where there is one."""
    if server_device == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    tokenizer = make_tokenizer()
    make_model(len(tokenizer), seed=5).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({"model": {"model": str(tmp_path / "model"), "model_dtype": "float32"}}))
    process, url = start_serve(config, SECRET, tmp_path / "server.log", "--device", server_device)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    try:
        grpo, log = fit_two_steps(
            module, loader, tmp_path / "run", rollout_servers=[url.removeprefix("http://")]
        )
        assert [r["step"] for r in log] == [1, 2] and all(r["server_failures"] == 0 for r in log)
        assert call(url, "/health", secret=SECRET)[1]["version"] == 2
        request = GenerateCall("check", [[5, 6, 7]], 1, SamplingParams(6, greedy=True), logprobs=True)
        served = GenerateAnswer.from_json(call(url, "/generate", request.to_json(), secret=SECRET)[1])
    finally:
        assert stop_serve(process) == 0
    tokens = served.completions[0]
    assert served.versions == [[2] * len(tokens)]
    # The server's log-probs are the trained policy's own (its seed-5 weights were replaced).
    model = grpo.model.to(server_device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, *tokens]], device=server_device)).logits[0, 2:-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(tokens, device=server_device)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(served.logp[0]), expected.cpu(), rtol=0, atol=1e-4)
