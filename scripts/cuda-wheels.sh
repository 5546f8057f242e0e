# Sourced by check-cuda.sh and check-nvrtc.sh: `install_wheels PKG...`
# installs CUDA pieces from PyPI wheels into $wheels (set by the caller),
# next to those already there.

# pip --target replaces a top-level folder that is already there (nvidia/),
# which would drop the wheels the other script put there: install aside,
# then merge.
install_wheels() {
    if ! python3 -m pip --version >/dev/null 2>&1; then
        # A bare Debian/Ubuntu machine: pip comes from the distribution.
        local sudo=""
        if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
        $sudo apt-get update -q
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends python3-pip
    fi
    local aside
    aside="$(mktemp -d)"
    # --target writes outside any environment; Debian's pip asks to be told.
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --target "$aside" "$@"
    mkdir -p "$wheels"
    cp -a "$aside"/. "$wheels"/
    rm -rf "$aside"
}
