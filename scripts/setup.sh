#!/usr/bin/env bash
# Installs what building ckvc needs beyond the Rust toolchain: Debian's
# RocksDB (the rocksdb crate links it, see .cargo/config.toml, instead of
# compiling RocksDB for half an hour) and libclang for bindgen. Skips what is
# already installed; uses sudo when not root. Called by .ci/run.
set -euo pipefail
if dpkg -s librocksdb-dev >/dev/null 2>&1 && dpkg -s libclang-dev >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "== apt-get install librocksdb-dev libclang-dev"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq librocksdb-dev libclang-dev
