#!/usr/bin/env bash
# The attention kernels on a GPU machine with nvcc and no Rust (the device
# image has nvcc and PyTorch): builds zero-nccl/tests/kernels_on_gpu/attention.cu,
# which includes the kernels' sources, compares the tensor-core kernels with
# a double-precision reference and times forward + backward at the bench's
# shapes; then PyTorch's SDPA at the same shapes
# (examples/pytorch/kernel_times.py) when python3 has torch. Exits non-zero
# when a comparison fails. CUDA_ARCH picks the target (default sm_90).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
nvcc -O3 -std=c++17 -arch="${CUDA_ARCH:-sm_90}" -I zero-nccl/src/kernels \
    zero-nccl/tests/kernels_on_gpu/attention.cu -o "$out/attention"
"$out/attention"
python3 examples/pytorch/kernel_times.py --iters 20 ||
    echo "PyTorch's times skipped (kernel_times.py exited with $?)"
