"""HuggingFace-format checkpoints (``save_pretrained``) of the policy and its tokenizer."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from forge_lightning.callbacks._paths import output_dir
from forge_lightning.callbacks.model_card import model_card
from forge_lightning.callbacks.protocols import StepsInBatches
from forge_lightning.callbacks.step_boundary import completed_step
from forge_lightning.models.lora import has_adapter, lora_settings, save_merged
from forge_lightning.models.sharding import full_state_dict, is_sharded, save_sharded_pretrained
from forge_lightning.run.fileio import SpaceCheck, temporary_sibling, write_folder_atomically
from forge_lightning.settings.checks import check_setting

DEFAULT_SAVE_STEPS = 100


class HFCheckpoint(Callback):
    """Writes ``{output_dir}/{global_step}/`` every ``save_steps`` optimizer steps and
    ``{output_dir}/final/`` when training ends, each loadable with ``from_pretrained``.

    A LoRA (PEFT) policy saves its adapter (``adapter_model.safetensors``, ``adapter_config.json``,
    loadable with peft on top of the base model the config names); with the module's
    ``peft.merge_on_save`` the adapter folded into the base weights goes to ``merged/`` as a plain
    model as well, built beside the training model without changing it. Every folder holds the
    tokenizer too, and a model card (README.md: base model, training settings, last rewards).
    The adapter config's ``base_model_name_or_path`` is what the base was loaded from: the hub id
    for a hub model, the folder for a local one, and for ``embedded`` the converted folder in the
    local cache, so that ``AutoPeftModelForCausalLM`` loads the adapter offline on this machine;
    the model card's ``base_model`` names the hub model (``HuggingFaceTB/SmolLM2-135M-Instruct``
    for ``embedded``), which is what the hub links an adapter to.

    Each folder is written to a temporary sibling and renamed, so a crash never leaves a
    half-written checkpoint; a failed write names the folder and says when the disk is full, and
    a warning comes first (once) when less space is left than the previous folder took. Only
    global rank 0 writes; a policy sharded with FSDP2 is gathered onto it first (every rank takes
    part, so the callback must be configured on all of them).

    Args:
        output_dir: run folder; ``trainer.default_root_dir`` when None.
        save_steps: optimizer steps between checkpoints; 0 saves only ``final/``. None: every
            100, rounded up to a multiple of the steps each batch takes (the module's
            ``steps_per_batch``, S x mu): the steps it can save at.
        save_final: write ``final/`` at the end of training.
        save_total_limit: keep at most this many step folders, removing the oldest after each
            save (``final/`` is not counted); None keeps all.
    """

    def __init__(
        self,
        output_dir: str | None = None,
        save_steps: int | None = None,
        save_final: bool = True,
        save_total_limit: int | None = None,
    ) -> None:
        if save_steps is not None:
            check_setting("save_steps", save_steps)
        if save_total_limit is not None and (isinstance(save_total_limit, bool) or save_total_limit < 1):
            raise ValueError(f"save_total_limit must be None or an integer >= 1, got {save_total_limit!r}")
        self.output_dir = output_dir
        self.save_steps = save_steps
        self.save_final = save_final
        self.save_total_limit = save_total_limit
        self._last_saved_step = -1
        self._space = SpaceCheck("HF checkpoint folder")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run or not completed_step(pl_module):
            return  # a dry run writes no model files; mid-step, global_step is the previous step's
        every = self.every(pl_module)
        if every and step > 0 and step % every == 0 and step != self._last_saved_step:
            self._last_saved_step = step
            folder = self.save(trainer, pl_module, str(step))
            if self.save_total_limit is not None and trainer.is_global_zero:
                self._remove_oldest(folder.parent)

    def every(self, pl_module: pl.LightningModule) -> int:
        """The optimizer steps between step folders: ``save_steps``, or for None
        ``DEFAULT_SAVE_STEPS`` rounded up to a multiple of the steps each of ``pl_module``'s
        batches takes (a cadence between them would never be met, and a set one is refused)."""
        if self.save_steps is not None:
            return self.save_steps
        per_batch = max(pl_module.steps_per_batch, 1) if isinstance(pl_module, StepsInBatches) else 1
        return math.ceil(DEFAULT_SAVE_STEPS / per_batch) * per_batch

    def _remove_oldest(self, root: Path) -> None:
        steps = sorted(
            (p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
        )
        for old in steps[: -self.save_total_limit]:
            # Renamed to a temporary name first: a kill mid-delete leaves a leftover the next
            # start removes (run/folder.py), never a half-deleted step folder.
            trash = temporary_sibling(old)
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_final and not trainer.fast_dev_run:
            self.save(trainer, pl_module, "final")

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> Path:
        folder = output_dir(trainer, self.output_dir) / name
        model = pl_module.model
        # A sharded policy is gathered onto rank 0 first, and every rank must take part in that.
        weights = full_state_dict(model) if is_sharded(model) else None
        if trainer.is_global_zero:

            def write(tmp: Path) -> None:
                if weights is not None:
                    save_sharded_pretrained(model, tmp, weights)
                else:
                    model.save_pretrained(tmp)
                pl_module.tokenizer.save_pretrained(tmp)
                (tmp / "README.md").write_text(model_card(trainer, pl_module, name), encoding="utf-8")
                if has_adapter(pl_module.model) and _merge_on_save(pl_module):
                    save_merged(pl_module.model, tmp / "merged")
                    pl_module.tokenizer.save_pretrained(tmp / "merged")

            self._space.before(folder)
            write_folder_atomically(folder, write)
            self._space.after(folder)
        trainer.strategy.barrier("hf_checkpoint")
        return folder


def _merge_on_save(pl_module: pl.LightningModule) -> bool:
    settings = lora_settings(pl_module.hparams.get("peft"))
    return settings is not None and settings.merge_on_save
