"""``forge-lightning`` / ``python -m forge_lightning``: LightningCLI over the module and datamodule."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningCLI

from forge_lightning.data.datamodule import GSM8KDataModule
from forge_lightning.module import GRPOLightningModule


class ForgeCLI(LightningCLI):
    """LightningCLI with the defaults a GRPO run wants."""


def build_cli(args: list[str] | None = None, run: bool = True) -> ForgeCLI:
    """Build (and by default run) the CLI; ``args`` as on the command line (None reads ``sys.argv``)."""
    # Metrics reach the loggers through RewardLogger at its own cadence; the sanity check would
    # spend a full greedy generation before the first step.
    trainer_defaults: dict[str, Any] = {"num_sanity_val_steps": 0, "log_every_n_steps": 1}
    return ForgeCLI(
        GRPOLightningModule,
        GSM8KDataModule,
        trainer_defaults=trainer_defaults,
        # The saved config.yaml is the record of what ran; a resumed run in the same folder
        # writes the same file again instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        # The module owns its optimizer and warmup-cosine schedule (configure_optimizers).
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def main() -> None:
    """Console-script entry point."""
    build_cli()


if __name__ == "__main__":
    main()
