"""Write a DCP run from a 2-rank gloo world (run by test_dcp.py in its own
process: ``python dcp_two_ranks.py RUN_DIR STEP...``).

Both ranks train the same small model (same seed, same data) and save
``{"model": ..., "optim": ...}`` with every parameter and Adam state
sharded along dim 0 across the two ranks as DTensors (FSDP2's layout), so
each ``__<rank>_0.distcp`` holds one half of each tensor. Rank 0 also
writes the full state of each step to ``RUN_DIR/full-STEP.pt`` for the
test to compare against.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))


def work(rank, run, steps):
    dist.init_process_group("gloo", init_method=f"file://{run}/.init", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    torch.manual_seed(1)
    done = 0
    for step in steps:
        for _ in range(step - done):
            m(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        done = step
        names = [n for n, _ in m.named_parameters()]
        st = opt.state_dict()["state"]
        full = {
            "model": {k: v.detach().clone() for k, v in m.state_dict().items()},
            "optim": {n: {"exp_avg": st[i]["exp_avg"].clone(), "exp_avg_sq": st[i]["exp_avg_sq"].clone()} for i, n in enumerate(names)},
        }
        shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
        state = {
            "model": {k: shard(v) for k, v in full["model"].items()},
            "optim": {n: {k: shard(v) for k, v in s.items()} for n, s in full["optim"].items()},
        }
        dcp.save(state, checkpoint_id=f"{run}/step-{step}")
        if rank == 0:
            torch.save(full, f"{run}/full-{step}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], [int(s) for s in sys.argv[2:]]), nprocs=2)
