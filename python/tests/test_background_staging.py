"""Background staging (``save(blocking=False)``, the default
``staging="background"``): large torch tensors are copied in a thread while
training goes on; ``optimizer.step()`` and any in-place change of a saved
tensor in the saving thread wait for the copy; a change from another thread
before the copy is done fails the save."""

import sys
import threading
import time

import numpy as np
import pytest

import ckvc
from ckvc import _state

torch = pytest.importorskip("torch")
from torch.optim import optimizer as _optim  # noqa: E402

from same import assert_same  # noqa: E402


@pytest.fixture(
    params=[
        "first save: read in place, copied from the back",
        "first save beside a busy loop: read in place",
        "staging buffer warm: copied",
    ]
)
def repo(request, tmp_path, monkeypatch):
    """Every test runs each way a background save takes its tensors: the
    first one of a Repository reads them in place while it commits (the
    staging buffer is not faulted in yet) and a thread copies them from
    the back, or, beside a loop that leaves no core free, only reads them
    in place; a later one copies them into the warm staging buffer."""
    free = 0.0 if "busy loop" in request.param else None
    monkeypatch.setattr(ckvc, "_loop_free_cores", lambda: free)
    r = ckvc.Repository.init(tmp_path / "repo")
    if request.param.startswith("staging"):
        r._staging.warm(64 << 20)
        assert r._staging.warm_for(64 << 20)
    return r


@pytest.fixture
def gate():
    """Holds every background copy (for a save that reads in place: every
    check of a tensor's version, which ends its read) until ``gate.set()``
    (then lets them through); removed after the test."""
    ev = threading.Event()
    seen = []

    def before(key):
        seen.append(key)
        ev.wait(60)

    _state._before_background_copy = before
    ev.seen = seen
    try:
        yield ev
    finally:
        ev.set()
        _state._before_background_copy = None


