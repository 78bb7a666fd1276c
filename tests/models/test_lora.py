"""LoRA through PEFT on a tiny Llama: adapter-only training, the adapter-off reference, checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import make_model, make_tokenizer
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from forge_lightning.callbacks import HFCheckpoint, ReferenceModel
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.models.hf_compat import supports_shared_prefix
from forge_lightning.models.loading import load_model
from forge_lightning.models.lora import LoraSettings, apply_lora, has_adapter
from forge_lightning.module import GRPOLightningModule

peft = pytest.importorskip("peft")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROMPTS = [{"prompt": f"q{i}"} for i in range(3)]


def distinct_chars(prompts: list[str], responses: list[str]) -> list[float]:
    """Scores that differ within almost every group of a random model, so every step has a gradient."""
    return [float(len(set(r))) for r in responses]


def lora_module(model: Any = None, **kwargs: Any) -> GRPOLightningModule:
    """A module with a rank-4 LoRA adapter on a tiny model (an object, or a folder when given)."""
    pl.seed_everything(0)
    tok = make_tokenizer()
    defaults: dict[str, Any] = dict(
        model=make_model(len(tok)) if model is None else model,
        tokenizer=tok if model is None else None,
        reward=distinct_chars,
        group_size=4,
        max_new_tokens=6,
        learning_rate=1e-2,
        gradient_accumulation_steps=1,
        kl_beta=0.05,
        peft=LoraSettings(r=4, alpha=8, dropout=0.0),
    )
    return GRPOLightningModule(**{**defaults, **kwargs})


def plain_name(name: str) -> str:
    """A base weight's name inside the PEFT wrapper -> its name in the plain model."""
    return name.replace(".base_layer.", ".")


def base_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    base = policy.get_base_model()
    return {plain_name(n): p for n, p in base.named_parameters() if ".lora_" not in n}


def adapter_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.named_parameters() if ".lora_" in n}


@pytest.mark.integration
def test_training_changes_only_the_adapter_weights(tmp_path, trainer, loader):
    grpo = lora_module()
    before = {name: p.detach().clone() for name, p in grpo.model.named_parameters()}
    fit = trainer(tmp_path, max_steps=3)
    fit.fit(grpo, loader(PROMPTS))

    policy = grpo.model
    assert has_adapter(policy) and fit.global_step == 3
    for name, weight in base_weights(policy).items():
        assert torch.equal(weight, before[name]), name  # bit-identical
        assert not weight.requires_grad
    adapters = adapter_weights(policy)
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in adapters.items() if "lora_B" in n)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == set(adapters)
    optimized = [p for group in fit.optimizers[0].param_groups for p in group["params"]]
    assert len(optimized) == len(adapters)


@pytest.mark.integration
def test_reference_is_the_policy_itself_with_no_copy_of_the_weights(tmp_path, trainer, loader):
    seen: dict[str, Any] = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            reference = pl_module.reference
            policy = pl_module.model
            in_memory = [
                p
                for holder in [pl_module, *(getattr(cb, "model", None) for cb in trainer.callbacks)]
                if holder is not None
                for p in holder.parameters()
            ]
            seen["shares"] = reference.model is policy and reference.shares_policy
            seen["storages"] = {p.untyped_storage().data_ptr() for p in in_memory}
            seen["policy_storages"] = {p.untyped_storage().data_ptr() for p in policy.parameters()}
            seen["numel"] = sum(p.numel() for p in {id(p): p for p in in_memory}.values())
            seen["policy_numel"] = sum(p.numel() for p in policy.parameters())

    grpo = lora_module()
    fit = trainer(tmp_path, max_steps=1, callbacks=[Spy()])
    fit.fit(grpo, loader(PROMPTS))

    assert seen["shares"]
    assert seen["storages"] == seen["policy_storages"]
    assert seen["numel"] == seen["policy_numel"]
    assert not (tmp_path / "reference").exists()  # nothing to reload on resume: the base is frozen


