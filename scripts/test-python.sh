#!/usr/bin/env bash
# The Python package's tests: installs what they need when missing (pip,
# quietly; a warm machine reuses the pip cache), builds and installs the
# package from this repository (`pip install .`, the Rust build in
# $CARGO_TARGET_DIR) and runs pytest on python/tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
missing=()
for m in numpy pytest torch transformers accelerate safetensors maturin; do
    "$PY" -c "import $m" 2>/dev/null || missing+=("$m")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "== pip install ${missing[*]}"
    # From PyPI only (the only Python registry these machines reach).
    "$PY" -m pip install -q "${missing[@]}"
fi

echo "== pip install . (the ckvc Python package)"
# Keep the Rust build where cargo's is (a warm target directory is reused).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
"$PY" -m pip install -q --no-build-isolation --force-reinstall --no-deps .

# The interop tests call the ckvc binary: the one `cargo test` just built
# (the README's test command runs it first), else a release build.
if [ -z "${CKVC_BIN:-}" ]; then
    if [ -x "$CARGO_TARGET_DIR/debug/ckvc" ]; then
        CKVC_BIN="$CARGO_TARGET_DIR/debug/ckvc"
    else
        echo "== cargo build --release --bin ckvc (for the interop tests)"
        cargo build -q --release --bin ckvc
        CKVC_BIN="$CARGO_TARGET_DIR/release/ckvc"
    fi
fi
export CKVC_BIN
export CKVC_REQUIRE_CLI=1

echo "== pytest python/tests"
"$PY" -m pytest -q python/tests
