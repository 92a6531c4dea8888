#!/usr/bin/env python3
"""How small can a DELTA frame get? Code lengths of realistic models on the
deltas of a run, beside the order-0 entropy row of `ckvc debug codec-bench`.

    python3 scripts/delta_bounds.py ../shared/corpus/gpt-small

Needs numpy, torch and safetensors (torch reads optimizer.pt; it is not
on the test path). For each checkpoint after the first, every tensor is
taken against the same tensor of the previous checkpoint, byte-grouped (not
rotated), in 64 KiB blocks as the codec and the bench cut them. Rows:

- order-0 entropy of the XOR delta: the bench's "entropy" row, the
  reference of the issue's "5% below" target;
- adaptive order-0: the code length of an adaptive model (Krichevsky-
  Trofimov, alpha 1/2 over 256 symbols, per block) that learns as it goes,
  so it needs no table; the better of XOR and ULP difference per tensor;
- adaptive with the base's top byte (sign and high exponent) as context;
- adaptive order-1: the previous symbol of the same stream as context;
- adaptive, best model per stream: the least of the three above for each
  stream of each tensor (better than any one coder with one model).

Empirical conditional entropies are not shown: with up to 256 contexts
they count noise as structure (a 64 KiB block has 256 samples a context)
and understate by most of a bit per symbol. The adaptive code lengths are
sizes a coder can reach, so a target below all of them wants a better
model than these, not better coding.
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

BLOCK = 1 << 16
LN2 = math.log(2)


def load(step_dir, dtype):
    """Tensors of one checkpoint as unsigned integer arrays of their bits."""
    out = {}
    if dtype == "fp32":
        for k, v in load_file(os.path.join(step_dir, "model.safetensors")).items():
            out["w." + k] = v.contiguous().view(torch.int32).numpy().view(np.uint32).reshape(-1)
        opt = os.path.join(step_dir, "optimizer.pt")
        if os.path.exists(opt):
            state = torch.load(opt, weights_only=True, map_location="cpu")["state"]
            for pid, st in state.items():
                for name, v in st.items():
                    if torch.is_tensor(v) and v.dtype == torch.float32 and v.dim() > 0:
                        out[f"{name}.{pid}"] = v.contiguous().view(torch.int32).numpy().view(np.uint32).reshape(-1)
    else:
        for k, v in load_file(os.path.join(step_dir, "model.bf16.safetensors")).items():
            out["w." + k] = v.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return out


def streams(u, width):
    return [((u >> (8 * i)) & 255).astype(np.uint8) for i in range(width)]


def order0(x):
    """Order-0 entropy in bits, per block."""
    bits = 0.0
    for i in range(0, len(x), BLOCK):
        c = np.bincount(x[i : i + BLOCK], minlength=256)
        c = c[c > 0].astype(np.float64)
        n = c.sum()
        bits += n * np.log2(n) - (c * np.log2(c)).sum()
    return bits


def adaptive(x, ctx=None):
    """Code length in bits of an adaptive KT model per block (per context)."""
    if ctx is not None and len(ctx) != len(x):
        raise ValueError("context and symbols differ in length")
    bits = 0.0
    for i in range(0, len(x), BLOCK):
        s = torch.from_numpy(x[i : i + BLOCK].astype(np.int64))
        c = torch.zeros_like(s) if ctx is None else torch.from_numpy(ctx[i : i + BLOCK].astype(np.int64))
        joint = torch.bincount(c * 256 + s).double()
        per = torch.bincount(c).double()
        joint, per = joint[joint > 0], per[per > 0]
        nats = (torch.lgamma(per + 128.0) - math.lgamma(128.0)).sum() - (
            torch.lgamma(joint + 0.5) - math.lgamma(0.5)
        ).sum()
        bits += float(nats) / LN2
    return bits


def ulp(a, b, width):
    """Zigzagged difference of the ordered integers of two float bit arrays."""
    bits = 8 * width
    sign = 1 << (bits - 1)

    def ordered(u):
        u = u.astype(np.int64)
        return np.where(u & sign, -(u & (sign - 1)), u)

    d = ordered(b) - ordered(a)
    z = np.where(d >= 0, 2 * d, -2 * d - 1)
    return np.minimum(z, (1 << bits) - 1).astype(a.dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="directory of step-N checkpoint directories")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()
    steps = sorted(
        (int(d.split("-")[1]), os.path.join(args.run, d))
        for d in os.listdir(args.run)
        if d.startswith("step-") and d.split("-")[1].isdigit()
    )
    if len(steps) < 2:
        sys.exit(f"{args.run}: fewer than two step-N directories")
    width = 4 if args.dtype == "fp32" else 2
    rows = np.zeros(5)
    nbytes = 0
    prev = load(steps[0][1], args.dtype)
    for _, d in steps[1:]:
        cur = load(d, args.dtype)
        for k, b in cur.items():
            a = prev.get(k)
            if a is None or a.shape != b.shape:
                continue
            nbytes += width * len(a)
            x = streams(a ^ b, width)
            z = streams(ulp(a, b, width), width)
            top = ((a >> (8 * width - 8)) & 255).astype(np.uint8)
            rows[0] += sum(order0(t) for t in x)
            # Per representation and stream: order-0, top-byte context,
            # order-1 (the first symbol at 8 bits).
            costs = [
                [(adaptive(t), adaptive(t, top), adaptive(t[1:], t[:-1]) + 8) for t in s]
                for s in (x, z)
            ]
            for m in range(3):
                rows[1 + m] += min(sum(c[m] for c in cs) for cs in costs)
            rows[4] += min(sum(min(c) for c in cs) for cs in costs)
        prev = cur
    names = [
        "order-0 entropy of the XOR delta (bench row)",
        "adaptive order-0, better of XOR and ULP",
        "adaptive, base's top byte as context",
        "adaptive order-1 within the stream",
        "adaptive, best of those per stream",
    ]
    print(f"DELTA {args.dtype}: {nbytes} bytes of {len(steps) - 1} deltas")
    for name, bits in zip(names, rows):
        print(f"  {name:<46} ratio {bits / 8 / nbytes:.4f}")
    print(f"  {'5% below the order-0 entropy (the target)':<46} ratio {0.95 * rows[0] / 8 / nbytes:.4f}")


if __name__ == "__main__":
    main()
