"""TRL's GRPOTrainer and GRPOConfig names: each refused with its pointer in Python, on the command
line and in a config file; the ones TRL users set most say where each lives here; "did you mean" for
our own misspelled; the migration table in notebooks/guide.ipynb is the package's; and, in a virtual
environment with trl==1.16.0, every name and stated default is TRL's own."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from forge_lightning import GRPOConfig
from forge_lightning.callbacks import HFCheckpoint, RewardLogger
from forge_lightning.cli.forge_cli import build_cli
from forge_lightning.data import PromptDataModule
from forge_lightning.grpo.surrogates import clipped_surrogate
from forge_lightning.module import GRPOLightningModule
from forge_lightning.settings.trl_names import (
    TRL_CONFIG_NAMES,
    TRL_DEFAULTS,
    TRL_NAMES,
    TRL_TRAINER_NAMES,
    did_you_mean,
    migration_table,
    pointer,
)

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
GUIDE = ROOT / "notebooks" / "guide.ipynb"
TRL_VERSION = "1.16.0"


def parameters(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls.__init__).parameters)


# Where each group of flags lands, to check that every pointer names a real setting.
GROUPS = {
    "model": GRPOLightningModule,
    "data": PromptDataModule,
    "trainer": pl.Trainer,
    "reward_logger": RewardLogger,
    "hf_checkpoint": HFCheckpoint,
}


@pytest.mark.parametrize("name", list(TRL_NAMES))
def test_every_trl_name_is_refused_in_python_with_its_pointer(name):
    said = pointer(name, python=True)
    with pytest.raises(TypeError) as refused:
        GRPOLightningModule(**{name: 1})
    assert str(refused.value) == f"GRPOLightningModule got an unexpected keyword argument {name!r}: {said}"
    assert "\n" not in said and said.endswith("`from forge_lightning.trl import GRPOConfig, GRPOTrainer`")
    fields = [f for f in parameters(GRPOConfig) if f != "self"]
    if name not in fields:  # Forge's config shares a few of TRL's names (seed, save_steps, ...)
        with pytest.raises(TypeError, match=f"^GRPOConfig got an unexpected keyword argument {name!r}: "):
            GRPOConfig(**{name: 1})


@pytest.mark.parametrize("name", list(TRL_NAMES))
def test_every_trl_name_is_refused_on_the_command_line_and_in_a_config_with_its_pointer(name, tmp_path):
    with pytest.raises(SystemExit) as refused:
        build_cli(["fit", "--config", str(SMOKE), f"--model.{name}", "1"], run=False)
    assert refused.value.code == f"fit: {pointer(name)}"
    config = tmp_path / "trl.yaml"
    config.write_text(f"model:\n  {name}: 1\n")
    with pytest.raises(SystemExit) as refused:
        build_cli(["validate", "--config", str(SMOKE), "--config", str(config)], run=False)
    assert refused.value.code == f"validate: {pointer(name)}"


def test_the_pointers_read_as_the_issue_writes_them():
    assert pointer("beta") == "TRL's `beta` is `kl_beta` here (--model.kl_beta)"
    assert pointer("vllm_mode") == "TRL's `vllm_mode` has no counterpart here"
    assert pointer("beta", fields=["kl_beta"]) == "TRL's `beta` is `kl_beta` here (GRPOConfig.kl_beta)"
    assert pointer("group_size") is None  # ours, not TRL's


# What TRL users set most: (where it is set in Python, the flag, what the pointer says of it).
WHERE_THEY_LIVE = {
    "reward_funcs": ("GRPOLightningModule(reward=...)", "--model.reward", "CompositeReward"),
    "train_dataset": ("PromptDataModule(dataset=...)", "--data.dataset", 'prompt_field="prompt"'),
    "eval_dataset": ("PromptDataModule(dataset=...)", "--data.dataset", "`val_split` split"),
    "args": ("has no counterpart here", "has no counterpart here", "Coming from TRL"),
    "processing_class": ("GRPOLightningModule(tokenizer=...)", "--model.tokenizer", ""),
    "peft_config": ("GRPOLightningModule(peft=...)", "--model.peft", "PEFT's `LoraConfig` as it is"),
    "warmup_ratio": ("GRPOLightningModule(warmup_steps=...)", "--model.warmup_steps", "optimizer steps"),
    "save_strategy": ("HFCheckpoint(save_steps=...)", "--hf_checkpoint.save_steps", "`save_steps=0`"),
    "save_steps": ("HFCheckpoint(save_steps=...)", "--hf_checkpoint.save_steps", ""),
    "report_to": ("L.Trainer(logger=...)", "--trainer.logger", '`report_to="none"` is `logger=False`'),
    "use_cpu": ("L.Trainer(accelerator=...)", "--trainer.accelerator", 'accelerator="cpu"'),
    "logging_steps": ("RewardLogger(logging_steps=...)", "--reward_logger.logging_steps", ""),
    "num_train_epochs": ("L.Trainer(max_epochs=...)", "--trainer.max_epochs", ""),
    "per_device_train_batch_size": (
        "PromptDataModule(prompts_per_step=...)",
        "--data.prompts_per_step",
        "prompts",
    ),
    "output_dir": ("L.Trainer(default_root_dir=...)", "--trainer.default_root_dir", ""),
    "bf16": ("L.Trainer(precision=...)", "--trainer.precision", 'precision="bf16-mixed"'),
    "seed": ("L.seed_everything(...)", "--seed_everything", ""),
    "lr_scheduler_type": ("GRPOLightningModule(lr_schedule=...)", "--model.lr_schedule", "`cosine`"),
    "reward_weights": ("GRPOLightningModule(reward=...)", "--model.reward", "(fn, weight, name)"),
    "delta": ("GRPOLightningModule(clip_ratio_c=...)", "--model.clip_ratio_c", "two-sided"),
}


@pytest.mark.parametrize("name", list(WHERE_THEY_LIVE))
def test_the_trl_names_users_set_most_say_where_each_lives_here(name):
    python, flag, said = WHERE_THEY_LIVE[name]
    with pytest.raises(TypeError) as refused:
        GRPOLightningModule(**{name: object()})
    message = str(refused.value)
    assert "\n" not in message and python in message and said in message, message
    assert "from forge_lightning.trl import GRPOConfig, GRPOTrainer" in message
    with pytest.raises(SystemExit) as refused:
        build_cli(["fit", "--config", str(SMOKE), f"--model.{name}", "x"], run=False)
    assert refused.value.code.startswith(f"fit: TRL's `{name}` ")
    assert flag in refused.value.code and said in refused.value.code, refused.value.code


@pytest.mark.parametrize("eps_high", [0.2, 0.28])
def test_trls_delta_is_clip_ratio_c(eps_high):
    # TRL's two-sided GRPO term (grpo_trainer.py: coef_1 clamped at delta, then PPO's min) against
    # the dual clip clip_ratio_c is: the same values and gradients where delta > 1 + epsilon_high.
    delta, eps_low = 2.0, 0.2
    ratio = torch.tensor([0.5, 0.9, 1.1, 1.5, 1.9, 2.5, 4.0] * 2, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([1.0] * 7 + [-1.5] * 7, dtype=torch.float64)
    coef_1 = torch.clamp(ratio, max=delta)
    trl = -torch.min(coef_1 * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    ours = clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip=delta)
    torch.testing.assert_close(ours, trl)
    (trl_grad,) = torch.autograd.grad(trl.sum(), ratio)
    (our_grad,) = torch.autograd.grad(ours.sum(), ratio)
    torch.testing.assert_close(our_grad, trl_grad)


def test_every_pointer_names_a_setting_that_exists_and_no_trl_name_is_ours():
    ours = set(parameters(GRPOLightningModule))
    for name, target in TRL_NAMES.items():
        assert name not in ours, f"{name} is a setting here: it needs no pointer"
        if target is None or "." not in target:  # the command's own: --seed_everything, --ckpt_path
            continue
        group, setting = target.split(".")
        assert setting in parameters(GROUPS[group]), target


def test_a_misspelled_setting_gets_did_you_mean_in_python_and_on_the_command_line():
    with pytest.raises(TypeError, match=r"'kl_bta': `kl_bta` is no setting here: did you mean `kl_beta`\?$"):
        GRPOLightningModule(kl_bta=0.1)
    with pytest.raises(TypeError, match=r"did you mean `group_size`\?$"):
        GRPOConfig(group_sise=4)
    with pytest.raises(
        SystemExit, match=r"^fit: `tempreature` is no setting here: did you mean `temperature`\?$"
    ):
        build_cli(["fit", "--config", str(SMOKE), "--model.tempreature=0.7"], run=False)
    # Three edits away is no misspelling: Python's own message.
    with pytest.raises(TypeError, match="unexpected keyword argument 'kl_zzzz'$"):
        GRPOLightningModule(kl_zzzz=0.1)
    assert did_you_mean("lerning_rate", parameters(GRPOLightningModule)) == "learning_rate"


def test_a_model_class_of_ones_own_takes_its_own_settings(tmp_path):
    # --model.class_path naming another class: its settings are not ours to refuse.
    from forge_lightning.settings.trl_names import given_model_settings

    args = ["fit", "--model.class_path", "mypkg.MyModule", "--model.beta", "1"]
    assert given_model_settings(args, "forge_lightning.module.GRPOLightningModule") == []
    own = ["fit", "--model.beta", "1", "--model.kl_beta=2", "--model.reward.class_path", "x.Y"]
    assert given_model_settings(own, "forge_lightning.module.GRPOLightningModule") == [
        "beta",
        "kl_beta",
        "reward",
    ]


def test_the_guide_shows_the_packages_migration_table():
    cells = json.loads(GUIDE.read_text())["cells"]
    [cell] = [c for c in cells if "<!-- trl-names: generated" in "".join(c["source"])]
    assert cell["cell_type"] == "markdown"
    text = "".join(cell["source"])
    start = text.index("<!-- trl-names: generated")
    block = text[text.index("\n", start) + 1 : text.index("<!-- trl-names: end -->")]
    assert block == migration_table()


def test_our_side_of_every_stated_default_is_our_default():
    for _, _, target, ours in TRL_DEFAULTS:
        group, setting = target.split(".")
        assert parameters(GROUPS[group])[setting].default == ours, target


def test_the_guides_example_from_trl_builds_the_module_it_says(module):
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    grpo = module(
        reward=reward_len, group_size=8, kl_beta=0.01, max_new_tokens=128, learning_rate=5e-6, temperature=0.9
    )
    assert (grpo.hparams.kl_beta, grpo.hparams.group_size, grpo.hparams.max_new_tokens) == (0.01, 8, 128)


def trl_python() -> Path:
    """A virtual environment with trl==1.16.0 and, through a .pth file, this environment's packages,
    built once under ~/.cache (FORGE_TRL_VENV); skips the test where it cannot be built (no
    registry, no ensurepip)."""
    default = Path.home() / ".cache" / "forge_lightning" / f"trl-{TRL_VERSION}"
    home = Path(os.environ.get("FORGE_TRL_VENV", default))
    python = home / "bin" / "python"
    try:
        if not (home / "ready").is_file():
            venv.create(home, with_pip=True, clear=True)
            install = [str(python), "-m", "pip", "install", "-q", "--no-deps", f"trl=={TRL_VERSION}"]
            done = subprocess.run(install, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                pytest.skip(f"trl=={TRL_VERSION} could not be installed: {done.stderr[-300:]}")
            (home / "ready").write_text(TRL_VERSION)
        where = [str(python), "-c", "import site; print(site.getsitepackages()[0])"]
        site = subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"no virtual environment for trl=={TRL_VERSION}: {err}")
    ours = next(p for p in sys.path if p.endswith("site-packages"))
    Path(site, "forge_parent.pth").write_text(ours + "\n")  # this run's packages, wherever they are
    return python


TRL_FIELDS = textwrap.dedent(
    """
    import dataclasses, json
    import trl
    from transformers import TrainingArguments
    from trl import GRPOConfig
    inherited = [f.name for f in dataclasses.fields(TrainingArguments)]
    fields = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            fields[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            fields[f.name] = f.default_factory()
        else:
            fields[f.name] = "<required>"
    try:
        import inspect
        from trl import GRPOTrainer
        trainer = list(inspect.signature(GRPOTrainer.__init__).parameters)
    except Exception:
        trainer = None
    found = {"version": trl.__version__, "fields": fields, "inherited": inherited, "trainer": trainer}
    print(json.dumps(found, default=repr))
    """
)


@pytest.mark.integration
def test_every_trl_name_and_default_is_trls_own():
    done = subprocess.run([str(trl_python()), "-c", TRL_FIELDS], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"trl=={TRL_VERSION} does not import beside these packages: {done.stderr[-300:]}")
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["version"] == TRL_VERSION
    fields = found["fields"]
    missing = [name for name in TRL_CONFIG_NAMES if name not in fields]
    assert not missing, f"not GRPOConfig fields of trl {TRL_VERSION}: {missing}"
    if found["trainer"] is not None:  # GRPOTrainer imports where its own requirements do
        missing = [name for name in TRL_TRAINER_NAMES if name not in found["trainer"]]
        assert not missing, f"not GRPOTrainer arguments of trl {TRL_VERSION}: {missing}"
    for name, trl_default, _, _ in TRL_DEFAULTS:
        assert fields[name] == trl_default, (name, fields[name])
    # Every name GRPOConfig adds to transformers' TrainingArguments is ours too, or has a pointer.
    ours = set(parameters(GRPOLightningModule))
    unmapped = [n for n in fields if n not in found["inherited"] and n not in ours and n not in TRL_NAMES]
    assert not unmapped, f"GRPOConfig names with neither a setting of that name nor a pointer: {unmapped}"
