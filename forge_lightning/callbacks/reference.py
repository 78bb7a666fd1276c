"""The frozen reference policy that the KL term pulls toward."""

from __future__ import annotations

import copy
import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM, PreTrainedModel
from typing_extensions import override

from forge_lightning.callbacks._paths import output_dir
from forge_lightning.callbacks.protocols import TakesReference
from forge_lightning.models.lora import adapter_disabled, has_adapter
from forge_lightning.models.sharding import (
    full_state_dict,
    is_sharded,
    load_weights,
    save_sharded_pretrained,
    sharded_copy,
)
from forge_lightning.run.fileio import folder_fingerprint, weight_files, write_folder_atomically

log = logging.getLogger(__name__)


class ReferenceModel(Callback):
    """Keeps a frozen copy of the policy as it was when training first started.

    On a first fit the initial policy is written once, in HF format, to ``{output_dir}/reference/``
    and a frozen in-memory copy is kept (eval mode, no gradients, on the policy's device, in the
    compute dtype: bf16 under ``bf16-mixed``, fp16 under ``16-mixed``, else the policy's; a frozen
    model needs no full-precision master copy). On a resumed fit (``ckpt_path`` given) that
    folder is loaded instead, so the reference is always the original policy, never the resumed
    one. Its weights never enter Lightning checkpoints: they live in the folder.

    A PEFT (LoRA) policy needs neither the copy nor the folder: its base weights are frozen, so the
    policy with its adapters switched off is the policy before training, on a first fit and on a
    resumed one alike. The reference is then the policy itself, and the reference forward runs
    inside :meth:`scope` (``disable_adapter``). This holds when the adapters started at zero, as a
    fresh LoRA adapter does; a PEFT model built elsewhere with trained adapters gets its bare base
    model as the reference.

    The callback hands itself to the module (``pl_module.use_reference(self)``) as the
    :class:`ReferenceSource` the module scores the reference with; a module never looks it up.

    The checkpoint records a fingerprint (SHA-256) of the folder's weight files; a resume whose
    folder no longer matches it (another model written there, a truncated file) is an error.

    A policy sharded with FSDP2 (ModelParallelStrategy) gets a reference sharded over the same mesh,
    so each rank holds 1/N of it, as of the policy; rank 0 gathers the whole policy once, to write
    the folder and send each rank its shard.

    Args:
        output_dir: run folder; ``trainer.default_root_dir`` when None.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        self.output_dir = output_dir
        self._model: PreTrainedModel | None = None
        self.shares_policy = False
        self.fingerprint: str | None = None  # of reference/, kept in the Lightning checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint} if self.fingerprint else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fingerprint = state_dict.get("fingerprint")

    @property
    def model(self) -> PreTrainedModel:
        """The frozen reference; a clear error outside fit, when there is none."""
        if self._model is None:
            raise RuntimeError("the reference model exists only during fit (ReferenceModel.on_fit_start)")
        return self._model

    def folder(self, trainer: pl.Trainer) -> Path:
        return output_dir(trainer, self.output_dir) / "reference"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model = self._build(trainer, pl_module.model)
        # The data goes one way: the callback hands the module its reference.
        if isinstance(pl_module, TakesReference):
            pl_module.use_reference(self)

    def _build(self, trainer: pl.Trainer, policy: PreTrainedModel) -> PreTrainedModel:
        self.shares_policy = has_adapter(policy)
        if self.shares_policy:
            return policy
        folder = self.folder(trainer)
        resuming = trainer.ckpt_path is not None
        if resuming and trainer.is_global_zero:
            self._check_fingerprint(folder)
        if is_sharded(policy):
            model = self._sharded(trainer, folder, policy)
        elif resuming:
            model = self._load(folder, policy, _compute_dtype(trainer))
        else:
            model = copy.deepcopy(policy)
            if trainer.fast_dev_run:  # a dry run writes no model files
                return _frozen(model)
            if trainer.is_global_zero:
                write_folder_atomically(folder, model.save_pretrained)
            trainer.strategy.barrier("reference_written")
        if not resuming and trainer.is_global_zero:
            self.fingerprint = folder_fingerprint(folder)
        if not is_sharded(policy) and _compute_dtype(trainer) is not None:
            model = model.to(_compute_dtype(trainer))
        return _frozen(model)

    def _check_fingerprint(self, folder: Path) -> None:
        _check_folder(folder)
        if self.fingerprint is None:
            return  # a checkpoint from before fingerprints were kept
        found = folder_fingerprint(folder)
        if found != self.fingerprint:
            files = ", ".join(p.name for p in weight_files(folder))
            raise RuntimeError(
                f"the reference policy in {folder} ({files}) is not the one this run started with: its "
                f"fingerprint is {found[:16]}..., the checkpoint's {self.fingerprint[:16]}... (replaced "
                "or truncated?). Restore the run's own reference/ folder, or start a new run"
            )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model = None  # free the memory; the folder stays for later resumes

    @staticmethod
    def _sharded(trainer: pl.Trainer, folder: Path, policy: PreTrainedModel) -> PreTrainedModel:
        """The reference of an FSDP2 policy, sharded the same way: rank 0 gathers the policy (first
        fit) or reads the folder (resume), and each rank keeps its shard of the copy."""
        if trainer.ckpt_path is not None:
            _check_folder(folder)
            weights = load_weights(folder) if trainer.is_global_zero else {}
        else:
            weights = full_state_dict(policy)
            if trainer.is_global_zero:
                write_folder_atomically(folder, lambda tmp: save_sharded_pretrained(policy, tmp, weights))
            trainer.strategy.barrier("reference_written")
        return sharded_copy(policy, weights)

    @staticmethod
    def _load(folder: Path, policy: PreTrainedModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
        _check_folder(folder)
        param = next(policy.parameters())
        log.info("Loading the reference policy from %s", folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or param.dtype)
        except Exception as err:
            files = ", ".join(str(p) for p in weight_files(folder)) or "no weight files"
            raise RuntimeError(f"could not load the reference policy from {folder} ({files}): {err}") from err
        return model.to(param.device)

    def scope(self) -> AbstractContextManager[Any]:
        """The context the reference forward runs in: the policy's adapters off when it is the reference."""
        return adapter_disabled(self.model) if self.shares_policy else nullcontext()


def _compute_dtype(trainer: pl.Trainer) -> torch.dtype | None:
    """The dtype autocast computes in under a mixed precision, else None."""
    precision = str(trainer.precision)
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


def _check_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"resuming needs the original reference policy in {folder}, written by the first fit; "
            "it is missing. Resume in the run's own output folder."
        )
