"""Bugs a review of the package found in saves of torch states, each pinned
by the case that showed it (the others: test_review_fixes.py)."""

import collections
import contextlib
import enum
import os
import threading

import pytest

torch = pytest.importorskip("torch")

import ckvc  # noqa: E402
from ckvc import _ckvc  # noqa: E402


def _one_element_strided():
    return {
        "col": torch.randn(1, 8)[:, 0],  # shape (1,), stride (8,)
        "every_other": torch.randn(2)[::2],  # shape (1,), stride (2,)
        "neg_view": torch.tensor([1 + 2j]).conj().imag,  # lazy negative view
        "c128": torch.randn(2, dtype=torch.complex128)[::2],
        "square": torch.randn(1, 8)[:, :1].t(),  # shape (1, 1), stride (1, 8)
    }


@pytest.mark.parametrize("blocking", [True, False])
def test_a_one_element_strided_tensor_round_trips(repo, blocking):
    # A view with one element whose stride is not 1 (a column of a 1-row
    # matrix, x[::2] of a 2-vector) is "contiguous" to torch, but
    # reshape(-1).view(torch.uint8) refuses it: every save mode raised
    # RuntimeError("self.stride(-1) must be 1 to view Float as Byte").
    state = _one_element_strided()
    for step in (1, 2):  # a first background save reads in place, a second stages
        r = repo.save(state, step=step, blocking=blocking)
        if not blocking:
            r.result()
        out = repo.load(step)
        for k, v in state.items():
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(out[k], v.resolve_neg()), k


def test_a_background_save_inside_a_users_torch_function_mode_leaves_that_mode_to_its_with_block(repo):
    # The staging guard was pushed on top of the thread's torch function
    # stack; the user's mode, entered before the save, then popped the guard
    # at the end of its with block (TorchFunctionMode.__exit__ pops the top)
    # and stayed active for the rest of the process.
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    big = torch.randn(1 << 19)
    repo.save({"w": big}, step=1, blocking=False).result()  # the next one stages
    depth = torch._C._len_torch_function_stack()
    with Counting():
        fut = repo.save({"w": big}, step=2, blocking=False)
    fut.result()
    repo.wait()
    Counting.calls = 0
    torch.ones(2) + 1
    assert Counting.calls == 0, "the user's mode is still active after its with block"
    assert torch._C._len_torch_function_stack() == depth
    # `with torch.device(...)` pops the top mode too: its DeviceContext
    # stayed on the stack (the default device for the rest of the run).
    with torch.device("cpu"):
        fut = repo.save({"w": big}, step=3, blocking=False)
    fut.result()
    repo.wait()
    assert torch._C._len_torch_function_stack() == depth


@contextlib.contextmanager
def _commits_held(monkeypatch, seconds=0.5):
    """Background commits wait `seconds` before they start (at most 30 s
    if the body fails first): a save stays in flight meanwhile."""
    gate = threading.Event()
    real = _ckvc.commit_buffers

    def slow(*a, **k):
        gate.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(_ckvc, "commit_buffers", slow)
    timer = threading.Timer(seconds, gate.set)
    timer.start()
    try:
        yield
    finally:
        gate.set()
        timer.join()


def test_load_and_steps_right_after_a_background_save_see_that_save(repo, monkeypatch):
    # load/open/steps/log only waited for the staging copy, not the commit:
    # right after save(step=2, blocking=False), load("main") silently gave
    # step 1's state, steps() lacked 2 and load(2) raised NotFoundError.
    repo.save({"w": torch.zeros(4)}, step=1)
    with _commits_held(monkeypatch):
        repo.save({"w": torch.ones(4)}, step=2, blocking=False)
        assert torch.equal(repo.load("main")["w"], torch.ones(4))
        assert repo.steps() == [1, 2]
        assert torch.equal(repo.load(2)["w"], torch.ones(4))
        repo.wait()


NT = collections.namedtuple("NT", "a b")


class Color(enum.IntEnum):
    RED = 1


class Mode(str, enum.Enum):
    TRAIN = "train"


