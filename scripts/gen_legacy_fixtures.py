#!/usr/bin/env python3
"""Writes tests/fixtures/torch-legacy/: the same small training state saved
by torch.save in the legacy format (_use_new_zipfile_serialization=False,
legacy.pt) and in the zip format (zip.pt), for the parser's tests: a
model's state dict (fp32), its AdamW state (with 0-d step counters), a
bf16 and an int64 tensor, a view sharing a storage, and plain Python data.

    python3 scripts/gen_legacy_fixtures.py [OUT_DIR]
"""
import os
import sys

import torch


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "fixtures", "torch-legacy")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, 16)).sum().backward()
    opt.step()
    base = torch.arange(12, dtype=torch.int64)
    state = {
        "model": m.state_dict(),
        "optim": opt.state_dict(),
        "emb_bf16": torch.randn(5, 4).to(torch.bfloat16),
        "ids": base,
        "ids_view": base[2:6],
        "epoch": 3,
        "name": "legacy",
    }
    torch.save(state, os.path.join(out, "legacy.pt"), _use_new_zipfile_serialization=False)
    torch.save(state, os.path.join(out, "zip.pt"))
    with open(os.path.join(out, "TORCH_VERSION"), "w") as f:
        f.write(torch.__version__ + "\n")


if __name__ == "__main__":
    main()
