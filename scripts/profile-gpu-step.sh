#!/usr/bin/env bash
# A training step's kernels by GPU time, ours beside PyTorch's (`ncu`), on
# a GPU machine; run through scripts/gpu-check.sh so that the bundle's
# libraries are found, from inside the unpacked bundle:
#   scripts/gpu-check.sh BUNDLE LOGS "$PWD/scripts/profile-gpu-step.sh OUT_DIR"
# PROFILE_MODEL picks the step:
# - gpt (the default): the bench's GPT (12 x 768, context 256, 16
#   sequences) in PROFILE_PRECISION (bf16, the default, PyTorch with SDPA;
#   or f32, PyTorch's attention composed, as `bench gpu` compares them);
# - llama_1b or gpt2_small: `bench gpu`'s hub models in bf16 (TinyLlama's
#   shape, 4 x 2,048 tokens at stage 3; GPT-2 small, 8 x 1,024 at stage 2;
#   one rank on NCCL; `bench gpu-hub-profile`) against `transformers`
#   (`hf_peer.py --random`, SDPA, bf16 autocast).
# Each side trains PROFILE_STEPS steps (default 4) under
# `ncu --metrics gpu__time_duration.sum` (clocks and caches left as they
# are); OUT_DIR gets each side's CSV, and the table printed last is each
# side's kernels by total time per step (the first step's one-off kernels
# included), the top PROFILE_TOP (default 15).
set -euo pipefail
out="$(realpath -m "${1:?usage: $0 OUT_DIR}")"
mkdir -p "$out"
steps="${PROFILE_STEPS:-4}"
precision="${PROFILE_PRECISION:-bf16}"
model="${PROFILE_MODEL:-gpt}"
case "$precision" in
    bf16) attention=sdpa ;;
    f32) attention=manual ;;
    *) echo "PROFILE_PRECISION is bf16 or f32, not $precision" >&2; exit 2 ;;
esac
ncu_args=(--clock-control none --cache-control none --csv --print-units base
    --print-kernel-base function --metrics gpu__time_duration.sum)

case "$model" in
    gpt) ;;
    llama_1b | gpt2_small)
        if [ "$precision" != bf16 ]; then
            echo "PROFILE_MODEL=$model is profiled in bf16 only" >&2
            exit 2
        fi
        case "$model" in
            llama_1b) peer=(--random tinyllama --batch 4 --context 2048) ;;
            gpt2_small) peer=(--random small --batch 8 --context 1024) ;;
        esac
        ZERO_BENCH_HUB_CASE="$model" ZERO_BENCH_HUB_STEPS="$steps" ncu "${ncu_args[@]}" \
            --log-file "$out/ours.csv" ./bench gpu-hub-profile >"$out/ours.log" 2>&1
        ncu "${ncu_args[@]}" --log-file "$out/torch.csv" python3 "${ZERO_PYTORCH_DIR:?}/hf_peer.py" \
            --device cuda --dtype bf16 --attn-implementation sdpa "${peer[@]}" --warmup 1 \
            --steps "$((steps - 1))" >"$out/torch.log" 2>&1
        ;;
    *) echo "PROFILE_MODEL is gpt, llama_1b or gpt2_small, not $model" >&2; exit 2 ;;
esac

shape=(--layers 12 --heads 12 --d-model 768 --context 256)
if [ "$model" = gpt ]; then
    RANK=0 WORLD_SIZE=1 ncu "${ncu_args[@]}" --log-file "$out/ours.csv" ./train --backend nccl \
        --model gpt "${shape[@]}" --batch-size 16 --precision "$precision" --steps "$steps" \
        --eval-every 0 >"$out/ours.log" 2>&1
    ncu "${ncu_args[@]}" --log-file "$out/torch.csv" python3 "${ZERO_PYTORCH_DIR:?}/gpt_peer.py" \
        --device cuda --dtype "$precision" --attention "$attention" "${shape[@]}" --batch 16 \
        --warmup 1 --steps "$((steps - 1))" >"$out/torch.log" 2>&1
fi

python3 - "$out" "$steps" "${PROFILE_TOP:-15}" <<'EOF'
import csv, sys
from collections import defaultdict

out, steps, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for side in ("ours", "torch"):
    with open(f"{out}/{side}.csv") as f:
        lines = [line for line in f if line.startswith('"')]
    total, count = defaultdict(float), defaultdict(int)
    for row in csv.DictReader(lines):
        if row["Metric Name"] == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            total[row["Kernel Name"]] += value / 1e3
            count[row["Kernel Name"]] += 1
    whole = sum(total.values())
    print(f"== {side}: {sum(count.values()) / steps:.0f} kernels, {whole / steps / 1e3:.2f} ms of "
          f"kernel time per step ({steps} steps)")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / steps:9.1f} us/step {100 * us / whole:5.1f}%  x{count[name] / steps:6.1f}  {name[:90]}")
EOF
