"""PyTorch distributed checkpoints (DCP) through the command line: a run
saved by ``torch.distributed.checkpoint`` is committed step by step, its
``.distcp`` files are read as tensors (deltas between steps), and a
checkout loads back with ``dcp.load`` into exactly the saved state."""

import json

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from same import assert_same  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))


def _train(model, opt, steps):
    for _ in range(steps):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_dcp_run_commits_as_tensors_and_checks_out_for_dcp_load(cli, tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    run = tmp_path / "run"
    for step in (10, 20):
        _train(model, opt, 10)
        d = run / f"step-{step}"
        dcp.save(_state(model, opt), checkpoint_id=str(d))
        saved[step] = json.loads(json.dumps(_state(model, opt), default=lambda t: t.tolist()))
    repo = tmp_path / "repo"
    cli("init", repo)
    for step in (10, 20):
        cli("-C", repo, "commit", run / f"step-{step}")

    shown = json.loads(cli("-C", repo, "show", "20", "--json").stdout)
    distcp = [f for f in shown["files"] if f["path"].endswith(".distcp")]
    assert distcp, "DCP writes .distcp files"
    assert all(f["kind"] == "distcp" and f["warning"] is None for f in distcp)
    names = {t["name"] for f in distcp for t in f["tensors"]}
    assert "model.0.weight" in names and "optim.state.0.exp_avg" in names, names
    stored = {t["name"]: t["storage"] for f in distcp for t in f["tensors"]}
    assert stored["model.0.weight"]["stored_as"] == "delta", "step 20 is coded against step 10"

    for step in (10, 20):
        out = tmp_path / f"co-{step}"
        cli("-C", repo, "checkout", step, "-o", out)
        fresh_model = _model()
        fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
        _train(fresh_model, fresh_opt, 1)  # the optimizer's state exists
        target = _state(fresh_model, fresh_opt)
        dcp.load(target, checkpoint_id=str(out))
        got = json.loads(json.dumps(target, default=lambda t: t.tolist()))
        assert_same(saved[step], got)


def test_two_rank_sharded_dcp_run_commits_per_shard_deltas_and_loads_back_resharded(cli, tmp_path):
    """Issue 19: a 2-rank gloo world saves every tensor sharded along dim 0
    (FSDP2's layout: each ``__<rank>_0.distcp`` holds half of each tensor).
    Each shard is read as a tensor and coded against the same shard of the
    previous step, every checkout is byte for byte the saved directory, and
    ``dcp.load`` in one process (a different world size) restores the full
    state exactly."""
    import filecmp
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    script = os.path.join(os.path.dirname(__file__), "dcp_two_ranks.py")
    subprocess.run([sys.executable, script, str(run), "10", "20"], check=True, timeout=600, capture_output=True)
    repo = tmp_path / "repo"
    cli("init", repo)
    for step in (10, 20):
        cli("-C", repo, "commit", run / f"step-{step}")

    shown = json.loads(cli("-C", repo, "show", "20", "--json").stdout)
    files = {f["path"]: f for f in shown["files"]}
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files), set(files)
    stored = {}
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert files[name]["kind"] == "distcp" and files[name]["warning"] is None
        stored.update({t["name"]: t["storage"]["stored_as"] for t in files[name]["tensors"]})
    # Rank 1's half of each tensor is named by its offset in the whole.
    for shard in ("model.0.weight", "model.0.weight@64,0", "model.2.weight", "model.2.weight@8,0"):
        assert stored.get(shard) == "delta", (shard, stored)

    for step in (10, 20):
        out = tmp_path / f"co-{step}"
        cli("-C", repo, "checkout", step, "-o", out)
        saved = run / f"step-{step}"
        assert sorted(os.listdir(out)) == sorted(os.listdir(saved))
        for f in os.listdir(saved):
            assert filecmp.cmp(saved / f, out / f, shallow=False), f
        full = torch.load(run / f"full-{step}.pt")
        target = {
            "model": {k: torch.zeros_like(v) for k, v in full["model"].items()},
            "optim": {n: {k: torch.zeros_like(v) for k, v in s.items()} for n, s in full["optim"].items()},
        }
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
        assert_same(full, target)
