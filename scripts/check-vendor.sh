#!/usr/bin/env bash
# vendor/candle-core is candle-core as published with vendor/*.patch applied
# in order (vendor/README.md): fetches the published crate through cargo,
# applies the patches with `git apply` and compares every file but the
# manifest (whose tests, benches and examples sections the copy drops) and
# the registry's own files. Fails naming what differs; then regenerate the
# patch from the vendored file, or the file from the patch.
set -euo pipefail
cd "$(dirname "$0")/.."

vendored=vendor/candle-core
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$vendored/Cargo.toml" | head -n 1)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

mkdir -p "$dir/fetch/src"
cat >"$dir/fetch/Cargo.toml" <<EOF
[package]
name = "fetch-candle-core"
version = "0.0.0"
edition = "2021"

[dependencies]
candle-core = "=$version"
EOF
touch "$dir/fetch/src/lib.rs"
host=$(rustc -vV | sed -n "s/^host: //p")
cargo fetch --quiet --target "$host" --manifest-path "$dir/fetch/Cargo.toml"
published=$(cargo metadata --quiet --format-version 1 --manifest-path "$dir/fetch/Cargo.toml" |
    python3 -c 'import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "candle-core":
        print(os.path.dirname(p["manifest_path"]))')

cp -r "$published" "$dir/candle-core"
rm -rf "$dir/candle-core/"{tests,benches,examples}
root=$PWD
for patch in backward grad-sum threads; do
    if ! (cd "$dir/candle-core" && git apply -p1 "$root/vendor/candle-core-$patch.patch"); then
        echo "vendor/candle-core-$patch.patch does not apply to candle-core $version" >&2
        exit 1
    fi
done
if ! diff -r -q \
    -x Cargo.toml -x Cargo.toml.orig -x Cargo.lock -x .cargo-ok -x .cargo_vcs_info.json \
    "$dir/candle-core" "$vendored"; then
    echo "$vendored is not candle-core $version with vendor/*.patch applied (above)" >&2
    exit 1
fi
echo "$vendored: candle-core $version with its three patches"
