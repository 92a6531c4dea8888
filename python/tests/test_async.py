"""Background saves: the state at the call is stored; errors are never lost."""

import os
import stat
import threading

import numpy as np
import pytest

import ckvc


def test_async_save_stores_the_state_at_the_call(repo):
    torch = pytest.importorskip("torch")
    w = torch.zeros(256, 1024)
    opt_state = {0: {"exp_avg": torch.zeros(1000)}}
    # staging="sync": every tensor is copied in the call (the default copies
    # large tensors in the background; test_background_staging.py)
    f = repo.save({"w": w, "opt": opt_state}, step=1, blocking=False, staging="sync")
    # training goes on at once: change everything in place
    w.add_(1.0)
    opt_state[0]["exp_avg"].fill_(7.0)
    c = f.result(timeout=60)
    assert f.done() and c.step == 1
    back = repo.load(1)
    assert torch.count_nonzero(back["w"]) == 0
    assert torch.count_nonzero(back["opt"][0]["exp_avg"]) == 0


def test_async_numpy_and_one_in_flight(repo):
    a = np.zeros(100_000, np.float32)
    futs = []
    for step in range(1, 4):
        futs.append(repo.save({"a": a}, step=step, blocking=False))
        a += 1  # mutated right after each call
    repo.wait()
    assert all(f.done() for f in futs)
    assert [f.result().step for f in futs] == [1, 2, 3]
    for step in range(1, 4):
        assert repo.load(step)["a"][0] == step - 1
    assert repo.steps() == [1, 2, 3]


def test_failed_background_save_raises_on_result(repo):
    repo.save({"a": np.zeros(4)}, step=10)
    # a real failure: step 5 is not after the branch head (10)
    f = repo.save({"a": np.ones(4)}, step=5, blocking=False)
    with pytest.raises(ckvc.StepOrderError):
        f.result(timeout=60)
    repo.wait()  # observed above: not raised again
    # not observed: wait() raises it
    repo.save({"a": np.ones(4)}, step=3, blocking=False)
    with pytest.raises(ckvc.StepOrderError):
        repo.wait()
    repo.wait()
    assert repo.steps() == [10]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_background_save_into_read_only_repository_fails(repo):
    db = os.path.join(repo.path, ".ckvc", "db")
    mode = os.stat(db).st_mode
    os.chmod(db, stat.S_IRUSR | stat.S_IXUSR)
    try:
        f = repo.save({"a": np.zeros(4)}, step=1, blocking=False)
        with pytest.raises(ckvc.CkvcError):
            f.result(timeout=60)
    finally:
        os.chmod(db, mode)


def test_cli_can_commit_while_a_repository_object_exists(repo, cli, tmp_path):
    repo.save({"a": np.zeros(4)}, step=1)
    ck = tmp_path / "checkpoint-2"
    ck.mkdir()
    (ck / "notes.txt").write_text("hi")
    cli("-C", repo.path, "commit", ck)
    assert repo.steps() == [1, 2]
    repo.save({"a": np.zeros(4)}, step=3)
    assert repo.steps() == [1, 2, 3]


def test_delta_against_the_previous_save(repo):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 1024, generator=g)
    c1 = repo.save({"w": w}, step=1)
    w2 = w.clone()
    w2[:8] += 1e-3  # a small change
    c2 = repo.save({"w": w2}, step=2)
    assert c2.stored_bytes < c1.stored_bytes / 4, (c1.stored_bytes, c2.stored_bytes)
    assert torch.equal(repo.load(2)["w"], w2) and torch.equal(repo.load(1)["w"], w)


def test_saves_keep_what_they_stored_as_the_next_saves_bases(tmp_path):
    """A blocking save keeps every tensor byte it stored as the next
    save's bases; a chain of saves deeper than one delta stores the same
    records as one whose repository keeps only the memory budget's share
    (which holds this small state), and every step loads back exactly.
    (Without any base kept: the test after this one.)"""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 1024, generator=g)
    m = torch.zeros(256, 1024)
    kept = ckvc.Repository.init(tmp_path / "kept")
    decoded = ckvc.Repository.init(tmp_path / "decoded", keep_bases=False)
    saved = []
    for step in range(1, 6):
        w = w + 1e-3 * torch.randn(256, 1024, generator=g)
        m = 0.9 * m + 0.1 * w
        state = {"w": w, "m": m, "step": step}
        a = kept.save(state, step=step)
        b = decoded.save(state, step=step)
        assert a.stored_bytes == b.stored_bytes, step
        # a blocking save keeps (at least) every tensor byte it stored
        assert kept._bases.held_bytes() >= w.numel() * 8, step
        saved.append((w.clone(), m.clone()))
    assert kept.log()[0].stored_bytes < kept.log()[-1].stored_bytes
    for step, (w_, m_) in enumerate(saved, start=1):
        s = kept.load(step)
        assert torch.equal(s["w"], w_) and torch.equal(s["m"], m_) and s["step"] == step


