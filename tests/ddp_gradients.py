"""One optimizer step of the tiny module per loss type under DDP, one prompt per rank; rank 0
saves the step's gradient (after DDP's all-reduce, before the optimizer) to ``OUT/<loss>.pt``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_gradients.py OUT ROOT
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from conftest import FixedCompletions, exact_settings, gradient_spy, other_reference
from torch.utils.data import DataLoader

from forge_lightning.data.datamodule import collate_records
from forge_lightning.module import GRPOLightningModule

RECORDS = [{"prompt": "ab"}, {"prompt": "abc d"}]
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "forge")


def main(out: Path, root: Path) -> None:
    for loss_type in LOSS_TYPES:
        pl.seed_everything(1)
        grpo = GRPOLightningModule(**exact_settings(loss_type=loss_type))
        grpo.generator = FixedCompletions(len(grpo.tokenizer), grpo.tokenizer.eos_token_id)
        grads: list[torch.Tensor] = []
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root / loss_type,
            callbacks=[other_reference(), gradient_spy(grads)],
        )
        trainer.fit(grpo, DataLoader(RECORDS, batch_size=1, collate_fn=collate_records))
        if trainer.is_global_zero:
            torch.save(grads, out / f"{loss_type}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
