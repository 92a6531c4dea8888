#!/usr/bin/env python3
"""Writes the distributed-checkpoint (DCP) fixtures of tests/fixtures/dcp/.

A small MLP with AdamW, trained a few steps; after steps 1 and 2 the state
{"model", "optim", "step"} is saved with torch.distributed.checkpoint.save,
in one process (step-1/, step-2/; with SerializationFormat.SAFETENSORS:
st-step-1/, st-step-2/) and in a 2-rank gloo world on CPU (ranks2-step-1/:
one __<rank>_0.distcp per rank). The bytes depend on the
torch version (the fixtures were written with the one named in
tests/fixtures/dcp/TORCH_VERSION); the structure does not.

    python3 scripts/gen_dcp_fixtures.py [OUT_DIR]
"""
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat

warnings.filterwarnings("ignore")


def model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def train(m, opt, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def state(m, opt, step):
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": step}


def ranked(rank, world, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29517"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m, opt = model_and_opt()
    train(m, opt, 1)
    dcp.save(state(m, opt, 1), checkpoint_id=os.path.join(out, "ranks2-step-1"))
    dist.destroy_process_group()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "fixtures", "dcp")
    m, opt = model_and_opt()
    for step in (1, 2):
        train(m, opt, 1)
        dcp.save(state(m, opt, step), checkpoint_id=os.path.join(out, f"step-{step}"))
        # The same state in DCP's other serialization format: tensors as
        # safetensors blobs (other items still torch.save archives).
        writer = FileSystemWriter(os.path.join(out, f"st-step-{step}"),
                                  serialization_format=SerializationFormat.SAFETENSORS)
        dcp.save(state(m, opt, step), storage_writer=writer)
    mp.spawn(ranked, args=(2, out), nprocs=2, join=True)
    with open(os.path.join(out, "TORCH_VERSION"), "w") as f:
        f.write(torch.__version__ + "\n")


if __name__ == "__main__":
    main()
