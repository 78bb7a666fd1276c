"""A fit of two DDP ranks (gloo, CPU) whose rollouts two rollout servers sample; rank 0 kills the
server whose PID it is given with SIGKILL once step 1 is done. Each rank's reward writes the
prompts it scored, one JSON line per training batch, to ``OUT/scored-<rank>.jsonl``, so a test can
tell that every prompt's group was trained once; the run's log is ``OUT/training_log.jsonl``.

    FORGE_LIGHTNING_SERVE_SECRET=... PYTHONPATH=tests python -m torch.distributed.run --standalone \
        --nproc_per_node=2 tests/helpers/ddp_servers.py OUT MODEL_DIR HOST:PORT,HOST:PORT KILL_PID
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from forge_lightning.callbacks import RewardLogger
from forge_lightning.data.datamodule import collate_records
from forge_lightning.module import GRPOLightningModule
from forge_lightning.run.process_group import release_process_group

PROMPTS = [f"q{i} a" for i in range(12)]  # 12 prompts: 3 steps of 2 per rank
GROUP_SIZE = 3


class ScoredPrompts:
    """A reward (1 per 'a') that writes the prompts of each batch it scores, with the group count."""

    __name__ = "scored_prompts"

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        path = self.out / f"scored-{os.environ.get('RANK', '0')}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps({"prompts": prompts, "responses": len(responses)}) + "\n")
        return [float(r.count("a")) for r in responses]


class KillAfterStep(pl.Callback):
    """Rank 0 kills ``pid`` (a server) with SIGKILL once optimizer step ``step`` is done."""

    def __init__(self, pid: int, step: int = 1) -> None:
        self.pid, self.step = pid, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            os.kill(self.pid, signal.SIGKILL)


def main(out: Path, model_dir: str, servers: list[str], kill: int) -> None:
    pl.seed_everything(5)
    grpo = GRPOLightningModule(
        model=model_dir,
        reward=ScoredPrompts(out),
        group_size=GROUP_SIZE,
        max_new_tokens=6,
        gradient_accumulation_steps=1,
        kl_beta=0.0,
        rollout_servers=servers,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[RewardLogger(logging_steps=1), KillAfterStep(kill)],
    )
    records = [{"prompt": p} for p in PROMPTS]
    trainer.fit(grpo, DataLoader(records, batch_size=2, collate_fn=collate_records))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]))
    release_process_group()  # else a rank may abort at exit (run/process_group.py)
