#!/usr/bin/env bash
# Builds the GPU test binaries, `train` and `bench` (feature `nccl`) on a
# machine without CUDA, for a GPU machine without Rust, and packs them into
# one archive: scripts/build-gpu-bundle.sh OUT.tar.xz
#
# - nvcc comes from PyPI wheels of CUDA $CUDA_WHEELS_VERSION (default 13.0)
#   into /opt/cuda-wheels-$CUDA_WHEELS_VERSION. Pick the GPU driver's CUDA
#   version (nvidia-smi's "CUDA Version"): Candle's kernels are PTX, and a
#   driver cannot load PTX from a newer CUDA.
# - Candle's `cuda` feature links libcuda, libcublas, libcurand, libnvrtc,
#   libnccl and libcudart by name; scripts/cuda-link-stubs.sh stands in for
#   those this machine lacks (the binaries load the real ones on the GPU
#   machine; libcudart links against the wheel's own).
#
# On the GPU machine, unpack it and put the CUDA and NCCL libraries on
# LD_LIBRARY_PATH; cudarc loads `libnccl.so` and `libnvrtc.so` by those
# names, so link them there if only the versioned files exist. Then run
# `t/<crate>.<test> --include-ignored` (zero-nccl's tests and zero-candle's
# GPU tests), `./bench gpu` (from the repository's root, so that it finds the
# PyTorch peers in examples/pytorch/, or with ZERO_PYTORCH_DIR set) and
# `./train --backend nccl`; scripts/gpu-check.sh does all of it.
# The first build compiles Candle's kernels (tens of minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:?usage: $0 OUT.tar.xz}")"
mkdir -p "$(dirname "$out")"

version="${CUDA_WHEELS_VERSION:-13.0}"
wheels="/opt/cuda-wheels-$version"
root="$wheels/nvidia/cu${version%%.*}"
# shellcheck source=cuda-wheels.sh
source scripts/cuda-wheels.sh
if [[ ! -x "$root/bin/nvcc" ]]; then
    # nvvm pinned too: nvcc's wheel would take the newest, whose PTX the
    # toolkit's own ptxas cannot read.
    install_wheels "nvidia-cuda-nvcc==$version.*" "nvidia-nvvm==$version.*" \
        "nvidia-cuda-runtime==$version.*" "nvidia-cuda-crt==$version.*" \
        "nvidia-cuda-cccl==$version.*"
fi
scripts/cuda-link-stubs.sh "$root/lib/stubs" "${version%%.*}"
ln -sf "../libcudart.so.${version%%.*}" "$root/lib/stubs/libcudart.so"

export PATH="$root/bin:$PATH" CUDA_ROOT="$root" CUDA_PATH="$root"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-${version%%.*}0${version#*.}0}"
# Absolute: the tests keep it (CARGO_TARGET_TMPDIR, where nvrtc_ptx writes;
# create `$CARGO_TARGET_DIR/tmp` on the GPU machine to run that one).
CARGO_TARGET_DIR="$(realpath -m "${CARGO_TARGET_DIR:-target/cuda-$version}")"
export CARGO_TARGET_DIR

cargo build -p zero-examples --features nccl --bin train --bin bench
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/t"
{
    cargo test --no-run -p zero-nccl --features nccl --message-format=json
    cargo test --no-run -p zero-candle --features nccl --test gpu_layers --test gpu_nccl \
        --test gpu_offload --test gpu_stage3 --test gpu_threads --test gpu_hub \
        --message-format=json
} |
    python3 -c '
import json, os, sys
# Every test of zero-nccl (its CPU tests are quick and check the bundled
# libraries too) and the GPU tests of zero-candle (its CPU tests run in CI),
# named crate.target: both crates have a gpu_nccl.
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["profile"]["test"]:
        crate = os.path.basename(os.path.dirname(msg["manifest_path"]))
        name = msg["target"]["name"]
        if crate == "zero-nccl" or name.startswith("gpu_"):
            print(f"{crate}.{name}", msg["executable"])
' | while read -r name exe; do cp "$exe" "$stage/t/$name"; done
cp "$CARGO_TARGET_DIR/debug/train" "$CARGO_TARGET_DIR/debug/bench" "$stage/"
strip "$stage"/t/* "$stage/train" "$stage/bench"
# xz -9's 64 MiB window finds the Candle kernels every zero-candle test
# binary embeds again: about 22 MB instead of 59 with the default, which
# matters under the device tool's 64 MiB (a few minutes more here).
tar -C "$stage" --sort=name -cf - . | xz -9 -T1 >"$out"
ls -la "$out"