def hooks():
    """Optimizer step pre-hooks now. The process's pause hooks, which the
    first background save of the process installs once, are installed
    first, so the count moves only with stagings whichever test runs
    first (run alone, a test saw one hook more than it expected)."""
    ckvc._step_pause()
    return len(_optim._global_optimizer_pre_hooks)


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt):
    x = torch.randn(16, 512)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def trained():
    """A model and optimizer after one step, their state and a copy of it."""
    model, opt = model_and_opt()
    train_step(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    return model, opt, state, snapshot(state)


def snapshot(state):
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    if torch.is_tensor(state):
        return state.clone()
    return state


def test_optimizer_step_right_after_the_call_waits_and_the_state_at_the_call_is_stored(repo, gate):
    model, opt = model_and_opt()
    train_step(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    at_call = snapshot(state)
    base = hooks()
    f = repo.save(state, step=1, blocking=False)
    assert not f.staged() and hooks() == base + 1
    # the next training step: forward and backward run beside the copy,
    # optimizer.step() waits for it (let the copies go a little later)
    threading.Timer(0.2, gate.set).start()
    train_step(model, opt)
    assert f.staged()  # the pre-hook waited
    assert gate.seen  # the large tensors were copied in the background
    assert not torch.equal(model[0].weight, at_call["model"]["0.weight"])  # the step did change them
    assert f.result(timeout=60).step == 1
    assert hooks() == base
    assert_same(repo.load(1), at_call)


def in_another_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join(60)


def guards():
    return torch._C._len_torch_function_stack()


def test_an_in_place_change_in_the_saving_thread_waits_for_the_copy(repo, gate):
    """The contract of save(blocking=False): the state stored is the one at
    the call, whatever the loop does after it returns; an in-place change
    of a tensor still to copy waits for the copy."""
    repo.save({"w": torch.zeros(4)}, step=1)
    p = torch.nn.Parameter(torch.zeros(512, 1024))
    ws = [torch.zeros(512, 1024) for _ in range(6)]
    scratch = torch.zeros(512, 1024)  # not saved: never waits
    base = guards()
    f = repo.save({"p": p, "w": ws}, step=2, blocking=False)
    assert guards() == base + 1
    scratch.add_(1.0)
    assert not f.staged()
    threading.Timer(0.2, gate.set).start()
    ws[0].add_(1.0)  # waits for the copy
    assert f.staged()
    ws[1][0] = 5.0
    ws[2] += 1
    torch.add(ws[3], 1, out=ws[3])
    ws[4].view(-1)[:10].fill_(7.0)
    ws[5].data.copy_(torch.ones(512, 1024))
    with torch.no_grad():
        p.mul_(2.0)
    p.data = torch.ones(512, 1024)
    assert f.result(timeout=60).step == 2
    assert guards() == base  # popped by the saving thread once done
    back = repo.load(2)
    assert torch.count_nonzero(back["p"]) == 0
    assert all(torch.count_nonzero(w) == 0 for w in back["w"])


def test_the_guard_waits_only_for_saved_tensors(repo, gate):
    w = torch.zeros(512, 1024)
    f = repo.save({"w": w}, step=1, blocking=False)
    guard = ckvc._guards[-1][0]
    x = torch.zeros(512, 1024)
    x.add_(1.0).relu_()  # activations: in place, but not saved
    torch.nn.functional.relu(x, inplace=True)
    _ = w * 2 + w.sum()  # reads of saved tensors
    assert guard.waits == 0 and not f.staged()
    gate.set()
    f.result(timeout=60)


def test_an_in_place_change_from_another_thread_during_staging_fails_the_save(repo, gate):
    repo.save({"w": torch.zeros(4)}, step=1)
    w = torch.zeros(512, 1024)  # 2 MiB: staged in the background
    f = repo.save({"w": w}, step=2, blocking=False)
    # torch function modes are per thread: another thread's change is not
    # held back, but it is seen by the version counter
    in_another_thread(lambda: w.add_(1.0))
    gate.set()
    with pytest.raises(ckvc.TensorModifiedError) as e:
        f.result(timeout=60)
    assert isinstance(e.value, ckvc.CkvcError)
    assert e.value.key == "w" and e.value.version_seen > e.value.version_at_call
    assert f.staged() and f.done()
    repo.wait()  # observed above: not raised again
    assert repo.steps() == [1]  # nothing was committed


def test_an_unobserved_in_place_change_raises_on_wait(repo, gate):
    w = torch.zeros(512, 1024)
    repo.save({"w": w}, step=1, blocking=False)
    in_another_thread(lambda: w.mul_(2.0))
    gate.set()
    with pytest.raises(ckvc.TensorModifiedError):
        repo.wait()
    assert repo.steps() == []


def test_small_tensors_and_numpy_arrays_are_copied_in_the_call(repo, gate):
    small = torch.zeros(1000)  # a BatchNorm statistic, a step counter: < 1 MiB
    a = np.zeros(1 << 20, np.float32)  # numpy has no version counter
    big = torch.zeros(512, 1024)
    f = repo.save({"small": small, "a": a, "big": big}, step=1, blocking=False)
    small.fill_(3.0)
    a += 1
    assert gate.seen == [] or gate.seen == ["big"]
    gate.set()
    f.result(timeout=60)
    back = repo.load(1)
    assert torch.count_nonzero(back["small"]) == 0 and not back["a"].any()
    assert torch.count_nonzero(back["big"]) == 0


def test_wait_staged_then_in_place_changes_are_allowed(repo, gate):
    w = torch.zeros(512, 1024)
    f = repo.save({"w": w}, step=1, blocking=False)
    with pytest.raises(TimeoutError):
        f.wait_staged(timeout=0.05)
    gate.set()
    f.wait_staged(timeout=60)
    w.add_(1.0)
    assert f.result(timeout=60).step == 1
    assert torch.count_nonzero(repo.load(1)["w"]) == 0


def test_load_waits_for_staging(repo, gate):
    w = torch.zeros(512, 1024)
    repo.save({"w": w}, step=1)
    f = repo.save({"w": w + 1}, step=2, blocking=False)
    threading.Timer(0.1, gate.set).start()
    back = repo.load(1)  # e.g. model.load_state_dict(back) would change w in place next
    assert f.staged()
    assert torch.count_nonzero(back["w"]) == 0
    f.result(timeout=60)


def test_no_hook_is_left_behind_across_saves(repo):
    base = hooks()
    w = torch.zeros(512, 1024)
    for step in range(1, 5):
        f = repo.save({"w": w}, step=step, blocking=False)
        assert hooks() <= base + 1  # the previous save's hook is gone
        f.wait_staged(timeout=60)
        w.add_(1.0)
    repo.wait()
    assert hooks() == base and guards() == 0
    assert [float(repo.load(s)["w"][0, 0]) for s in range(1, 5)] == [0.0, 1.0, 2.0, 3.0]
    # nothing to copy in the background: no hook at all
    repo.save({"w": torch.zeros(4)}, step=5, blocking=False)
    assert hooks() == base
    repo.wait()


def test_sync_staging_copies_everything_in_the_call(repo, gate):
    base = hooks()
    w = torch.zeros(512, 1024)
    f = repo.save({"w": w}, step=1, blocking=False, staging="sync")
    assert f.staged() and hooks() == base and gate.seen == []
    w.add_(1.0)
    f.result(timeout=60)
    assert torch.count_nonzero(repo.load(1)["w"]) == 0


def test_a_failed_commit_after_background_staging_raises(repo):
    repo.save({"w": torch.zeros(4)}, step=10)
    f = repo.save({"w": torch.ones(512, 1024)}, step=5, blocking=False)
    with pytest.raises(ckvc.StepOrderError):
        f.result(timeout=60)
    assert f.staged()
    assert repo.steps() == [10]


def test_an_unknown_staging_mode_is_refused(repo):
    with pytest.raises(ValueError):
        repo.save({"w": torch.zeros(4)}, step=1, blocking=False, staging="later")


def test_torch_compiled_model_compiles_once_more_not_once_per_background_save(repo):
    """Bug: Dynamo traced the guard's ``__torch_function__`` and guarded the
    compiled code on its state, so every background save (a new guard)
    recompiled the model, until Dynamo's recompile limit (8) sent it back
    to eager mode for the rest of the run. Now the guard is one more
    variant of the stack, compiled once; the stored states are still the
    ones at the calls."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, opt = model_and_opt()
    cmodel = torch.compile(model, backend=backend)

    def step():
        cmodel(torch.randn(16, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    first = len(graphs)
    assert first > 0
    for i in range(12):
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        at_call = snapshot(state)
        f = repo.save(state, step=i, blocking=False)
        step()  # compiled forward with the guard on the stack
        assert f.result(timeout=60).step == i
        assert_same(repo.load(i), at_call)
    assert len(graphs) <= 2 * first, f"{len(graphs)} graphs compiled for {first} at first"
    torch._dynamo.reset()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE and /proc are Linux's")
def test_the_staging_buffer_is_faulted_in_once_before_the_first_copy():
    n = 64 << 20
    host = _state.HostBuffer(n)
    before = _rss()
    host.populate()
    grown = _rss() - before
    assert host.populated
    assert grown >= n * 0.9, f"RSS grew {grown} bytes for a {n}-byte buffer"
    host.array[:] = 7
    host.populate()  # a no-op the second time: the contents stay
    assert int(host.array[::4096].min()) == 7


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE and /proc are Linux's")
def test_a_paced_fault_in_sleeps_between_pieces_and_faults_in_every_page(monkeypatch):
    # The staging buffer's fault-in after a first save slowed the optimizer
    # step beside it even at nice +10: it sleeps (1/duty - 1) times as long
    # as each piece took, between pieces.
    monkeypatch.setattr(_state, "POPULATE_PIECE", 4 << 20)
    slept = []
    real_sleep = _state.time.sleep
    me = threading.get_ident()

    def sleep(s):
        # time.sleep is the process's: only this thread's calls are the
        # fault-in's (a daemon thread of an earlier test may sleep too)
        if threading.get_ident() == me:
            slept.append(s)
        else:
            real_sleep(s)

    monkeypatch.setattr(_state.time, "sleep", sleep)
    n = 18 << 20  # five pieces, the last one short
    host = _state.HostBuffer(n)
    before = _rss()
    host.populate(duty=0.25)
    grown = _rss() - before
    assert grown >= n * 0.9, f"RSS grew {grown} bytes for a {n}-byte buffer"
    assert len(slept) == 4  # none after the last piece
    assert all(s > 0 for s in slept)
    slept.clear()
    _state.HostBuffer(n).populate()  # unpaced by default
    assert slept == []


def test_a_staging_buffer_is_warm_once_its_warming_thread_is_started(monkeypatch):
    # The bug: `warm_for` said no until the warming thread had run far
    # enough to mark the buffer populated, so a save right after a first
    # one took the first save's path again (and a test asserting
    # `warm_for` right after `warm` could fail).
    go = threading.Event()
    monkeypatch.setattr(_state._ckvc, "lower_priority", lambda n: go.wait(60))
    staging = _state.Staging()
    try:
        staging.warm(1 << 20)
        assert staging.warm_for(1 << 20)  # the thread waits at its start
        assert not staging.host.populated
        assert not staging.warm_for(2 << 20)  # too small still
    finally:
        go.set()


def test_the_first_background_save_reads_in_place_then_warms_the_staging_buffer(tmp_path, monkeypatch, loop_leaves):
    # A first background save cannot copy the whole state into fresh
    # staging memory beside its commit's (more than one copy of the state):
    # it commits the tensors where they are while a thread copies them from
    # the back (optimizer.step() waits until the two meet), and the rest of
    # the staging buffer is faulted in after it is durable.
    import os

    warmed = threading.Event()
    nice = {}
    populate = _state.HostBuffer.populate

    def watched_populate(self, duty=1.0):
        tid = threading.get_native_id()
        nice["warm"] = os.getpriority(os.PRIO_PROCESS, tid)
        nice["duty"] = duty
        populate(self, duty)
        warmed.set()

    monkeypatch.setattr(_state.HostBuffer, "populate", watched_populate)
    check_versions = _state.check_versions

    def watched_check(watched):
        nice["commit"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        check_versions(watched)

    monkeypatch.setattr(_state, "check_versions", watched_check)
    repo = ckvc.Repository.init(tmp_path / "repo")
    model, opt, state, want = trained()
    f = repo.save(state, step=1, blocking=False)
    # the buffer the copy from the back writes, not faulted in
    assert repo._staging.host is not None and not repo._staging.host.populated
    train_step(model, opt)  # waits for the commit in optimizer.step()
    assert f.staged()
    f.result(timeout=60)
    assert_same(repo.load(1), want)
    repo.wait()
    host = repo._staging.host
    assert host is not None and repo._staging.warm_for(len(host.array))
    # faulted in on a thread of its own, below the trainer's priority; the
    # commit read the tensors at the lowest priority (IN_PLACE_NICE)
    assert warmed.wait(60)
    trainer = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert nice["warm"] == min(19, trainer + 10)
    assert nice["duty"] == _state.WARM_DUTY < 1.0  # paced
    assert nice["commit"] == min(19, trainer + ckvc.IN_PLACE_NICE)
    # the next save copies into that buffer and leaves it in place
    want2 = snapshot(state)
    f = repo.save(state, step=2, blocking=False)
    train_step(model, opt)
    f.result(timeout=60)
    assert repo._staging.host is host
    assert_same(repo.load(2), want2)


def test_a_save_read_in_place_frees_the_tensors_before_the_commit_is_published(tmp_path, monkeypatch, loop_leaves):
    # The commit calls its check once it has read and stored every byte,
    # before publishing and its durability barrier: optimizer.step() waits
    # until then, not for the rest (with the CPU busy, the rest was part of
    # the first save's stall).
    seen = {}
    real = _state._ckvc.commit_buffers

    def watched(*args, **kwargs):
        d = real(*args, **kwargs)
        seen["staged when it returned"] = repo._inflight[1].staged()
        return d

    monkeypatch.setattr(_state._ckvc, "commit_buffers", watched)
    repo = ckvc.Repository.init(tmp_path / "repo")
    model, opt, state, want = trained()
    f = repo.save(state, step=1, blocking=False)
    assert not repo._staging.warm_for(1)  # read in place
    f.result(timeout=60)
    assert seen == {"staged when it returned": True}
    assert_same(repo.load(1), want)


@pytest.fixture
def loop_leaves(monkeypatch):
    """Sets the cores the training loop is taken to leave free (what
    ``_loop_free_cores`` measured over its last step) to ``loop_leaves(n)``;
    the steps the tests run themselves would set it by chance."""

    def leave(n):
        monkeypatch.setattr(ckvc, "_loop_free_cores", lambda: n)

    leave(None)
    return leave


def test_the_cores_a_loop_leaves_free_are_measured_over_its_last_step(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(ckvc, "_step_clock", ckvc.collections.deque(maxlen=2))
    assert ckvc._loop_free_cores() is None
    ckvc.Repository.init(tmp_path / "repo")  # watches the steps
    model, opt = model_and_opt()
    before = time.monotonic()
    train_step(model, opt)
    assert ckvc._loop_free_cores() is None  # one step start seen
    train_step(model, opt)
    (w0, _), (w1, _) = ckvc._step_clock
    assert before <= w0 < w1 <= time.monotonic()
    cores = len(os.sched_getaffinity(0))
    ckvc._step_clock.clear()
    ckvc._step_clock.extend([(10.0, 5.0), (12.0, 8.5)])  # 1.75 CPU-s a second
    assert ckvc._loop_free_cores() == pytest.approx(cores - 1.75)


def test_a_first_background_save_beside_a_busy_loop_reads_the_whole_state_in_place(tmp_path, monkeypatch, loop_leaves):
    # A loop that keeps the cores busy leaves none to a copy from the back
    # nor to the rest of the commit: the step waits for the whole commit.
    loop_leaves(ckvc.MIRROR_MIN_FREE_CORES / 2)
    seen = {}
    real = _state._ckvc.commit_buffers

    def watched(*args, **kwargs):
        seen["mirror"] = kwargs["mirror"]
        return real(*args, **kwargs)

    monkeypatch.setattr(_state._ckvc, "commit_buffers", watched)
    repo = ckvc.Repository.init(tmp_path / "repo")
    model, opt, state, want = trained()
    f = repo.save(state, step=1, blocking=False)
    assert repo._staging.host is None  # no copy, no buffer yet
    train_step(model, opt)  # waits for the commit in optimizer.step()
    f.result(timeout=60)
    assert seen == {"mirror": None}
    assert_same(repo.load(1), want)
    repo.wait()
    assert repo._staging.host is not None  # faulted in for the next save


def test_a_first_background_save_copies_from_the_back_while_its_commit_reads_from_the_front(tmp_path, monkeypatch, loop_leaves):
    # The commit's reading is held (its pause) from its start: the copy
    # from the back alone fills the staging buffer, the save is not staged
    # meanwhile, and it is as soon as the commit reads again (every tensor
    # is the copy's then). Tensors changed from then on, while the commit
    # still codes, are stored as they were at the call.
    repo = ckvc.Repository.init(tmp_path / "repo")
    model, opt, state, want = trained()
    p = _state.plan(state)
    file_bytes = b"".join(bytes(memoryview(x).cast("B")) for x in _state.in_place_parts(p))
    seen = {}
    real = _state._ckvc.commit_buffers

    def held(*args, **kwargs):
        pause = kwargs["pause"]
        pause.hold(60.0)

        def watch():
            host = repo._staging.host
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if bytes(host.array[: len(file_bytes)]) == file_bytes:
                    seen["filled"] = True
                    seen["staged when filled"] = repo._inflight[1].staged()
                    break
                time.sleep(0.01)
            pause.clear()

        threading.Thread(target=watch).start()
        return real(*args, **kwargs)

    monkeypatch.setattr(_state._ckvc, "commit_buffers", held)
    f = repo.save(state, step=1, blocking=False)
    f.wait_staged(60)
    with torch.no_grad():
        for t in model.parameters():
            t.add_(1.0)
    f.result(timeout=60)
    assert seen == {"filled": True, "staged when filled": False}
    assert_same(repo.load(1), want)


def test_a_first_save_of_tensors_that_cannot_be_read_in_place_copies_them_in_the_background(tmp_path, gate):
    # A strided (or accelerator) tensor would have to be copied in the call
    # to be read in place: such a first save stages as later ones do.
    repo = ckvc.Repository.init(tmp_path / "repo")
    w = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024).t()  # 2 MiB, strided
    f = repo.save({"w": w}, step=1, blocking=False)
    assert repo._staging.host is not None  # the staging buffer took it
    assert not f.staged()  # copied after the call, held by the gate
    gate.set()
    f.result(timeout=60)
    assert torch.equal(repo.load(1)["w"], w)
