#!/usr/bin/env bash
# The low-precision sampler against float32 (notebooks/throughput.ipynb): two interleaved rounds of
# float32, bf16, int8 at the bench's default step (P=1, G=8, 64 tokens, fixed length), 2 threads,
# on a quiet machine. Each run's one JSON line is appended, with its label, round, date and
# command, to notebooks/figures/bench/precision_cpu.jsonl; then the medians and ratios print.
# Run from the repository root: bash notebooks/figures/bench/precision.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
[[ -f .venv/bin/activate ]] && . .venv/bin/activate  # the README's venv, where there is one
export OMP_NUM_THREADS=2
OUT=${SAMPLER_BENCH_OUT:-notebooks/figures/bench/precision_cpu.jsonl}
# A dry run of the plumbing only: SAMPLER_BENCH_OUT=/tmp/x.jsonl SAMPLER_BENCH_ARGS="--model D --steps 1"
read -r -a TRY <<<"${SAMPLER_BENCH_ARGS:-}"
BASE=(python -m forge_lightning.bench --data ../shared/data/gsm8k --prompts-per-step 1 --group 8
      --max-new-tokens 64 --fixed-length --threads 2)
for round in 0 1; do
  for precision in float32 bf16 int8; do
    extra=()
    [[ $precision != float32 ]] && extra=(--rollout-precision "$precision")
    cmd=("${BASE[@]}" "${extra[@]}" "${TRY[@]}")
    echo "round $round: $precision" >&2
    line=$("${cmd[@]}" 2>>/tmp/sampler_bench.log)
    LINE="$line" LABEL="$precision" ROUND="$round" CMD="OMP_NUM_THREADS=2 ${cmd[*]}" python - >>"$OUT" <<'PY'
import datetime, json, os
result = json.loads(os.environ["LINE"])
head = {"label": os.environ["LABEL"], "round": int(os.environ["ROUND"]),
        "date": datetime.date.today().isoformat(), "command": os.environ["CMD"]}
print(json.dumps({**head, **result}))
PY
  done
done
python - "$OUT" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])][-6:]  # this run's six lines
rate = {p: statistics.median(l["completion_tokens_per_s"] for l in lines if l["label"] == p)
        for p in ("float32", "bf16", "int8")}
gen = {p: statistics.median(l["time_generate_s"] for l in lines if l["label"] == p) for p in rate}
for p in rate:
    print(f"{p:8s} {rate[p]:7.2f} tokens/s  {rate[p] / rate['float32']:.3f}x float32  "
          f"generate {gen[p]:.2f} s")
PY
