#!/usr/bin/env bash
# Installs what the tests need beyond scripts/setup.sh (which it runs
# first): the S3-compatible servers the remote tests start on 127.0.0.1,
# s3s-fs 0.14.1 (built once with cargo install, cached in ~/.cache/ckvc/bin,
# outside the clone) and moto[server] 5.2.5 (pip). Skips what is already
# installed. Called by .ci/run.
set -euo pipefail
bash "$(dirname "$0")/setup.sh"

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