def test_saves_with_no_base_kept_code_against_the_keyframe_not_the_save_before(tmp_path):
    """A save whose bases are not kept codes its tensors against the
    chain's keyframe instead of decoding the save before through its
    chain: no commit's chain is deeper than one delta, the save after four
    delta saves (``max_chain``) is a keyframe, and every step loads back
    exactly."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1024, generator=g)
    repo = ckvc.Repository.init(tmp_path / "r", keep_bases=False)
    saved = []
    for step in range(1, 8):
        w = w + 1e-3 * torch.randn(256, 1024, generator=g)
        repo._bases.clear()  # nothing kept: every base comes from the store
        repo.save({"w": w, "step": step}, step=step, blocking=False).result()
        saved.append(w.clone())
    r = repo._reader()
    depths = [r.commit(c.id)["max_depth"] for c in reversed(repo.log())]
    assert depths == [0, 1, 1, 1, 1, 0, 1]
    for step, w_ in enumerate(saved, start=1):
        assert torch.equal(repo.load(step)["w"], w_), step


def test_bases_kept_stay_within_one_copy_of_the_state_beside_the_staging_buffer(repo, tmp_path):
    """``keep_bases=None``: a blocking save keeps up to the state's size
    less the staging buffer; a background save (its staging buffer a copy
    already) only the budget's share. ``True``: a copy whatever; ``False``:
    the share."""
    n = 1 << 20
    assert repo._bases_cap(n, blocking=True) == n
    assert repo._bases_cap(n, blocking=False) == 0
    f = repo.save({"x": np.ones(n // 4, dtype=np.float32)}, step=1, blocking=False)
    f.result()
    staged = repo._staging.host.array.nbytes if repo._staging.host is not None else 0
    assert repo._bases_cap(n, blocking=True) == max(0, n - staged)
    assert repo._bases_cap(n, blocking=False) == 0
    always = ckvc.Repository(repo.path, keep_bases=True)
    never = ckvc.Repository(repo.path, keep_bases=False)
    for blocking in (True, False):
        assert always._bases_cap(n, blocking=blocking) == n
        assert never._bases_cap(n, blocking=blocking) == 0
    # a background save reading its tensors in place copies nothing more
    # while optimizer.step() waits for it
    assert always._bases_cap(n, blocking=False, in_place=True) == 0


def test_another_writer_holding_the_lock_is_a_locked_error(repo):
    import fcntl

    repo.save({"a": np.zeros(4)}, step=1)
    # what a running `ckvc commit` holds: the writer's flock on .ckvc/db.lock
    with open(os.path.join(repo.path, ".ckvc", "db.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f = repo.save({"a": np.ones(4)}, step=2, blocking=False)
        with pytest.raises(ckvc.LockedError):
            f.result(timeout=60)
        assert repo.steps() == [1]  # readers read beside the writer
        assert repo.load(1)["a"].sum() == 0
    assert repo.save({"a": np.ones(4)}, step=2).step == 2


def test_each_background_priority_commits_on_threads_of_that_priority(repo):
    # A background commit's work runs on a pool whose threads have the
    # commit's nice value: BACKGROUND_NICE for staged saves, IN_PLACE_NICE
    # for a first save read in place, one pool each, whichever comes first
    # (a single pool kept the priority of the first save that made it).
    # `check` runs where the commit reads and stores, on a pool thread.
    from ckvc import _ckvc

    seen = {}

    def work(nice, step):
        def check():
            seen[nice] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        _ckvc.commit_buffers(repo.path, [("a.bin", bytes([step]) * 100_000)], step, nice=nice, check=check)

    for step, nice in ((5, ckvc.IN_PLACE_NICE), (6, ckvc.BACKGROUND_NICE), (7, ckvc.IN_PLACE_NICE)):
        t = threading.Thread(target=work, args=(nice, step))
        t.start()
        t.join(60)
    process = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen[ckvc.BACKGROUND_NICE] == min(19, process + ckvc.BACKGROUND_NICE)
    assert seen[ckvc.IN_PLACE_NICE] == min(19, process + ckvc.IN_PLACE_NICE)
    assert repo.steps()[-3:] == [5, 6, 7]


def test_a_background_commit_runs_below_the_trainers_priority(repo):
    # The commit of a background save sets its thread's nice value
    # ckvc.BACKGROUND_NICE above the process's (the thread is the save's
    # own), and a second commit on that thread leaves it there (the Trainer
    # callback's thread commits again and again); the caller's thread keeps
    # its priority. Seen here on a thread of the test's own that calls the
    # binding as a background save does.
    from ckvc import _ckvc

    seen = {}

    def work():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        for step in (7, 8):
            _ckvc.commit_buffers(
                repo.path, [("a.bin", bytes([step]) * 100_000)], step, nice=ckvc.BACKGROUND_NICE
            )
            seen[step] = os.getpriority(os.PRIO_PROCESS, tid) - before
        seen["before"] = before

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    want = min(ckvc.BACKGROUND_NICE, 19 - seen["before"])
    assert seen[7] == want and seen[8] == want
    assert main == seen["before"]
    assert repo.steps()[-2:] == [7, 8]


class _RecordingOptimizer:
    """A torch optimizer whose ``step()`` records, at its start, whether
    the save ``fut`` was still running and whether ckvc held its commits;
    with ``fail``, the step raises."""

    @staticmethod
    def make(torch, params, fail=False):
        class Recording(torch.optim.Optimizer):
            def __init__(self):
                super().__init__(params, {})
                self.seen = []
                self.fut = None

            def step(self, closure=None):
                self.seen.append((self.fut is not None and not self.fut.done(), ckvc._pause.is_held()))
                if fail:
                    raise RuntimeError("the step failed")

        return Recording()


def test_a_background_commit_is_held_while_an_optimizer_step_runs(repo):
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.randn(4096, 4096))  # 64 MiB: a commit of some time
    opt = _RecordingOptimizer.make(torch, [w])
    held_while_running = 0
    saved = []
    for step in range(1, 4):
        saved.append(w.detach().clone())
        opt.fut = repo.save({"w": w.detach()}, step=step, blocking=False)
        opt.step()
        running, held = opt.seen[-1]
        # the pre-hook held the commits of a running save; the post-hook
        # let them go when the step returned
        assert held or not running
        held_while_running += running
        assert not ckvc._pause.is_held()
        opt.fut.result(timeout=120)
        with torch.no_grad():
            w.add_(1.0)
    assert held_while_running > 0, "no step ran beside a save"
    for step in range(1, 4):
        assert torch.equal(repo.load(step)["w"], saved[step - 1])


def test_a_step_that_raises_does_not_hold_a_background_save(repo):
    torch = pytest.importorskip("torch")
    import time

    w = torch.nn.Parameter(torch.randn(4096, 4096))
    opt = _RecordingOptimizer.make(torch, [w], fail=True)
    opt.fut = f = repo.save({"w": w.detach()}, step=1, blocking=False)
    with pytest.raises(RuntimeError, match="the step failed"):
        opt.step()
    # the post-hook never ran: waiting for the save lets its commit go on
    t = time.monotonic()
    assert f.result(timeout=120).step == 1
    assert time.monotonic() - t < ckvc.STEP_PAUSE_LIMIT
    assert not ckvc._pause.is_held()
    assert torch.equal(repo.load(1)["w"], w.detach())


def _param_and_optimizer(torch):
    """A parameter with a gradient and an SGD optimizer over it."""
    w = torch.nn.Parameter(torch.randn(1024, 1024))
    w.grad = torch.ones_like(w)
    return w, torch.optim.SGD([w], lr=0.1)


def _steps_in_time(opt) -> bool:
    """True when ``opt.step()``, run on another thread, returns within 60 s."""
    stepped = threading.Event()
    threading.Thread(target=lambda: (opt.step(), stepped.set()), daemon=True).start()
    return stepped.wait(60)


def test_a_save_whose_thread_cannot_start_does_not_hang_the_next_step(repo, monkeypatch):
    torch = pytest.importorskip("torch")
    w, opt = _param_and_optimizer(torch)
    start = threading.Thread.start

    def refuse(self):
        if self.name.startswith("ckvc-save-"):
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        repo.save({"w": w.detach()}, step=1, blocking=False)
    monkeypatch.undo()
    # the save's step hook and guard wait for a staging no thread would end
    assert _steps_in_time(opt), "optimizer.step() hung on a save that never started"
    repo.wait()  # raised once already: not again
    f = repo.save({"w": w.detach()}, step=2, blocking=False)
    assert f.result(timeout=120).step == 2
    assert torch.equal(repo.load(2)["w"], w.detach())


def test_steps_hold_a_save_for_at_most_its_share_of_the_time():
    import time

    f = ckvc.SaveFuture()
    now = time.monotonic()
    f._started = now - 10.0
    share = ckvc.STEP_PAUSE_SHARE * 10.0
    f._held = share - 0.1
    assert ckvc._may_hold([f], now)
    f._held = share + 0.1
    assert not ckvc._may_hold([f], now)
    # one save past its share: no step holds the others either
    g = ckvc.SaveFuture()
    g._started = now - 10.0
    assert not ckvc._may_hold([g, f], now)
    assert ckvc._may_hold([g], now)


def test_a_pause_holds_for_seconds_or_without_deadline_and_refuses_nan():
    p = ckvc._ckvc.Pause()
    p.hold(float("inf"))  # no deadline, not an error in a step hook
    assert p.is_held()
    p.resume()
    assert not p.is_held()
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="number of seconds"):
            p.hold(bad)
    assert not p.is_held()


def test_a_save_whose_step_guard_fails_does_not_hang_the_next_step(repo, monkeypatch):
    torch = pytest.importorskip("torch")
    w, opt = _param_and_optimizer(torch)

    def fail(fut, deferred):
        raise RuntimeError("no guard")

    monkeypatch.setattr(ckvc, "_add_guard", fail)
    with pytest.raises(RuntimeError, match="no guard"):
        repo.save({"w": w.detach()}, step=1, blocking=False)
    monkeypatch.undo()
    # the step hook went in before the guard failed
    assert _steps_in_time(opt), "optimizer.step() hung on a save that never started"
    repo.wait()
    assert repo.save({"w": w.detach()}, step=2, blocking=False).result(timeout=120).step == 2
