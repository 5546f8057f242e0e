#!/usr/bin/env bash
# Activation checkpointing's figures on the CPU (BENCHMARKS.md): the
# trainer's GPT 4 x 128, context 256, 16 sequences per rank, 2 ranks as
# threads, AdamW, f32, 8 steps, with and without --checkpoint-activations,
# alternated over ROUNDS rounds (default 2): the process's peak heap
# (`--metrics`' counting allocator) and the median step time of steps 3-8.
# Usage: scripts/checkpoint-activations.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
if [ -z "${TRAIN:-}" ]; then
    cargo build --release -q -p zero-examples --bin train
    TRAIN=${CARGO_TARGET_DIR:-target}/release/train
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

run() {
    "$TRAIN" --quiet --model gpt --layers 4 --d-model 128 --heads 4 --context 256 \
        --batch-size 16 --world-size 2 --steps 8 --eval-every 0 \
        --metrics "$dir/m.jsonl" "$@" >/dev/null
    python3 - "$dir/m.jsonl" <<'EOF'
import json, statistics, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
peak = max(s["peak_heap_bytes"] or 0 for s in steps)
time = statistics.median(s["step_time_s"] for s in steps[2:])
print(peak, time)
EOF
}

for round in $(seq "$rounds"); do
    read -r plain_peak plain_time < <(run)
    read -r ckpt_peak ckpt_time < <(run --checkpoint-activations)
    awk -v r="$round" -v pp="$plain_peak" -v pt="$plain_time" -v cp="$ckpt_peak" -v ct="$ckpt_time" \
        'BEGIN { printf "round %d: peak heap %.0f MB -> %.0f MB (%.2fx), step %.0f ms -> %.0f ms (%.2fx)\n",
            r, pp / 1e6, cp / 1e6, cp / pp, pt * 1e3, ct * 1e3, ct / pt }'
done
