#!/usr/bin/env bash
# The whole test suite: installs what it needs (Open MPI, libclang), runs
# every crate's tests on the thread backend, then the MPI tests under
# mpirun with 2, 3 and 4 processes. Run from anywhere, as root or with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
# No module imports another that imports it back (python3, seconds).
python3 scripts/import-circles.py
# vendor/candle-core is the published crate with vendor/*.patch applied.
./scripts/check-vendor.sh
# A one-off build needs no incremental cache (it doubles the target folder).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test --workspace --all-targets
cargo test --workspace --doc
# The NCCL crate with its features on: builds without CUDA; the tests that
# need a GPU are #[ignore]d and reported as such (run them on a GPU machine
# with `cargo test -p zero-nccl --features nccl -- --ignored`).
cargo test -p zero-nccl --features nccl
# The fused kernels through NVRTC and ptxas for sm_80 and sm_90, from PyPI
# wheels (no GPU needed).
./scripts/check-nvrtc.sh
# The fused layers' kernels run on the CPU, a host thread per CUDA thread,
# against double-precision references (g++, no GPU).
./scripts/check-kernels-on-cpu.sh
./scripts/test-mpi.sh
# Faults as users cause them: a killed or frozen rank, and the trainer
# killed at random while it checkpoints; each bounded in time.
./scripts/test-faults.sh
echo "all tests passed"