@pytest.mark.integration
def test_reference_log_probs_are_the_base_models_with_the_adapter_off(tmp_path, trainer, loader):
    tok = make_tokenizer()
    original = make_model(len(tok))
    grpo = lora_module(model=copy.deepcopy(original), tokenizer=tok)
    results: dict[str, torch.Tensor] = {}

    class Compare(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            rollout = pl_module.episodes(pl_module.model, ["ab", "xyz"], pl_module.sampling, 4)
            scorer, reference = pl_module.scorer, pl_module.reference
            with reference.scope():
                results["reference"] = scorer.log_probs_no_grad(reference.model, rollout)
            results["base"] = scorer.log_probs_no_grad(original, rollout)
            results["policy"] = scorer.log_probs_no_grad(pl_module.model, rollout)

    trainer(tmp_path, max_steps=2, callbacks=[Compare()]).fit(grpo, loader(PROMPTS))

    torch.testing.assert_close(results["reference"], results["base"])
    assert not torch.allclose(results["policy"], results["base"])  # the adapter is live otherwise


def test_prefix_sharing_matches_the_full_forward_through_a_peft_model():
    grpo = lora_module(kl_beta=0.0)
    grpo.configure_model()
    for name, p in adapter_weights(grpo.model).items():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a fresh adapter is zero: make it count
    rollout = grpo.episodes(grpo.model, ["ab", "abc d"], grpo.sampling, 4)
    assert supports_shared_prefix(grpo.model) and grpo.scorer.shared_prefix
    shared = grpo.scorer.log_probs_no_grad(grpo.model, rollout)
    full = dataclasses.replace(grpo.scorer, shared_prefix=False).log_probs_no_grad(grpo.model, rollout)
    torch.testing.assert_close(shared, full, rtol=1e-4, atol=1e-5)


def test_configure_model_wraps_once():
    grpo = lora_module()
    grpo.configure_model()
    wrapped = grpo.model
    grpo.configure_model()
    assert grpo.model is wrapped
    assert not has_adapter(wrapped.get_base_model())


@pytest.mark.integration
def test_hf_checkpoint_writes_the_adapter_and_a_loadable_merged_model(
    tiny_model_dir, tmp_path, trainer, loader
):
    grpo = lora_module(model=str(tiny_model_dir), peft=LoraSettings(r=4, alpha=8, merge_on_save=True))
    fit = trainer(tmp_path, max_steps=2, callbacks=[HFCheckpoint(save_steps=1)])
    fit.fit(grpo, loader(PROMPTS))

    final = tmp_path / "final"
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        assert (final / name).is_file(), name
    assert not (final / "model.safetensors").exists()  # the adapter only, not the base weights
    # The adapter names the base it was loaded from; the model card beside it says it loads with
    # peft, and names no base_model (only a hub id belongs there, never a local folder).
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir)
    card = (final / "README.md").read_text()
    assert "library_name: peft\n" in card and "base_model" not in card
    assert (tmp_path / "1" / "merged" / "model.safetensors").is_file()
    assert has_adapter(grpo.model)  # merging worked on the side: the policy keeps its adapter

    ids = torch.tensor([[5, 9, 14, 22, 30]])
    expected = copy.deepcopy(grpo.model).merge_and_unload()(ids).logits
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")
    assert not has_adapter(merged)
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-5)
    # The adapter folder alone is a model spec too: base from its config, adapter folded in.
    loaded, tokenizer = load_model(str(final))
    assert not has_adapter(loaded) and len(tokenizer) == len(make_tokenizer())
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_an_adapter_on_a_loaded_adapter_folder_stacks_on_it(tiny_model_dir, tmp_path):
    def train_adapter(spec: Path, out: Path) -> torch.nn.Module:
        policy = apply_lora(load_model(str(spec))[0], LoraSettings(r=2, alpha=4, dropout=0.0))
        for name, p in adapter_weights(policy).items():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        policy.save_pretrained(out)
        return policy.eval()

    train_adapter(tiny_model_dir, tmp_path / "first")
    second = train_adapter(tmp_path / "first", tmp_path / "second")
    ids = torch.tensor([[5, 9, 14, 22]])
    stacked = load_model(str(tmp_path / "second"))[0].eval()  # base + first + second
    torch.testing.assert_close(stacked(ids).logits, second(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_resume_from_a_lightning_checkpoint_restores_the_adapter(tiny_model_dir, tmp_path, trainer, loader):
    checkpoints = tmp_path / "checkpoints"

    def lightning_checkpoints() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_last=True)

    first = lora_module(model=str(tiny_model_dir))
    trainer(tmp_path, max_steps=2, enable_checkpointing=True, callbacks=[lightning_checkpoints()]).fit(
        first, loader(PROMPTS)
    )
    saved = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    restored: dict[str, torch.Tensor] = {}

    class Restored(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            restored.update({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})

    second = lora_module(model=str(tiny_model_dir))
    resumed = trainer(
        tmp_path, max_steps=3, enable_checkpointing=True, callbacks=[lightning_checkpoints(), Restored()]
    )
    resumed.fit(second, loader(PROMPTS), ckpt_path=str(checkpoints / "last.ckpt"))

    assert resumed.global_step == 3
    assert restored.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    reference = next(cb for cb in resumed.callbacks if isinstance(cb, ReferenceModel))
    with pytest.raises(RuntimeError, match="only during fit"):  # fit ended; it never held a copy
        reference.model


PEFT_CONFIG = """
trainer:
  accelerator: cpu
  max_steps: 1
  default_root_dir: {out}
  logger: false
  enable_progress_bar: false
  callbacks:
    - class_path: forge_lightning.callbacks.HFCheckpoint
      init_args: {{save_steps: 0}}
model:
  model: {model}
  group_size: 4
  max_new_tokens: 6
  gradient_accumulation_steps: 1
  peft:
    r: 4
    alpha: 8
    target_modules: [q_proj, v_proj]
data:
  source: mock
"""


@pytest.mark.integration
def test_peft_section_of_a_yaml_config_parses_and_trains(tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "lora.yaml"
    out = tmp_path / "run"
    config.write_text(PEFT_CONFIG.format(out=out, model=tiny_model_dir))
    with pytest.raises(SystemExit):
        build_cli(["fit", "--config", str(config), "--print_config"])
    printed = capsys.readouterr().out
    assert "peft:" in printed and "- q_proj" in printed and "merge_on_save: false" in printed

    cli = build_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 1
    assert cli.model.hparams.peft == asdict(LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert (out / "final" / "adapter_config.json").is_file()


@pytest.mark.parametrize(
    ("field", "value"), [("r", 0), ("alpha", 0), ("dropout", 1.0), ("target_modules", [])]
)
def test_bad_lora_settings_fail_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"peft.{field}"):
        LoraSettings(**{field: value})


def peft_lora_config(as_dict: bool, **fields: Any) -> Any:
    """PEFT's LoraConfig as TRL's ``peft_config`` takes it, or the dict of the same fields."""
    return fields if as_dict else peft.LoraConfig(**fields)


@pytest.mark.parametrize("as_dict", [False, True], ids=["LoraConfig", "dict"])
def test_peft_loraconfig_is_taken_as_peft_with_its_names_made_ours(as_dict):
    config = peft_lora_config(
        as_dict,
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        target_modules=["v_proj", "q_proj"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    grpo = lora_module(peft=config)
    ours = LoraSettings(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"])
    assert grpo.hparams.peft == asdict(ours)  # the checkpoint keeps our names
    grpo.configure_model()
    built = grpo.model.peft_config["default"]
    assert (built.r, built.lora_alpha, built.lora_dropout) == (4, 8, 0.1)
    assert built.target_modules == {"q_proj", "v_proj"}


@pytest.mark.parametrize("as_dict", [False, True], ids=["LoraConfig", "dict"])
def test_a_peft_config_for_another_task_or_adapter_is_refused_by_name(as_dict):
    with pytest.raises(ValueError, match=r"^peft: task_type 'SEQ_CLS' is not taken here: .*CAUSAL_LM$"):
        lora_module(peft=peft_lora_config(as_dict, r=4, lora_alpha=8, task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match=r"^peft: LoraConfig's bias='all', use_dora=True not taken here"):
        lora_module(peft=peft_lora_config(as_dict, r=4, task_type="CAUSAL_LM", bias="all", use_dora=True))


def test_a_peft_config_without_target_modules_keeps_pefts_default_for_the_architecture():
    grpo = lora_module(peft=peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    assert grpo.hparams.peft["target_modules"] is None
    grpo.configure_model()
    assert grpo.model.peft_config["default"].target_modules == {"q_proj", "v_proj"}  # PEFT's for Llama
