"""scripts/bench_python.py runs through and reports every method of every
round (a smoke run on a tiny model; the bench's numbers are for runs by
hand on GPT-2 small, not for a test)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_python.py")

METHODS = {"torch.save + fsync", "ckvc save (blocking)", "ckvc staging=sync", "ckvc staging=background"}


def test_bench_python_runs_and_reports_every_method_of_every_round(tmp_path):
    args = ["--json", "--work", str(tmp_path), "--layers", "1", "--vocab", "256", "--n-embd", "48"]
    args += ["--rounds", "2", "--compute", "idle", "--no-dcp"]
    run = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)
    assert {(r["round"], r["method"]) for r in report["rows"]} == {(n, m) for n in (1, 2) for m in METHODS}
    for r in report["rows"]:
        assert r["stored"] > 0, r
        assert r["durable"] >= r["call"] >= 0, r
        assert r["steps"] >= 0 and r["stall"] >= r["call"], r
        if r["method"].startswith("ckvc"):
            # every ckvc save stored a commit of its own
            assert r["stored_commit"] > 0, r
        # CPU time is reported for every save; a save the loop waits for
        # whole (nothing subtracted) used some
        assert isinstance(r["cpu"], float), r
        if r["method"] in ("torch.save + fsync", "ckvc save (blocking)"):
            assert r["cpu"] > 0, r
    # the first two rounds measure memory
    assert all(r["peak_extra"] is not None for r in report["rows"])
    assert sorted(report["page_cache_bytes"]) == ["1", "2"]
    assert sorted(report["plain_step_cpu"]) == ["1", "2"]
    assert all(c >= 0 for c in report["plain_step_cpu"].values())
    assert report["cores"] >= 1
    assert report["drop_caches"] is False
    # the bench's work directory is gone
    assert os.listdir(tmp_path) == []
