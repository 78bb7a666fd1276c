#!/bin/sh
# One optimizer step of configs/smoke.yaml (max_steps 1: four prompts x eight completions, one
# reward call on the batch) in a new folder, then the folder removed; with `process` as the first
# argument its reward runs under --model.sandbox process. Each run's training_log line is kept in
# $STEPS_LOG (one line per run), to show each run took its one step.
set -e
dir=$(mktemp -d)
if [ "$1" = process ]; then sandbox="--model.sandbox process"; else sandbox=""; fi
forge-lightning fit --config configs/smoke.yaml --trainer.max_steps 1 --trainer.default_root_dir "$dir" $sandbox \
    >/dev/null 2>&1
cat "$dir/training_log.jsonl" >>"${STEPS_LOG:-/dev/null}"
rm -rf "$dir"
