#!/usr/bin/env python3
"""How much a checkpoint's 2-D float tensors hold between their rows,
beside what ckvc's FULL frame and zstd -19 get: a measurement for the
codec's next mode, not part of the benchmark.

An LM's output embedding (tied or not) gets the softmax gradient
p_v(pos) * h(pos) on every row v, so the rows of tokens that are rare in
recent batches move along one shared direction: their Adam moments are
nearly one row scaled (cosine to the mean direction ~0.9999), and the
attention and MLP moments carry per-row and per-column scales. Order-0
coding of 64 KiB blocks of byte streams (ckvc's FULL frame) sees none of
it; zstd -19's matches across the whole tensor see part of it.

Per tensor of at least --min-elements elements (bytes, estimated with an
adaptive order-0 code, which includes learning the symbols' counts):
- order0: the rotated byte streams, per 64 KiB block (about ckvc's FULL);
- zstd19: zstd -19 of the byte-grouped streams (codec-bench's peer; needs
  the `zstandard` package, else left out);
- rowref: the rows sorted by (sign along the mean direction, norm), every
  16th a root coded as in order0, each other row as the difference of its
  bit pattern from its root's (zigzag, byte streams, order0), plus a root
  index per row;
- cos: the median cosine of a row with the rows' mean direction.

    python3 scripts/row_structure.py RUN/checkpoint-300/optimizer.pt [--min-elements N]

Needs numpy and torch (and safetensors for .safetensors files).
"""

import argparse
import math
import sys

import numpy as np
import torch

try:
    import zstandard
except ImportError:
    zstandard = None

BLOCK = 1 << 16
LGAMMA = np.frompyfunc(math.lgamma, 1, 1)


def kt_bits(counts):
    """Adaptive (Krichevsky-Trofimov) code length of a histogram, in bits."""
    c = counts.astype(float)
    n = c.sum()
    return float((LGAMMA(n + 128.0) - LGAMMA(128.0) - (LGAMMA(c + 0.5) - LGAMMA(0.5)).sum()) / math.log(2))


def order0_bits(stream):
    s = stream.ravel()
    return sum(kt_bits(np.bincount(s[i : i + BLOCK], minlength=256)) for i in range(0, len(s), BLOCK))


def words(t):
    """The tensor's elements as unsigned integers of its width."""
    w = t.element_size()
    kind = {2: torch.int16, 4: torch.int32, 8: torch.int64}[w]
    a = t.contiguous().view(kind).numpy()
    return a.astype(np.uint64) & np.uint64((1 << (8 * w)) - 1), w


def rotated(a, w):
    bits = np.uint64(8 * w)
    mask = np.uint64((1 << (8 * w)) - 1)
    return ((a << np.uint64(1)) | (a >> (bits - np.uint64(1)))) & mask


def stream_bits(a, w):
    return sum(order0_bits(((a >> np.uint64(8 * k)) & np.uint64(255)).astype(np.uint8)) for k in range(w))


def zstd19(a, w):
    if zstandard is None:
        return None
    grouped = b"".join(((a >> np.uint64(8 * k)) & np.uint64(255)).astype(np.uint8).tobytes() for k in range(w))
    return len(zstandard.ZstdCompressor(level=19).compress(grouped))


def rowref_bits(t, a, w, every=16):
    f = t.float().numpy().reshape(t.shape[0], -1)
    mean = np.sign(f.sum(0))
    order = np.lexsort((np.linalg.norm(f, axis=1), np.sign(f @ mean)))
    rows = a.reshape(t.shape[0], -1)
    roots = order[::every]
    root_of = np.repeat(roots, every)[: len(order)]
    dep = order[np.arange(len(order)) % every != 0]
    dep_root = root_of[np.arange(len(order)) % every != 0]
    bits = stream_bits(rotated(rows[roots], w), w)
    if len(dep):
        d = rows[dep].astype(np.int64) - rows[dep_root].astype(np.int64)
        z = ((d << 1) ^ (d >> 63)).astype(np.uint64) & np.uint64((1 << (8 * w)) - 1)
        bits += stream_bits(z, w) + len(dep) * math.log2(max(len(roots), 2))
    return bits


def median_cos(t):
    f = t.float().numpy().reshape(t.shape[0], -1)
    r = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-30)
    m = r.mean(0)
    m /= max(np.linalg.norm(m), 1e-30)
    return float(np.median(r @ m))


def tensors(path):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path).items()
    sd = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(sd, dict) and "state" in sd:
        return [(f"state.{i}.{k}", v) for i, s in sd["state"].items() for k, v in s.items()]
    return [(k, v) for k, v in sd.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--min-elements", type=int, default=1 << 16)
    args = p.parse_args()
    tot = {"bytes": 0, "order0": 0.0, "zstd19": 0, "rowref": 0.0}
    print(f"{'tensor':36s} {'shape':>14s} {'bytes':>10s} {'order0':>10s} {'zstd19':>10s} {'rowref':>10s} {'cos':>7s}")
    for name, t in tensors(args.file):
        if not torch.is_tensor(t) or not t.is_floating_point() or t.dim() != 2:
            continue
        if t.numel() < args.min_elements or t.element_size() not in (2, 4):
            continue
        a, w = words(t)
        o0 = stream_bits(rotated(a, w), w) / 8
        z = zstd19(a, w)
        rr = rowref_bits(t, a, w) / 8
        tot["bytes"] += t.numel() * w
        tot["order0"] += o0
        tot["zstd19"] += z or 0
        tot["rowref"] += rr
        zs = f"{z:10d}" if z is not None else f"{'-':>10s}"
        print(f"{name[:36]:36s} {str(tuple(t.shape)):>14s} {t.numel() * w:10d} {o0:10.0f} {zs} {rr:10.0f} {median_cos(t):7.4f}")
    zs = f"{tot['zstd19']:10d}" if zstandard is not None else f"{'-':>10s}"
    print(f"{'total':36s} {'':>14s} {tot['bytes']:10d} {tot['order0']:10.0f} {zs} {tot['rowref']:10.0f}")


if __name__ == "__main__":
    sys.exit(main())
