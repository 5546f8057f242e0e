#!/usr/bin/env bash
# The whole test suite: installs what it needs (Open MPI, libclang), runs
# every crate's tests on the thread backend, then the MPI tests under
# mpirun with 2, 3 and 4 processes. Run from anywhere, as root or with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
cargo test --workspace --all-targets
cargo test --workspace --doc
# The NCCL crate with its features on: builds without CUDA; GPU tests print
# why they skip when no GPU is present.
cargo test -p zero-nccl --features nccl
./scripts/test-mpi.sh
echo "all tests passed"
