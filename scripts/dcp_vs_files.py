#!/usr/bin/env python3
"""The same training states saved two ways, to compare what ckvc stores:

  OUT/dcp/step-N/     torch.distributed.checkpoint.save of {model, optim, step}
  OUT/files/step-N/   model.safetensors + optimizer.pt (torch.save)

A small GPT-like transformer (about 7 M parameters by default) with AdamW,
trained on random tokens on CPU, a few optimizer steps between saves.
Then commit each run with ckvc into its own repository and compare:

    python3 scripts/dcp_vs_files.py OUT [--steps 4] [--every 5] [--width 256] [--files 4]
    for kind in dcp files; do ckvc init OUT/repo-$kind; for d in $(ls -d OUT/$kind/step-* | sort -V); do
        ckvc -C OUT/repo-$kind commit $d; done; done

(in step order: a glob sorts step-10 before step-5, and ckvc refuses a step
that is not after the branch head's)
    du -sb OUT/repo-dcp/.ckvc OUT/repo-files/.ckvc
"""
import argparse
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

warnings.filterwarnings("ignore")


def model(width, layers, vocab):
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    return torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, width),
        "body": torch.nn.TransformerEncoder(layer, layers),
        "head": torch.nn.Linear(width, vocab),
    })


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--files", type=int, default=1,
                   help="DCP files per step (FileSystemWriter's thread_count: one file per writer "
                        "thread, as a multi-rank save has one per rank)")
    a = p.parse_args()
    torch.manual_seed(0)
    m = model(a.width, a.layers, a.vocab)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    n = sum(x.numel() for x in m.parameters())
    print(f"{n / 1e6:.1f} M parameters")
    for save in range(1, a.steps + 1):
        for _ in range(a.every):
            x = torch.randint(0, a.vocab, (8, 64))
            h = m["body"](m["emb"](x))
            loss = torch.nn.functional.cross_entropy(m["head"](h).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        step = save * a.every
        dcp.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": step},
                 storage_writer=dcp.FileSystemWriter(os.path.join(a.out, "dcp", f"step-{step}"),
                                                     thread_count=a.files))
        d = os.path.join(a.out, "files", f"step-{step}")
        os.makedirs(d, exist_ok=True)
        save_file({k: v.contiguous() for k, v in m.state_dict().items()},
                  os.path.join(d, "model.safetensors"))
        torch.save(opt.state_dict(), os.path.join(d, "optimizer.pt"))
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
