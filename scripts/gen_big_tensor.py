#!/usr/bin/env python3
"""Write one safetensors file holding a single large fp32 tensor, to
measure ckvc's peak memory on a checkpoint larger than its budget:

    python3 scripts/gen_big_tensor.py /work/big-tensor/step-1 --gib 10
    ckvc init /work/big-repo && cd /work/big-repo
    /usr/bin/time -v ckvc commit /work/big-tensor/step-1        # "Maximum resident set size"
    /usr/bin/time -v ckvc checkout 1 -o /work/big-out

The values are N(0, 0.02) like freshly initialised weights (written in
64 MiB pieces with numpy, never held whole). A benchmark input, not a
test fixture: delete it afterwards.
"""

import argparse
import json
import os
import struct

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="checkpoint directory to create")
    p.add_argument("--gib", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    header = json.dumps(
        {"weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, n * 4]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    piece = 16 << 20  # elements
    with open(os.path.join(args.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        left = n
        while left:
            k = min(piece, left)
            f.write((rng.standard_normal(k, dtype=np.float32) * np.float32(0.02)).tobytes())
            left -= k


if __name__ == "__main__":
    main()
