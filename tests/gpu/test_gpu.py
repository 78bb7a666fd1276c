"""What only a GPU can show: bf16 training, CUDA generation, checkpointing, LoRA and FSDP2 on CUDA.

Skipped without CUDA. ``bash tests/gpu/check.sh OUT_DIR`` runs these and the GPU benchmark in one go.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import make_model, make_tokenizer
from transformers import AutoModelForCausalLM

from forge_lightning.callbacks import HFCheckpoint
from forge_lightning.rollout.engines.base import GenerationRequest, SamplingParams
from forge_lightning.rollout.engines.hf import HFGenerate
from forge_lightning.rollout.logprobs import completion_log_probs
from forge_lightning.rollout.sampler import encode_prompts
from forge_lightning.rollout.types import completion_mask

# FORGE_GPU_TEST_DEVICE=cpu rehearses these on the CPU (bf16 and FSDP2 work there too, slowly);
# the check itself never sets it.
DEVICE = os.environ.get("FORGE_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 keeps 8 bits of mantissa: log-probs of two ways of computing the same forward agree to this.
BF16_TOLERANCE = 2e-2
PROMPTS = [{"prompt": "ab"}, {"prompt": "hello there"}]


@pytest.fixture
def gpu_trainer(trainer):
    """``gpu_trainer(root, **kwargs)``: conftest's quiet trainer, one step on the device under test."""
    accelerator = "gpu" if DEVICE == "cuda" else DEVICE
    return lambda root, **kwargs: trainer(
        root, **{"accelerator": accelerator, "devices": 1, "max_steps": 1, **kwargs}
    )


def trained(
    grpo, root, loader, gpu_trainer, **trainer_kwargs
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weights (on the CPU) before and after one GPU step of ``grpo``."""
    grpo.configure_model()
    before = {k: v.detach().float().cpu().clone() for k, v in grpo.model.state_dict().items()}
    gpu_trainer(root, **trainer_kwargs).fit(grpo, loader(PROMPTS, batch_size=2))
    after = {k: v.detach().float().cpu() for k, v in grpo.model.state_dict().items()}
    return before, after


def test_one_bf16_mixed_step_trains_and_writes_a_loadable_checkpoint(tmp_path, module, loader, gpu_trainer):
    grpo = module(learning_rate=1e-2, gradient_accumulation_steps=1)
    before, after = trained(
        grpo, tmp_path, loader, gpu_trainer, precision="bf16-mixed", callbacks=[HFCheckpoint(save_steps=0)]
    )
    assert torch.isfinite(torch.tensor(grpo.last_step.metrics["train/loss"]))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for name, weight in reloaded.state_dict().items():
        torch.testing.assert_close(weight.float(), after[name])


def test_shared_prefix_log_probs_on_cuda_match_the_full_forward_in_bf16():
    tok = make_tokenizer()
    model = make_model(len(tok)).to(DEVICE, torch.bfloat16)
    prompt_ids, prompt_mask = encode_prompts(tok, ["ab", "hello there"], use_chat_template=False)
    prompt_ids, prompt_mask = prompt_ids.to(DEVICE), prompt_mask.to(DEVICE)
    torch.manual_seed(0)
    completions = torch.randint(4, len(tok), (2 * 3, 7), device=DEVICE)
    mask = completion_mask(completions, [tok.eos_token_id]).bool()
    logp = {
        mode: completion_log_probs(model, prompt_ids, prompt_mask, completions, group_size=3, mode=mode)
        for mode in ("full", "shared_prefix")
    }
    assert logp["full"].dtype == torch.float32  # log-softmax in float32 even for bf16 logits
    torch.testing.assert_close(logp["shared_prefix"][mask], logp["full"][mask], atol=BF16_TOLERANCE, rtol=0)


def test_prefilled_cuda_generation_equals_plain_generate():
    tok = make_tokenizer()
    model = make_model(len(tok)).to(DEVICE)
    prompt_ids, prompt_mask = encode_prompts(tok, ["ab", "hello there"], use_chat_template=False)
    prompt_ids, prompt_mask = prompt_ids.to(DEVICE), prompt_mask.to(DEVICE)
    greedy = SamplingParams(8, greedy=True)
    request = GenerationRequest(prompt_ids, prompt_mask, 3, greedy)
    ours = HFGenerate(tok.pad_token_id, [tok.eos_token_id]).generate(model, request).ids
    plain = model.generate(
        input_ids=prompt_ids.repeat_interleave(3, 0),
        attention_mask=prompt_mask.repeat_interleave(3, 0),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, prompt_ids.shape[1] :]
    assert torch.equal(ours[:, : plain.shape[1]], plain)


def test_gradient_checkpointing_and_lora_train_on_cuda(tmp_path, module, loader, gpu_trainer):
    pytest.importorskip("peft")
    from forge_lightning.models.lora import LoraSettings

    grpo = module(
        learning_rate=1e-2,
        gradient_accumulation_steps=1,
        gradient_checkpointing=True,
        peft=LoraSettings(r=4, alpha=8, dropout=0.0),
    )
    before, after = trained(grpo, tmp_path, loader, gpu_trainer, precision="bf16-mixed")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # only the adapter moved


def test_fsdp2_on_one_gpu_trains_and_gathers_a_plain_checkpoint(tmp_path, module, loader, gpu_trainer):
    from lightning.pytorch.strategies import ModelParallelStrategy

    grpo = module(learning_rate=1e-2, gradient_accumulation_steps=1, kl_beta=0.05)
    tok = make_tokenizer()
    initial = make_model(len(tok))  # the module fixture's policy: the same seed, the same weights
    strategy = ModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=False
    )
    gpu_trainer(tmp_path, strategy=strategy, callbacks=[HFCheckpoint(save_steps=0)]).fit(
        grpo, loader(PROMPTS, batch_size=2)
    )
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "reference")
    assert type(final).__name__ == "LlamaForCausalLM"
    assert any(
        not torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values())
    )
    for name, weight in reference.state_dict().items():  # the reference is the policy before training
        torch.testing.assert_close(weight, initial.state_dict()[name])
