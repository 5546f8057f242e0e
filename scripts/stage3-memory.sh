#!/usr/bin/env bash
# Stage 3's memory as a user meets it, with the trainer (BENCHMARKS.md):
#  1. Process peak RSS (`/usr/bin/time`), ranks as threads, MLP
#     1024-4x2048-10, AdamW, f32, 4 steps and --save: stage 3 / stage 2 at
#     4 ranks, stage 2 / stage 0 at 2 ranks; with the trainer's allocator
#     settings, then with glibc returning freed blocks above 4 MiB.
#  2. `mpirun -n 4`, MLP 1024-4x4096-10 (54.5M parameters), each rank's data
#     segment capped with `ulimit -d` (KB): whether stage 3 and stage 2
#     train 4 steps and save under each cap.
# Usage: scripts/stage3-memory.sh [CAP_KB...] (default caps: 300000 350000
# 500000 700000). Needs Open MPI for part 2 (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
caps=("$@")
[ ${#caps[@]} -gt 0 ] || caps=(300000 350000 500000 700000)

cargo build --release -q -p zero-examples --features mpi --bin train
train=${CARGO_TARGET_DIR:-target}/release/train
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# 256 rows of 1024 inputs, 10 classes (safetensors written by hand: no
# Python package needed).
python3 - "$dir/data.safetensors" <<'EOF'
import json, random, struct, sys
rows, width, classes = 256, 1024, 10
rng = random.Random(7)
inputs = struct.pack(f"<{rows * width}f", *(rng.uniform(-1, 1) for _ in range(rows * width)))
targets = struct.pack(f"<{rows}q", *(rng.randrange(classes) for _ in range(rows)))
header = {
    "inputs": {"dtype": "F32", "shape": [rows, width], "data_offsets": [0, len(inputs)]},
    "targets": {"dtype": "I64", "shape": [rows], "data_offsets": [len(inputs), len(inputs) + len(targets)]},
}
blob = json.dumps(header).encode()
blob += b" " * (-len(blob) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob + inputs + targets)
EOF

common=(--data "$dir/data.safetensors" --steps 4 --batch-size 8 --quiet)

# Peak RSS in KB of one run.
peak() {
    /usr/bin/time -f %M -o "$dir/rss" "$train" "${common[@]}" "$@" >/dev/null
    cat "$dir/rss"
}

ratio() { awk "BEGIN { printf \"%.2f\", $1 / $2 }"; }
small=(--hidden 2048,2048,2048,2048 --save "$dir/w.safetensors")
# The trainer keeps freed blocks of up to 32 MiB (faster steps, see
# `tune_process`); with MALLOC_MMAP_THRESHOLD_ glibc returns those above it.
for threshold in "" 4194304; do
    echo "== peak RSS, ranks as threads, MLP 1024-4x2048-10, with --save${threshold:+, MALLOC_MMAP_THRESHOLD_=$threshold}"
    if [ -n "$threshold" ]; then export MALLOC_MMAP_THRESHOLD_=$threshold; fi
    s0_2=$(peak --world-size 2 --stage 0 "${small[@]}")
    s2_2=$(peak --world-size 2 --stage 2 "${small[@]}")
    s2_4=$(peak --world-size 4 --stage 2 "${small[@]}")
    s3_4=$(peak --world-size 4 --stage 3 "${small[@]}")
    echo "N=2: stage 0 $((s0_2 / 1000)) MB, stage 2 $((s2_2 / 1000)) MB: stage2/stage0 $(ratio "$s2_2" "$s0_2")"
    echo "N=4: stage 2 $((s2_4 / 1000)) MB, stage 3 $((s3_4 / 1000)) MB: stage3/stage2 $(ratio "$s3_4" "$s2_4")"
done
unset MALLOC_MMAP_THRESHOLD_

command -v mpirun >/dev/null || {
    echo "stage3-memory: mpirun not found; skipping the capped MPI runs" >&2
    exit 0
}
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
echo "== mpirun -n 4, MLP 1024-4x4096-10 (54.5M parameters), ulimit -d per rank"
for cap in "${caps[@]}"; do
    for stage in 2 3; do
        if timeout 900 mpirun --oversubscribe --allow-run-as-root -n 4 \
            bash -c "ulimit -d $cap && exec $train --backend mpi --stage $stage \
                --hidden 4096,4096,4096,4096 --save $dir/big.safetensors $(printf '%q ' "${common[@]}")" \
            >"$dir/log" 2>&1; then
            result="trains and saves"
        else
            result="fails: $(grep -m1 -iE 'memory|alloc|error' "$dir/log" | cut -c1-100)"
        fi
        echo "cap $((cap / 1000)) MB, stage $stage: $result"
    done
done
