#!/usr/bin/env bash
# Installs what building and testing ckvc needs beyond the Rust toolchain:
# - Debian's RocksDB (the rocksdb crate links it, see .cargo/config.toml,
#   instead of compiling RocksDB for half an hour) and libclang for bindgen;
# - the S3-compatible servers the remote tests start on 127.0.0.1:
#   s3s-fs 0.14.1 (built once with cargo install, cached in
#   ~/.cache/ckvc/bin, outside the clone) and moto[server] 5.2.5 (pip).
# Skips what is already installed; uses sudo when not root. Called by .ci/run.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if ! dpkg -s librocksdb-dev >/dev/null 2>&1 || ! dpkg -s libclang-dev >/dev/null 2>&1; then
    echo "== apt-get install librocksdb-dev libclang-dev"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq librocksdb-dev libclang-dev
fi

CACHE="${CKVC_CACHE:-$HOME/.cache/ckvc}"
if ! "$CACHE/bin/s3s-fs" --version 2>/dev/null | grep -q "0.14.1"; then
    # A cold build takes ~4 CPU-minutes (measured: 8.7 min wall on a loaded
    # 2-core machine); its target dir is kept beside the binary.
    echo "== cargo install s3s-fs 0.14.1 (into $CACHE/bin)"
    CARGO_TARGET_DIR="$CACHE/s3s-fs-target" cargo install s3s-fs --version 0.14.1 \
        --features binary --locked --root "$CACHE" --quiet
    rm -rf "$CACHE/s3s-fs-target"
fi

if ! python3 -c 'import importlib.metadata as m, sys; sys.exit(m.version("moto") != "5.2.5")' 2>/dev/null \
    || ! command -v moto_server >/dev/null 2>&1; then
    echo "== pip install moto[server]==5.2.5"
    python3 -m pip install --quiet --disable-pip-version-check 'moto[server]==5.2.5'
fi