@pytest.mark.parametrize(
    "value",
    [
        NT(1, 2),
        collections.defaultdict(list, a=[1]),
        torch.Size([2, 3]),
        Color.RED,
        Mode.TRAIN,
        {Mode.TRAIN: 1},
    ],
    ids=["namedtuple", "defaultdict", "torch.Size", "IntEnum", "str-Enum", "str-Enum-key"],
)
def test_a_subclass_of_a_container_or_scalar_is_refused_not_silently_converted(repo, value):
    # A namedtuple came back as a tuple, a defaultdict as a dict, torch.Size
    # as a tuple, an IntEnum as an int: the load gave another type than the
    # save was given, silently.
    with pytest.raises(TypeError):
        repo.save({"x": value}, step=1)
    assert repo.steps() == []


def test_a_non_finite_metric_of_a_background_save_is_refused_in_the_call(repo):
    # The library refuses NaN/inf metrics; a background save only found out
    # in its thread, so the save was lost and its error was raised by the
    # *next* save (which then did not save either).
    with pytest.raises(ckvc.InvalidInputError):
        repo.save({"x": torch.ones(2)}, step=1, metrics={"loss": float("nan")}, blocking=False)
    repo.save({"x": torch.ones(2)}, step=2, metrics={"loss": 1.0}, blocking=False)
    repo.wait()
    assert repo.steps() == [2]


def _prune_beside_a_rotation(tmp_path, monkeypatch, files, holds_dir):
    """A committed checkpoint-1 holding `files` and a keep_local=0
    callback whose Reader's holds_dir is `holds_dir(reader, cid, dir)`
    (the Trainer's rotation acting meanwhile); prunes, returns the dir."""
    pytest.importorskip("transformers")
    import ckvc.integrations.transformers as integ

    repo_path = tmp_path / "repo"
    ckvc.Repository.init(repo_path)
    d = tmp_path / "run" / "checkpoint-1"
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(os.urandom(1 << 16))
    cid = _ckvc.commit_dir(str(repo_path), str(d), 1)["id"]
    real = _ckvc.Reader

    class Reader:
        def __init__(self, path):
            self.r = real(path)

        def holds_dir(self, cid, dirpath):
            return holds_dir(self.r, cid, dirpath)

    class Rotating:
        commit_dir = staticmethod(_ckvc.commit_dir)

    Rotating.Reader = Reader
    monkeypatch.setattr(integ, "_ckvc", Rotating)
    cb = integ.CkvcCallback(str(repo_path), keep_local=0)
    cb.committed.append((1, cid, str(d)))
    cb._prune()  # must not raise
    return d


def test_keep_local_tolerates_a_checkpoint_the_trainer_deleted_meanwhile(tmp_path, monkeypatch):
    # keep_local's prune runs in the commit thread while the Trainer's own
    # save_total_limit rotation runs in the main thread: a directory deleted
    # by the Trainer during holds_dir (or between it and rmtree) made the
    # prune raise, and on_train_end failed the whole training run.
    import shutil

    def rotated(reader, cid, dirpath):
        shutil.rmtree(dirpath)  # the Trainer rotates it away meanwhile
        return reader.holds_dir(cid, dirpath)

    d = _prune_beside_a_rotation(tmp_path, monkeypatch, ["model.bin"], rotated)
    assert not d.exists()


def test_commit_dir_waits_for_the_background_save_in_flight(repo, tmp_path, monkeypatch):
    # commit_dir ran beside this object's background save: whichever took
    # the write lock first won, the other failed (LockedError "by another
    # ckvc process", or the earlier step's save a StepOrderError).
    d = tmp_path / "ck"
    d.mkdir()
    (d / "a.bin").write_bytes(b"x" * 1000)
    with _commits_held(monkeypatch):
        fut = repo.save({"w": torch.ones(4)}, step=1, blocking=False)
        repo.commit_dir(d, step=2)
        assert fut.result().step == 1
    assert repo.steps() == [1, 2]


def test_keep_local_tolerates_a_trainer_rotation_still_in_progress(tmp_path, monkeypatch):
    # The Trainer's rmtree of the same directory is still running when
    # holds_dir reads it: one of its files is gone, the directory is not
    # (yet). The prune raised (os.path.lexists(d) was still true) and
    # on_train_end failed the training run.
    def half_rotated(reader, cid, dirpath):
        # the Trainer's rmtree, half way through
        os.unlink(os.path.join(dirpath, "b.bin"))
        # what holds_dir raises when a file vanishes under its read
        raise FileNotFoundError(2, "No such file or directory", os.path.join(dirpath, "b.bin"))

    _prune_beside_a_rotation(tmp_path, monkeypatch, ["a.bin", "b.bin"], half_rotated)
