#!/usr/bin/env python3
"""Measure lmzip (PyPI `lmzip`, command `lmz`) on a whole run, for
`ckvc debug repo-bench --peer`.

Usage:
    pip install lmzip
    python3 scripts/compare_lmzip.py ../shared/corpus/bert-ft > /tmp/lmzip.json
    cargo run --release -- debug repo-bench ../shared/corpus/bert-ft --peer /tmp/lmzip.json

The run directory is archived whole, as its users would keep it:
`lmz compress -j 2 RUN_DIR ARCHIVE` (lmzip's defaults: its delta coding
against matching tensors of earlier files, dedup and checksums on), then
`lmz verify ARCHIVE`. Prints one JSON object on stdout, the schema of
`compare_zipnn.py --files`:
  {"codec": "lmzip", "bytes": N, "bytes_in": M, "files": K}
(bytes = archive size, bytes_in = total bytes of the run's files; README.md
and scripts in the run directory are counted too, as they are archived).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="directory holding the run's checkpoint directories")
    ap.add_argument("-j", "--threads", type=int, default=2)
    args = ap.parse_args()
    total_in = files = 0
    for root, _, names in os.walk(args.run):
        for n in names:
            total_in += os.path.getsize(os.path.join(root, n))
            files += 1
    with tempfile.TemporaryDirectory() as tmp:
        archive = os.path.join(tmp, "run.lmz")
        subprocess.run(
            ["lmz", "compress", "-q", "-j", str(args.threads), args.run, archive],
            check=True,
        )
        subprocess.run(["lmz", "verify", archive], check=True, stdout=subprocess.DEVNULL)
        size = os.path.getsize(archive)
    ver = subprocess.run(["lmz", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"# {ver}; {files} files; ratio {size / max(total_in, 1):.4f}", file=sys.stderr)
    json.dump({"codec": "lmzip", "bytes": size, "bytes_in": total_in, "files": files}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
