#!/usr/bin/env bash
# Installs what building and running ckvc needs beyond the Rust toolchain:
# Debian's RocksDB (the rocksdb crate links it, see .cargo/config.toml,
# instead of compiling RocksDB for half an hour) and libclang for bindgen.
# Skips what is already installed; uses sudo when not root. The tests need
# more (the S3 servers): scripts/setup-test.sh, which calls this first.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if ! dpkg -s librocksdb-dev >/dev/null 2>&1 || ! dpkg -s libclang-dev >/dev/null 2>&1; then
    echo "== apt-get install librocksdb-dev libclang-dev"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq librocksdb-dev libclang-dev
fi
