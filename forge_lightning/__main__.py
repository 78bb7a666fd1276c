from forge_lightning.cli.forge_cli import main

main()
