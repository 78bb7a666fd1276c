"""A sampled validation of five scripted prompts, on two gloo processes or on one.

On two, Lightning's DistributedSampler deals out six rows: rank 0 gets prompts 0, 2 and 4, rank 1
prompts 1 and 3 and a repeat of prompt 0, alone in rank 1's second batch. Rank 0 writes the
metrics ``validate`` returned to ``OUT/metrics.json``; RewardLogger writes the answers under
``OUT/validation/``.

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/helpers/ddp_validation.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from forge_lightning.callbacks import RewardLogger
from forge_lightning.data.datamodule import collate_records
from forge_lightning.module import GRPOLightningModule
from forge_lightning.run.process_group import release_process_group
from helpers.engines import ScriptedAnswers
from helpers.models import make_model, make_tokenizer
from helpers.rewards import count_a

# Each prompt's answers: the greedy completion is the first, the n = 4 samples all four.
SCRIPT = {
    "a": ["1", "1", "1", "1"],  # reference 1: all right
    "b": ["2", "3", "3", "x"],  # reference 3: two right
    "c": ["9", "8", "9", "9"],  # reference 1: none right
    "d": ["4", "4", "5", "4"],  # reference 4: three right
    "e": ["7", "6", "6", "7"],  # reference 6: two right, tied with a wrong key seen first
}
RECORDS = [{"prompt": p, "reference": r} for p, r in zip("abcde", ["1", "3", "1", "4", "6"])]


def validate(out: Path, devices: int) -> dict[str, float]:
    """The metrics of one sampled validation of RECORDS (two per batch) on ``devices`` processes."""
    tok = make_tokenizer()
    grpo = GRPOLightningModule(
        model=make_model(len(tok)), tokenizer=tok, reward=count_a, max_new_tokens=3, val_num_generations=4
    )
    grpo.engine = ScriptedAnswers(grpo.tokenizer, SCRIPT)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[RewardLogger()],
    )
    (results,) = trainer.validate(grpo, DataLoader(RECORDS, batch_size=2, collate_fn=collate_records))
    metrics = {key: float(value) for key, value in results.items()}
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    validate(Path(sys.argv[1]), devices=2)
    release_process_group()  # else a rank may abort at exit (run/process_group.py)
