#!/usr/bin/env bash
# The attention kernels on a GPU machine with nvcc and no Rust (the device
# image has nvcc and PyTorch): builds zero-nccl/tests/kernels_on_gpu/attention.cu,
# which includes the kernels' sources, compares the tensor-core kernels with
# a double-precision reference and times forward + backward at the bench's
# shapes; then PyTorch's SDPA at the same shapes
# (examples/pytorch/kernel_times.py) when python3 has torch. Exits non-zero
# when a comparison fails. CUDA_ARCH picks the target (default sm_90).
# ATTENTION_PROFILE=DIR then profiles the 1.1B Llama's forward, dK/dV and dQ
# (batch 4, T 2048, 32/4 heads of 64) under `ncu --set full` into
# DIR/attention_llama.ncu-rep and prints each kernel's throughput,
# occupancy, warp stall and shared-memory sections (a minute or two).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
nvcc -O3 -std=c++17 -arch="${CUDA_ARCH:-sm_90}" -I zero-nccl/src/kernels \
    zero-nccl/tests/kernels_on_gpu/attention.cu -o "$out/attention"
"$out/attention"
python3 examples/pytorch/kernel_times.py --iters 20 ||
    echo "PyTorch's times skipped (kernel_times.py exited with $?)"
if [ -n "${ATTENTION_PROFILE:-}" ]; then
    mkdir -p "$ATTENTION_PROFILE"
    report="$ATTENTION_PROFILE/attention_llama"
    ncu --set full -k regex:attention_tc -f -o "$report" "$out/attention" profile >/dev/null
    ncu --import "$report.ncu-rep" --print-units base --page details \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
        --section ComputeWorkloadAnalysis
fi
