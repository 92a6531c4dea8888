"""The command line reads what Python wrote, and Python what it committed."""

import json

import numpy as np
import pytest

import ckvc


def test_cli_checkout_of_a_python_save_is_plain_safetensors(repo, cli, tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    state = {"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.int64)}, "step": 4}
    c = repo.save(state, step=4)
    out = tmp_path / "out"
    cli("-C", repo.path, "checkout", 4, "-o", out)
    tensors = st.load_file(str(out / "tensors.safetensors"))
    np.testing.assert_array_equal(tensors["model.w"], state["model"]["w"])
    np.testing.assert_array_equal(tensors["model.b"], state["model"]["b"])
    assert json.loads((out / "state.json").read_text())["version"] == 1
    shown = json.loads(cli("-C", repo.path, "show", c.id, "--json").stdout)
    assert "tensors.safetensors" in json.dumps(shown)


def test_python_reads_a_cli_commit(repo, cli, tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    d = tmp_path / "step-7"
    d.mkdir()
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    st.save_file({"layer.weight": w, "layer.bias": np.zeros(16, np.float32)}, str(d / "model.safetensors"))
    (d / "notes.txt").write_bytes(b"hello")
    cli("-C", repo.path, "commit", d)
    back = repo.load(7)
    assert back["notes.txt"] == b"hello"
    np.testing.assert_array_equal(np.asarray(back["model.safetensors"]["layer.weight"]), w)
    with repo.open(7) as ck:
        assert set(ck.keys()) == {"layer.weight", "layer.bias"}
        np.testing.assert_array_equal(np.asarray(ck.get_tensor("layer.weight")), w)
        assert ck.read_file("notes.txt") == b"hello"


def test_commit_dir_and_checkout(repo, tmp_path):
    d = tmp_path / "checkpoint-30"
    d.mkdir()
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 30, "log_history": [{"step": 30, "loss": 0.25}]}))
    (d / "blob.bin").write_bytes(bytes(range(256)) * 10)
    c = repo.commit_dir(d)
    assert c.step == 30 and c.metrics.get("loss") == 0.25
    out = tmp_path / "co"
    c2 = repo.checkout(30, out)
    assert c2.id == c.id
    assert (out / "blob.bin").read_bytes() == (d / "blob.bin").read_bytes()
    with pytest.raises(ckvc.AlreadyExistsError):
        repo.checkout(30, out)
    repo.checkout(30, out, force=True)


def test_corrupt_error_carries_its_fields(repo, tmp_path):
    # the binding maps library errors to typed exceptions with attributes
    with pytest.raises(ckvc.NotFoundError) as e:
        repo.load("no-such-branch")
    assert e.value.rev == "no-such-branch"
    assert issubclass(ckvc.CorruptError, ckvc.CkvcError)


def test_damaged_chunk_is_a_corrupt_error_with_its_place(repo):
    import glob
    import os

    rng = np.random.default_rng(0)
    c = repo.save({"w": rng.standard_normal(1 << 20).astype(np.float32)}, step=1)
    blobs = glob.glob(os.path.join(repo.path, ".ckvc", "db", "*.blob"))
    assert blobs, "chunk data is in RocksDB blob files"
    blob = max(blobs, key=os.path.getsize)
    n = os.path.getsize(blob)
    with open(blob, "r+b") as f:
        f.seek(n // 2)
        b = f.read(16)
        f.seek(n // 2)
        f.write(bytes(x ^ 0xFF for x in b))
    with pytest.raises(ckvc.CorruptError) as e:
        repo.load(1)
    err = e.value
    assert isinstance(err, ckvc.CkvcError)
    assert err.commit == c.id and err.file == "tensors.safetensors" and err.tensor == "w"
    assert "tensor w" in err.what and err.reason
    assert isinstance(err.reason_kind, str)


def test_opening_a_repository_raises_the_soft_open_file_limit(tmp_path):
    # The store keeps every blob file it reads open; a training process's
    # soft limit (often 1024) must not be what fails a load.
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.skip(f"hard open-file limit {hard}")
    ckvc.Repository.init(str(tmp_path / "r"))
    code = (
        "import resource, sys, ckvc\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "r = ckvc.Repository(sys.argv[1])\n"
        "r.steps()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True", out.stderr
