"""Crash safety of the Python package: a training process saving with
``save(blocking=False)`` (and blocking saves between) is killed with SIGKILL
at random moments. After every kill, ``ckvc fsck`` is clean, every step the
process reported durable loads back bit for bit, and the branch holds only
steps that were saved (a save killed after it was durable but before it
said so may be there)."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import ckvc  # noqa: E402

from same import assert_same  # noqa: E402

# The child: a small model + AdamW state, one save per step from the step
# after the branch's newest, a background save at most steps (its first one
# reads the tensors in place, later ones copy them to the staging buffer),
# and the tensors changed in place right after each call, as a training
# loop does. The state of step s is a function of s alone (STATE), so the
# parent can rebuild it.
STATE = """
import torch

def state(step):
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(512, 512, generator=g)
    w2 = torch.randn(512, 512, generator=g)
    g.manual_seed(step)
    m = {"l1.weight": w1 + 1e-3 * torch.randn(512, 512, generator=g),
         "l2.weight": w2 + 1e-3 * torch.randn(512, 512, generator=g),
         "l2.bias": torch.randn(512, generator=g)}
    optim = {"state": {i: {"exp_avg": 1e-4 * torch.randn(t.shape, generator=g),
                           "exp_avg_sq": (1e-6 * torch.randn(t.shape, generator=g)).abs(),
                           "step": torch.tensor(float(step))}
                       for i, t in enumerate(m.values())},
             "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]}
    return {"model": m, "optim": optim, "step": step}
"""

CHILD = STATE + """
import sys
import ckvc

repo = ckvc.Repository(sys.argv[1])
start = max(repo.steps(), default=0) + 1
print("ready", flush=True)
for step in range(start, start + int(sys.argv[2])):
    s = state(step)
    if step % 3 == 0:
        c = repo.save(s, step=step)
    else:
        f = repo.save(s, step=step, blocking=False)
        # What a training loop does next: change the tensors in place.
        for t in s["model"].values():
            t.mul_(0.5)
        c = f.result()
    print("durable", c.step, flush=True)
"""

SAVES_PER_RUN = 4
KILLS = 6


def _run_child(script, repo, delay):
    """Run the child; SIGKILL it `delay` s after it is ready (None: never).
    Returns (killed while running, steps it reported durable, seconds from
    ready to its last report)."""
    p = subprocess.Popen(
        [sys.executable, script, str(repo), str(SAVES_PER_RUN)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    # Each line with when it came: the saves end before the process does
    # (the interpreter's exit takes a while), and the kills are for them.
    reports = []
    started = threading.Event()

    def read():
        assert p.stdout is not None
        for line in p.stdout:
            reports.append((time.monotonic(), line))
            started.set()
        started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not started.wait(timeout=300):
        p.kill()
        pytest.fail("the child did not start in 300 s")
    assert reports and reports[0][1] == "ready\n", reports
    ready = reports[0][0]
    killed = False
    if delay is not None:
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            killed = True
    code = p.wait(timeout=300)
    reader.join(timeout=300)
    assert killed or code == 0, (code, reports)
    durable = [int(l.split()[1]) for _, l in reports if l.startswith("durable ")]
    last = max((t for t, _ in reports), default=ready)
    return killed, durable, last - ready


def test_sigkill_during_background_saves_never_loses_a_durable_step(tmp_path, cli):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    scope = {}
    exec(STATE, scope)
    state = scope["state"]
    path = tmp_path / "repo"
    ckvc.Repository.init(path)
    seed = int(os.environ.get("CKVC_CRASH_SEED", time.time_ns()))
    rng = random.Random(seed)

    # Calibrate: a whole run, unkilled.
    _, durable, took = _run_child(script, path, None)
    assert durable == list(range(1, SAVES_PER_RUN + 1))
    reported = set(durable)
    attempted = set(durable)
    kills = 0
    runs = 0
    while kills < KILLS:
        runs += 1
        assert runs <= 4 * KILLS, f"seed {seed}: kills do not land ({kills} in {runs} runs)"
        start = max(ckvc.Repository(path).steps()) + 1
        killed, durable, ran = _run_child(script, path, rng.uniform(0, took * 1.1))
        # A kill after the last save reported is not one during a save.
        kills += killed and len(durable) < SAVES_PER_RUN
        if not killed:
            took = ran
        reported |= set(durable)
        attempted |= set(range(start, start + SAVES_PER_RUN))
        ctx = f"seed {seed}, run {runs}"
        try:
            cli("fsck", cwd=path)
        except subprocess.CalledProcessError as e:
            raise AssertionError(f"{ctx}: fsck: {e.stdout}{e.stderr}") from e
        repo = ckvc.Repository(path)
        steps = repo.steps()
        assert reported <= set(steps), (ctx, reported, steps)
        assert set(steps) <= attempted, (ctx, steps, attempted)
        for s in steps:
            try:
                assert_same(state(s), repo.load(s))
            except AssertionError as e:
                raise AssertionError(f"{ctx}: step {s} loads back different") from e
