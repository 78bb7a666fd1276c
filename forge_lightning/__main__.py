from forge_lightning.cli import main

main()
