import os
import shutil
import subprocess

import pytest

import ckvc


@pytest.fixture
def repo(tmp_path):
    return ckvc.Repository.init(tmp_path / "repo")


def ckvc_bin():
    """The ckvc command line: $CKVC_BIN, else a build in $CARGO_TARGET_DIR
    or ./target, else PATH."""
    cands = [os.environ.get("CKVC_BIN")]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for t in [os.environ.get("CARGO_TARGET_DIR"), os.path.join(root, "target")]:
        if t:
            cands += [os.path.join(t, "release", "ckvc"), os.path.join(t, "debug", "ckvc")]
    cands.append(shutil.which("ckvc"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


@pytest.fixture
def cli():
    exe = ckvc_bin()
    if exe is None:
        if os.environ.get("CKVC_REQUIRE_CLI"):
            pytest.fail("no ckvc binary (set CKVC_BIN)")
        pytest.skip("no ckvc binary (set CKVC_BIN)")

    def run(*args, cwd=None):
        return subprocess.run([exe, *map(str, args)], cwd=cwd, check=True, capture_output=True, text=True)

    return run
