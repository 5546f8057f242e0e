#!/usr/bin/env bash
# Installs what the `mpi` feature needs to build and run: Open MPI (library,
# headers, mpirun) and libclang/clang (bindgen, used by the `mpi` crate's
# mpi-sys), plus python3 (the fault tests; the examples' test of
# hf_peer.py's flags), procps (pgrep) for the fault tests and g++ for
# the kernels run on the CPU (check-kernels-on-cpu.sh). Idempotent:
# installs only what is missing. Run as root on
# Debian/Ubuntu (or with sudo available).
set -euo pipefail

packages=(libopenmpi-dev openmpi-bin libclang-dev clang python3 procps g++)
missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "install-deps: all present (${packages[*]})"
    exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then
        sudo="sudo"
    else
        echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
        exit 1
    fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
mpirun --version | head -1
