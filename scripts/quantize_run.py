#!/usr/bin/env python3
"""Quantise a run's weights the two common ways, to benchmark ckvc on the
1-byte checkpoints people keep for serving and for fp8 training.

    python3 scripts/quantize_run.py ../shared/corpus/bert-ft /tmp/bert-ft-q8
    ckvc debug codec-bench /tmp/bert-ft-q8

For every checkpoint directory under SRC holding a model.safetensors,
writes OUT/<the same relative path>/model.safetensors with, per fp32 (or
bf16/fp16) weight matrix W of two or more dimensions:

- `<name>.qweight`: int8, each row (the last dimension) scaled by its
  largest magnitude to +-127 and rounded (symmetric per-channel int8, as
  LLM.int8() / GPTQ-style exports store it), and `<name>.scale` (fp16, one
  per row);
- `<name>.fp8`: float8 e4m3 of W scaled by one factor per tensor so that
  its largest magnitude is 448 (e4m3's largest finite value, as fp8
  training recipes scale), and `<name>.fp8_scale` (fp32, one value).

Vectors (biases, norms) are left out. Needs torch and safetensors.
"""

import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file


def quantise(w: torch.Tensor) -> dict:
    w = w.float()
    amax = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    s = amax / 127.0
    q = torch.round(w / s).clamp(-127, 127).to(torch.int8)
    t = w.abs().max().clamp_min(1e-12) / 448.0
    return {
        "qweight": q.contiguous(),
        "scale": s.squeeze(-1).to(torch.float16).contiguous(),
        "fp8": (w / t).to(torch.float8_e4m3fn).contiguous(),
        "fp8_scale": t.reshape(1).contiguous(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="a run: checkpoint directories with model.safetensors")
    p.add_argument("out", help="where to write the quantised run")
    a = p.parse_args()
    n = 0
    for root, _dirs, files in sorted(os.walk(a.src)):
        if "model.safetensors" not in files:
            continue
        out_dir = os.path.join(a.out, os.path.relpath(root, a.src))
        os.makedirs(out_dir, exist_ok=True)
        tensors = {}
        for k, w in load_file(os.path.join(root, "model.safetensors")).items():
            if w.dim() < 2 or not w.is_floating_point():
                continue
            for suffix, t in quantise(w).items():
                tensors[f"{k}.{suffix}"] = t
        save_file(tensors, os.path.join(out_dir, "model.safetensors"))
        n += 1
    if n == 0:
        print(f"no model.safetensors under {a.src}", file=sys.stderr)
        return 1
    print(f"{n} checkpoints quantised into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
