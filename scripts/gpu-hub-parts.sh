#!/usr/bin/env bash
# Splits the hub fixtures (zero-candle/tests/fixtures: about 74 MB) into
# PARTS folders of about equal size, for device calls that cannot carry
# them all beside the GPU bundle:
#   scripts/gpu-hub-parts.sh PARTS OUT_DIR
# OUT_DIR/part-I holds `gpt2/` (part 1) and, for its share of the Llama
# families, `llama/FAMILY/` with `llama/golden/FAMILY.safetensors` and the
# shared `llama/golden/input_ids.safetensors`. On the GPU machine,
#   ZERO_HUB_FIXTURES=OUT_DIR/part-I t/zero-candle.gpu_hub --include-ignored
# runs the fixtures found there (gpu_hub.rs names what it ran and what it
# left out).
set -euo pipefail
cd "$(dirname "$0")/.."
parts="${1:?usage: $0 PARTS OUT_DIR}"
out="$(realpath -m "${2:?usage: $0 PARTS OUT_DIR}")"
[[ "$parts" =~ ^[1-9][0-9]*$ ]] || { echo "PARTS is a count, not $parts" >&2; exit 2; }
src=zero-candle/tests/fixtures
rm -rf "$out"
for ((i = 1; i <= parts; i++)); do mkdir -p "$out/part-$i/llama/golden"; done
cp -r "$src/gpt2" "$out/part-1/"

# Each family (its folder and golden file) to the part holding the fewest
# bytes so far, the largest families first.
declare -a size
for ((i = 1; i <= parts; i++)); do size[i]=0; done
while read -r bytes family; do
    smallest=1
    for ((i = 2; i <= parts; i++)); do
        ((size[i] < size[smallest])) && smallest=$i
    done
    cp -r "$src/llama/$family" "$out/part-$smallest/llama/"
    cp "$src/llama/golden/$family.safetensors" "$out/part-$smallest/llama/golden/"
    size[smallest]=$((size[smallest] + bytes))
done < <(
    for golden in "$src"/llama/golden/*.safetensors; do
        family="$(basename "$golden" .safetensors)"
        [[ -d "$src/llama/$family" ]] || continue
        echo "$(du -sb "$golden" "$src/llama/$family" | awk '{s += $1} END {print s}') $family"
    done | sort -rn
)
for ((i = 1; i <= parts; i++)); do
    cp "$src/llama/golden/input_ids.safetensors" "$out/part-$i/llama/golden/"
    du -sh "$out/part-$i"
done
