"""Mixed precision done right: a bf16 checkpoint trains on float32 master weights (so a small
learning rate moves every weight), the frozen reference stays in the compute dtype, and the KL of
the first step, before any update, is near zero despite the two dtypes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer
from safetensors.torch import load_file

from forge_lightning.module import GRPOLightningModule


@pytest.fixture
def bf16_folder(tmp_path):
    folder = tmp_path / "bf16-model"
    make_model(len(make_tokenizer())).to(torch.bfloat16).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def varied(prompts, responses):
    return [float(len(set(r)) % 3) for r in responses]


def changed_fraction(folder, model) -> float:
    before = load_file(folder / "model.safetensors")
    after = {k: v.detach().float() for k, v in model.state_dict().items()}
    changed = sum(int((after[k] != before[k].float()).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


@pytest.mark.integration
@pytest.mark.parametrize(
    ("model_dtype", "moved"), [("float32", lambda f: f > 0.95), ("auto", lambda f: f < 0.5)]
)
def test_a_bf16_checkpoint_under_bf16_mixed_trains_full_precision_weights(
    bf16_folder, tmp_path, trainer, loader, model_dtype, moved
):
    pl.seed_everything(0, verbose=False)
    grpo = GRPOLightningModule(
        model=str(bf16_folder), reward=varied, model_dtype=model_dtype, group_size=4, max_new_tokens=6,
        learning_rate=5e-6, gradient_accumulation_steps=1, kl_beta=0.0,
    )  # fmt: skip
    fit = trainer(tmp_path, precision="bf16-mixed", max_steps=3)
    fit.fit(grpo, loader([{"prompt": "abc"}, {"prompt": "de"}] * 2))
    assert fit.global_step == 3
    dtype = next(grpo.model.parameters()).dtype
    assert dtype == (torch.float32 if model_dtype == "float32" else torch.bfloat16)
    fraction = changed_fraction(bf16_folder, grpo.model)
    assert moved(fraction), fraction


@pytest.mark.integration
def test_the_reference_is_kept_in_the_compute_dtype_and_the_first_kl_is_near_zero(
    bf16_folder, tmp_path, trainer, loader
):
    seen = {}

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.setdefault("reference_dtype", next(pl_module.reference.model.parameters()).dtype)
            seen.setdefault("kl", pl_module.last_step.metrics["train/kl"])

    pl.seed_everything(0, verbose=False)
    grpo = GRPOLightningModule(
        model=str(bf16_folder), reward=varied, group_size=4, max_new_tokens=6, learning_rate=5e-6,
        gradient_accumulation_steps=1, kl_beta=0.1,
    )  # fmt: skip
    trainer(tmp_path, precision="bf16-mixed", max_steps=1, callbacks=[Look()]).fit(
        grpo, loader([{"prompt": "abc"}])
    )
    assert seen["reference_dtype"] == torch.bfloat16
    assert next(grpo.model.parameters()).dtype == torch.float32
    # Same weights (the bf16 checkpoint), both forwards under bf16 autocast: only rounding differs.
    assert abs(seen["kl"]) < 1e-3, seen["kl"]


def test_half_precision_weights_are_possible_with_a_warning(bf16_folder):
    grpo = GRPOLightningModule(model=str(bf16_folder), model_dtype="bfloat16")
    with pytest.warns(UserWarning, match="model_dtype=bfloat16"):
        grpo.configure_model()
    assert next(grpo.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("precision", "compute"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)]
)
def test_fsdp2_under_mixed_precision_computes_in_half_on_float32_shards(tmp_path, precision, compute):
    """FSDP2's MixedPrecisionPolicy (what prepare_policy applies under ModelParallelStrategy): the
    shards AdamW updates and their gradients stay float32; the forward runs in the compute dtype."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from forge_lightning.models.policy import prepare_policy
    from forge_lightning.models.sharding import is_sharded

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        model = prepare_policy(make_model(len(make_tokenizer())), mesh=mesh, precision=precision)
        assert is_sharded(model)
        logits = model(torch.tensor([[3, 4, 5, 6]])).logits
        assert logits.dtype == compute
        logits.float().logsumexp(-1).sum().backward()
        params = list(model.parameters())
        assert all(p.dtype == torch.float32 for p in params)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    finally:
        dist.destroy_process_group()
