#!/usr/bin/env bash
# Link-time stand-ins for the CUDA libraries, so that binaries with Candle's
# `cuda` feature (which links libcuda, libcublas, libcurand, libnvrtc, libnccl
# and libcudart by name) link on a machine that has none of them. Each stub
# exports every function cudarc declares for its library and carries the real
# library's soname, so the binary loads the real one on the GPU machine.
# Usage: cuda-link-stubs.sh DIR [CUDA_MAJOR]   (DIR: the CUDA root's lib/stubs,
# where cudarc's build looks; CUDA_MAJOR: 13 unless given, the sonames' version)
set -euo pipefail
out="$1"
major="${2:-13}"
mkdir -p "$out"
# The cudarc that Cargo.lock resolves, fetched first: on a fresh machine
# (an empty cargo home) its sources are not there until cargo fetches them.
repo="$(cd "$(dirname "$0")/.." && pwd)"
cargo fetch --quiet --manifest-path "$repo/Cargo.toml"
cudarc=$(cargo metadata --quiet --format-version 1 --all-features --manifest-path "$repo/Cargo.toml" |
    python3 -c 'import json, os, sys
packages = json.load(sys.stdin)["packages"]
print(os.path.dirname(next(p["manifest_path"] for p in packages if p["name"] == "cudarc")))')/src
[[ -f "$cudarc/driver/sys/mod.rs" ]] || { echo "cuda-link-stubs: no cudarc sources at $cudarc" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# library  soname          bindings
while read -r lib soname sys; do
    grep -ohE '\bfn [A-Za-z_][A-Za-z0-9_]*\(' "$cudarc/$sys" | sed -E 's/fn (.*)\(/void \1(void) {}/' |
        sort -u >"$tmp/$lib.c"
    cc -shared -fPIC -o "$out/lib$lib.so" -Wl,-soname,"${soname/MAJOR/$major}" "$tmp/$lib.c"
done <<'LIBS'
cuda      libcuda.so.1      driver/sys/mod.rs
nvrtc     libnvrtc.so.MAJOR    nvrtc/sys/mod.rs
cublas    libcublas.so.MAJOR   cublas/sys/mod.rs
cublasLt  libcublasLt.so.MAJOR cublaslt/sys/mod.rs
curand    libcurand.so.10      curand/sys/mod.rs
nccl      libnccl.so.2         nccl/sys/mod.rs
cudart    libcudart.so.MAJOR   runtime/sys/mod.rs
LIBS
