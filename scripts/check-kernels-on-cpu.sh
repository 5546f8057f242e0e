#!/usr/bin/env bash
# Runs the fused layers' CUDA C (zero-nccl/src/kernels/layers.cu,
# attention_tc.cu and embedding.cu) and the engine's table-driven copies
# (source.cu) on the CPU: g++ compiles the kernels with
# zero-nccl/tests/kernels_on_cpu/shim.h, which makes each CUDA thread of a
# block a host thread, __syncthreads() a barrier, mma.sync a warp-wide
# product over the lanes' fragment registers and ldmatrix a warp-wide load,
# and the harnesses there compare attention (both kernel families), the
# norms, the cross-entropy, the embedding lookup and gradient, and the
# gathers and scatters of pieces (with bf16 and f16 conversions) against
# references. It checks the kernels' indexing, fragment layouts, tiling,
# masking and reductions on a machine without a GPU; the GPU tests
# (zero-candle/tests/gpu_layers.rs, zero-nccl/tests/gpu_*.rs) still need
# a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=zero-nccl/tests/kernels_on_cpu
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
tests=(attention attention_tc layers embedding copies)
# The compiles side by side.
pids=()
for test in "${tests[@]}"; do
    g++ -std=c++20 -O2 -pthread -w -I "$dir" -I zero-nccl/src/kernels \
        "$dir/$test.cpp" -o "$out/$test" &
    pids+=("$!")
done
for i in "${!tests[@]}"; do
    wait "${pids[$i]}" || {
        echo "kernels on the CPU: $dir/${tests[$i]}.cpp did not compile (g++'s errors above)" >&2
        exit 1
    }
done
# A barrier some thread never reaches would hang: bound each run.
status=0
for test in "${tests[@]}"; do
    timeout 600 "$out/$test" || { echo "kernels on the CPU: $test failed (status $?)"; status=1; }
done
exit "$status"
