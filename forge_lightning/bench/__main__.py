from forge_lightning.bench.throughput import main

main()
