"""The rollout worker on a GPU: the weights reach it device to device (CUDA IPC), it samples there,
and each batch's behaviour log-probs are those of the version synced for it.

Skipped without CUDA, as test_gpu.py is; ``bash tests/gpu/check.sh OUT_DIR`` runs it.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers.models import make_model, make_tokenizer

from forge_lightning.rollout.async_worker import RolloutWorker, WorkerSettings
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.rollout.logprobs import LogProbScorer
from forge_lightning.rollout.sampler import encode_prompts
from forge_lightning.rollout.types import Rollout, completion_mask

# FORGE_GPU_TEST_DEVICE=cpu rehearses these on the CPU (the worker then samples there too).
DEVICE = os.environ.get("FORGE_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

TEMPERATURE = 0.9  # the scoring temperature
# fp32 on both sides: the worker's scores and the trainer's forward differ by kernel order only.
TOLERANCE = 1e-4
GROUP = 3
MAX_NEW = 8


def worker_on(tokenizer, device: str) -> RolloutWorker:
    """A worker sampling on ``device``, with a memory share when that is a GPU."""
    settings = WorkerSettings(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=(tokenizer.eos_token_id,),
        scoring_temperature=TEMPERATURE,
        prefix_sharing=True,
        logprob_chunk_size=8,
        threads=1,
        device=device,
        memory_fraction=0.3 if device.startswith("cuda") else None,
    )
    return RolloutWorker(settings, staleness=1)


def trainer_log_probs(model, tokenizer, prompt_ids, prompt_mask, completion_ids) -> torch.Tensor:
    """The trainer's recomputation, on its own device, masked past each completion's end."""
    completion_ids = completion_ids.to(prompt_ids.device)
    mask = completion_mask(completion_ids, [tokenizer.eos_token_id])
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, mask, GROUP, [])
    return (LogProbScorer(temperature=TEMPERATURE).log_probs_no_grad(model, rollout) * mask).cpu()


def check_worker_follows_synced_weights(worker_device: str, trainer_device: str, expected: torch.device):
    """Sample version 0, sync perturbed weights as version 1, sample again; each batch's ids are
    valid tokens and its log-probs those of its version under the trainer's recomputation."""
    tok = make_tokenizer()
    model = make_model(len(tok)).to(trainer_device)
    old = copy.deepcopy(model)
    prompt_ids, prompt_mask = encode_prompts(tok, ["ab", "hello there"], use_chat_template=False)
    prompt_ids, prompt_mask = prompt_ids.to(trainer_device), prompt_mask.to(trainer_device)
    worker = worker_on(tok, worker_device)
    try:
        worker.start(model)
        # At the scoring temperature the log-probs come from generation's scores; at another
        # one the worker scores the completions with its own forward.
        params = SamplingParams(MAX_NEW, temperature=TEMPERATURE)
        first = worker.collect(worker.submit(prompt_ids, prompt_mask, GROUP, params, seed=1))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        worker.sync_weights(model)
        params = SamplingParams(MAX_NEW, temperature=1.2)
        second = worker.collect(worker.submit(prompt_ids, prompt_mask, GROUP, params, seed=1))
    finally:
        worker.close()
    assert worker.device == expected
    assert (first.version, second.version) == (0, 1)
    for done in (first, second):
        ids = done.completion_ids
        assert ids.device.type == "cpu" and done.behav_logp.device.type == "cpu"
        assert ids.dtype == torch.long and ids.shape[0] == 2 * GROUP and 0 < ids.shape[1] <= MAX_NEW
        assert int(ids.min()) >= 0 and int(ids.max()) < len(tok)
    for done, weights in ((first, old), (second, model)):
        expected_logp = trainer_log_probs(weights, tok, prompt_ids, prompt_mask, done.completion_ids)
        got = done.behav_logp * (expected_logp != 0)
        torch.testing.assert_close(got, expected_logp, rtol=0, atol=TOLERANCE)
    # The second batch was sampled by version 1, not by the weights the worker held before.
    stale = trainer_log_probs(old, tok, prompt_ids, prompt_mask, second.completion_ids)
    assert not torch.allclose(second.behav_logp * (stale != 0), stale, atol=1e-3)


def test_a_worker_on_the_trainers_gpu_samples_each_synced_version():
    expected = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device(DEVICE)
    check_worker_follows_synced_weights(DEVICE, DEVICE, expected)


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_worker_on_a_second_gpu_gets_the_trainers_weights_across_devices():
    check_worker_follows_synced_weights("cuda:1", "cuda:0", torch.device("cuda", 1))
