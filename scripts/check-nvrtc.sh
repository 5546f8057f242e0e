#!/usr/bin/env bash
# Compiles the fused CUDA kernels (zero-nccl/src/kernels/source.cu) with
# NVRTC exactly as FusedKernels::new does, and assembles the PTX with ptxas
# for sm_80 and sm_90, on a machine without a GPU: catches a kernel that
# NVRTC or ptxas rejects, and a target architecture the toolkit dropped.
# Installs NVRTC and ptxas (CUDA 13) from PyPI wheels into $CUDA_WHEELS
# (default /opt/cuda-wheels, shared with check-cuda.sh), then runs
# zero-nccl's tests/nvrtc_ptx.rs, which a plain `cargo test` leaves ignored,
# with the newest NVRTC 13 and again with NVRTC 13.0 (the GPU machines'
# CUDA, which refuses some sources the newer one takes).
set -euo pipefail
cd "$(dirname "$0")/.."

wheels="${CUDA_WHEELS:-/opt/cuda-wheels}"
root="$wheels/nvidia/cu13"

# shellcheck source=cuda-wheels.sh
source scripts/cuda-wheels.sh

if ! compgen -G "$root/lib/libnvrtc.so*" >/dev/null || [[ ! -x "$root/bin/ptxas" ]]; then
    install_wheels "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-nvcc==13.*"
fi

# libnvrtc is loaded at run time (and finds its builtins library next to
# it); ptxas is named by path, so that no nvcc lands on PATH, where cudarc's
# build would pick its version up and rebuild.
export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PTXAS="$root/bin/ptxas"

# The checks compile for real, not from the disk cache of earlier runs;
# then the cache's own test, in a process of its own.
ZERO_EXPECT_NVRTC=13 ZERO_KERNEL_CACHE=off \
    cargo test -p zero-nccl --features cuda --test nvrtc_ptx -- --ignored
oldest="${wheels}-nvrtc-13.0"
if ! compgen -G "$oldest/nvidia/cu13/lib/libnvrtc.so*" >/dev/null; then
    (wheels="$oldest" && install_wheels "nvidia-cuda-nvrtc==13.0.*")
fi
LD_LIBRARY_PATH="$oldest/nvidia/cu13/lib:$LD_LIBRARY_PATH" ZERO_EXPECT_NVRTC=13.0 \
    ZERO_KERNEL_CACHE=off cargo test -p zero-nccl --features cuda --test nvrtc_ptx -- --ignored
cargo test -p zero-nccl --features cuda --test nvrtc_cache -- --ignored
