#!/usr/bin/env bash
# Type-checks the CUDA path (Candle's `cuda` feature, `NcclZeroOptimizer`, the
# trainer's `--backend nccl`, the GPU benchmarks) on a machine without CUDA:
# installs the CUDA compiler and headers from PyPI wheels into
# $CUDA_WHEELS (default /opt/cuda-wheels) and runs `cargo check` with the
# `nccl` features. Candle's kernels are compiled to PTX with nvcc on the way,
# which takes a long while on a small machine (about half an hour on 2 cores),
# so CI does not run this; run it after touching the CUDA code.
#
# Nothing is linked and nothing runs: for that, build on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

wheels="${CUDA_WHEELS:-/opt/cuda-wheels}"
root="$wheels/nvidia/cu13"
# shellcheck source=cuda-wheels.sh
source scripts/cuda-wheels.sh

if [[ ! -x "$root/bin/nvcc" || ! -e "$root/include/nv/target" ]]; then
    install_wheels "nvidia-cuda-nvcc==13.*" "nvidia-cuda-runtime==13.*" \
        "nvidia-cuda-crt==13.*" "nvidia-cuda-cccl==13.*"
fi

export PATH="$root/bin:$PATH"
export CUDA_ROOT="$root" CUDA_PATH="$root"
# No GPU to ask: build Candle's kernels for Hopper, and pin the cudarc
# bindings to CUDA 12.8 (the toolkit here is newer than cudarc knows).
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-12080}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda-check}"

cargo check -p zero-nccl --features nccl --all-targets
cargo check -p zero-candle --features nccl --all-targets
# The layers' CUDA path without the engine's (feature `cuda` alone).
cargo check -p zero-candle --features cuda
cargo check -p zero-examples --features nccl --all-targets
