"""``forge-lightning`` / ``python -m forge_lightning``: LightningCLI over the module and datamodule
(forge_cli.py)."""

from forge_lightning.cli.forge_cli import ForgeCLI, build_cli, main

__all__ = ["ForgeCLI", "build_cli", "main"]
