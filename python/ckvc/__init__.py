"""ckvc from Python: save, load and resume training checkpoints in a ckvc
repository, from inside the training loop.

The same repository the ``ckvc`` command line uses; the work is done by the
Rust library (the native module ``ckvc._ckvc``), with the GIL released.

>>> import ckvc
>>> repo = ckvc.Repository.init("run1")
>>> f = repo.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=100, blocking=False)
>>> # ... training goes on (the large tensors are copied in the background;
>>> # optimizer.step() waits for that copy); the state saved is the one at
>>> # the call ...
>>> repo.wait()
>>> state = repo.load(100)

A Python-saved commit holds two files, ``state.json`` (the structure) and
``tensors.safetensors`` (the tensors); see ``docs/format/python-state.md``.
Nothing is ever pickled.
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from . import _ckvc, _state
from ._ckvc import (
    AlreadyExistsError,
    CkvcError,
    CorruptError,
    InvalidInputError,
    LockedError,
    NotFoundError,
    StepOrderError,
    StorageFullError,
)
from ._state import TensorModifiedError

__all__ = [
    "Repository",
    "Commit",
    "SaveFuture",
    "Checkpoint",
    "CkvcError",
    "CorruptError",
    "LockedError",
    "NotFoundError",
    "StepOrderError",
    "AlreadyExistsError",
    "InvalidInputError",
    "StorageFullError",
    "TensorModifiedError",
]

Rev = Union[int, str]

#: How much lower than the trainer's the priority (nice value) of a
#: background save's commit is, once its tensors are staged: on a machine
#: whose cores also run the forward and backward pass, the training step
#: comes first and the commit takes the time it leaves.
BACKGROUND_NICE = 10

#: The same for a first background save that reads the tensors in place:
#: the lowest priority (its copy from the back too). The next
#: ``optimizer.step()`` waits until the commit and the copy have read the
#: tensors, and then they have the cores to themselves; before, the forward and
#: backward pass runs undisturbed. With both on the same two cores
#: (``scripts/bench_python.py --compute cpu``, five alternating pairs of
#: runs) the loop lost 1.19-1.58 s at nice 19 against 1.60-2.77 s at the
#: trainer's priority (1.19-1.42 s for a blocking save); with the cores
#: free while the accelerator computes (``--compute idle``) it runs as
#: fast at either.
IN_PLACE_NICE = 19

#: Background commits wait while an ``optimizer.step()`` runs (once the
#: step may change the tensors: after any copy or in-place read it waits
#: for), and go on when it returns: the step's threads meet at barriers
#: and stream the whole state through memory, and a commit beside them on
#: the same cores slows them more than the CPU it takes. A step that
#: raises before it returns holds them at most this many seconds (or
#: until the next ``save``/``wait``/``result``); 0 turns the pause off.
STEP_PAUSE_LIMIT = 10.0

#: The most of a background save's time (since its call) that steps may
#: hold its commit: a loop of back-to-back optimizer steps would otherwise
#: let it on only between them. A step that would take it past this share
#: runs beside the commit.
STEP_PAUSE_SHARE = 0.5


#: A first background save copies its tensors from the back while its
#: commit reads them from the front (see ``Repository.save``) only when the
#: training loop leaves at least this many cores free, as measured over its
#: last full step (``_loop_free_cores``); on a loop that keeps the cores
#: busy, the copy and the rest of the commit cannot run beside it, and the
#: step waits for the whole commit instead. ``scripts/bench_python.py
#: --compute cpu`` (a loop using 1.96 of the 2 cores): copying from the back
#: stalled the loop 7.8-12.4 s (1.55-2.43x ``torch.save`` + fsync) and was
#: durable in 32-45 s (6.4-8.8x), its commit crawling beside the loop at
#: nice 19 for 17-23 steps (at nice 10: 10.5 s, 13.2 s); the step waiting
#: for the whole commit, 9.3 s and 8.2 s (1.66x, 1.45x; in a later run with
#: this rule, 10.8 s and 8.3 s, 1.76x and 1.35x). With the loop's
#: forward/backward off the CPU (``--compute idle``, 1.5 cores free) the
#: copy stalled it 1.7-6x less, pair by pair (``Repository.save``).
MIRROR_MIN_FREE_CORES = 1.0

# The wall clock and this process's CPU time at the last two optimizer
# steps' starts (``_watch_steps``).
_step_clock: "collections.deque[Tuple[float, float]]" = collections.deque(maxlen=2)
_steps_watched = False


def _watch_steps() -> None:
    """Install (once, when torch is there) an optimizer step pre-hook
    that records the clocks at each step's start, for
    ``_loop_free_cores``."""
    global _steps_watched
    with _hooks_lock:
        if _steps_watched or not _state._TORCH:
            return
        _steps_watched = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def record(optimizer: Any, args: Any, kwargs: Any) -> None:
        _step_clock.append((time.monotonic(), time.process_time()))

    register_optimizer_step_pre_hook(record)


def _loop_free_cores() -> Optional[float]:
    """The cores the training loop left free over its last full step
    (between the starts of its last two optimizer steps: the cores this
    process may use less the CPU time it took per second meanwhile), or
    None before two steps were seen."""
    clocks = list(_step_clock)
    if len(clocks) < 2:
        return None
    (w0, c0), (w1, c1) = clocks
    if w1 <= w0:
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores - (c1 - c0) / (w1 - w0)


def _check_step(step: Any) -> None:
    """A step is an int from 0 to 2**64 - 1 (the library's u64):
    TypeError for another type or a negative one (as before), ValueError
    past the top (the binding's OverflowError before)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError("step must be a non-negative int")
    if step >= 1 << 64:
        raise ValueError(f"step {step} is past the largest step, 2**64 - 1")


def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` on a thread of its own, joined: its result, or its
    exception raised here. For a call that lowers the priority of its
    thread when the caller's must stay as it is."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass(frozen=True)
class Commit:
    """A commit: ``id`` (64 hex digits), ``step``, ``message``, ``metrics``,
    ``logical_bytes`` (the checkpoint's size), ``stored_bytes`` (what it
    added to the repository), ``time`` (seconds since the epoch),
    ``branch``."""

    id: str
    step: int
    message: str = ""
    metrics: Dict[str, Any] = field(default_factory=dict)
    logical_bytes: int = 0
    stored_bytes: int = 0
    time: int = 0
    branch: str = ""

    @staticmethod
    def _from(d: Dict[str, Any]) -> "Commit":
        return Commit(
            id=d["id"],
            step=int(d["step"]),
            message=d["message"],
            metrics=json.loads(d["metrics_json"]),
            logical_bytes=int(d["logical_bytes"]),
            stored_bytes=int(d["stored_bytes"]),
            time=int(d["time"]),
            branch=d["branch"],
        )


class SaveFuture:
    """A save running in the background (from ``save(blocking=False)``).

    Two stages: *staged* (every tensor copied into the staging buffer, or,
    for a save that reads them in place, read and stored: the tensors may
    be changed in place from then on) and *done* (durable, or failed)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._staged = threading.Event()
        self._commit: Optional[Commit] = None
        self._error: Optional[BaseException] = None
        self._observed = False
        # When the save was made, and how long optimizer steps have held
        # its commit since (``STEP_PAUSE_SHARE``).
        self._started = time.monotonic()
        self._held = 0.0

    def _finish(self, commit: Optional[Commit], error: Optional[BaseException]) -> None:
        self._commit, self._error = commit, error
        self._event.set()
        with _hooks_lock:
            _background.discard(self)

    def done(self) -> bool:
        """True once the save is durable or has failed."""
        return self._event.is_set()

    def staged(self) -> bool:
        """True once every tensor of the save has been copied (read, for a
        save that reads them in place), or the save has failed: from then
        on the tensors may be changed in place."""
        return self._staged.is_set()

    def wait_staged(self, timeout: Optional[float] = None) -> None:
        """Wait until every tensor of the save has been copied (or read in
        place; not until it is durable: that is ``result()``). Call it before changing saved
        tensors in place outside ``optimizer.step()`` (which waits by
        itself). A failed save does not raise here but on ``result()``
        (``TimeoutError`` after ``timeout`` s)."""
        if not self._staged.wait(timeout):
            raise TimeoutError("the save is still copying its tensors")
        _remove_finished_hooks()

    def result(self, timeout: Optional[float] = None) -> Commit:
        """Wait until the save is durable and return its ``Commit``; raise
        its error if it failed (``TimeoutError`` after ``timeout`` s)."""
        _release_pause()
        if not self._event.wait(timeout):
            raise TimeoutError("the save is still running")
        _remove_finished_hooks()
        self._observed = True
        if self._error is not None:
            raise self._error
        assert self._commit is not None
        return self._commit


def _rev(rev: Rev) -> str:
    if isinstance(rev, bool):
        raise TypeError("a revision is a step (int) or a name (str)")
    if isinstance(rev, int):
        if rev < 0:
            raise ValueError("a step is not negative")
        return str(rev)
    if isinstance(rev, str):
        return rev
    raise TypeError("a revision is a step (int) or a name (str)")


# Optimizer step pre-hooks of background stagings: (handle, future). While a
# save's tensors are being copied in the background, every
# ``optimizer.step()`` first waits for the copy (the step is what changes
# parameters and optimizer state in place). A hook is removed after its
# staging has finished, by the next ``save``/``load``/``wait``/``result``/
# ``wait_staged`` call of the thread that made the save (the training loop),
# not by the staging thread: torch iterates its live dict of global hooks
# while it calls them, and removing one from another thread during an
# ``optimizer.step()`` would make that step raise ("OrderedDict mutated
# during iteration"). Until then a finished hook returns at once.
_hooks: List[Tuple[Any, "SaveFuture", int]] = []
_hooks_lock = threading.Lock()


def _add_step_hook(fut: "SaveFuture") -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def wait_for_staging(optimizer: Any, args: Any, kwargs: Any) -> None:
        fut._staged.wait()
        # (Hooks cannot be removed here: torch is iterating over them.)
        _pop_finished_guards()

    with _hooks_lock:
        handle = register_optimizer_step_pre_hook(wait_for_staging)
        _hooks.append((handle, fut, threading.get_ident()))


# The pause of this process's background commits (``_ckvc.Pause``), held
# for each optimizer step by global step hooks installed with it (on the
# first background save, when torch is there), and the background saves
# not yet done, whose copies or in-place reads a step waits for before it
# holds the pause.
_pause: Optional["_ckvc.Pause"] = None
_background: "set[SaveFuture]" = set()
_step_held = threading.local()


def _may_hold(running: "List[SaveFuture]", now: float) -> bool:
    """True when no save of ``running`` has been held for more than
    ``STEP_PAUSE_SHARE`` of its time so far."""
    return all(f._held <= STEP_PAUSE_SHARE * (now - f._started) for f in running)


def _step_pause() -> "_ckvc.Pause":
    global _pause
    with _hooks_lock:
        if _pause is not None:
            return _pause
        _pause = pause = _ckvc.Pause()
    if not _state._TORCH:
        return pause
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def hold(optimizer: Any, args: Any, kwargs: Any) -> None:
        limit = STEP_PAUSE_LIMIT
        if not limit > 0:  # 0 (or NaN) turns the pause off
            return
        with _hooks_lock:
            running = [f for f in _background if not f.done()]
        if not running:
            return
        # A commit still reading the tensors in place must not be held
        # while the step waits for it (nor a copy, which is not a commit's).
        for f in running:
            f._staged.wait()
        now = time.monotonic()
        if not _may_hold(running, now):
            return
        pause.hold(limit)
        _holds().append((now, running))

    def resume(optimizer: Any, args: Any, kwargs: Any) -> None:
        holds = _holds()
        if holds:
            since, running = holds.pop()
            held = time.monotonic() - since
            for f in running:
                f._held += held
            pause.resume()

    register_optimizer_step_pre_hook(hold)
    register_optimizer_step_post_hook(resume)
    return pause


def _holds() -> "List[Tuple[float, List[SaveFuture]]]":
    """This thread's holds not yet resumed: when each began and the saves
    it held (a step inside a step holds twice)."""
    if not hasattr(_step_held, "holds"):
        _step_held.holds = []
    return _step_held.holds


def _abandon(fut: "SaveFuture", error: BaseException) -> None:
    """A save that fails before its thread runs: no thread will end the
    staging its step hook and guard wait for, so end it here, and finish
    the save with ``error``, which its caller raises now (marked seen: not
    again on ``wait()``)."""
    fut._staged.set()
    fut._finish(None, error)
    fut._observed = True


def _release_pause() -> None:
    """End every hold: the caller waits for the commits itself."""
    if _pause is not None:
        _pause.clear()
        _holds().clear()


# Guards of background stagings (``_guard.StagingGuard``: an in-place change
# of a tensor still to copy waits for the copy), pushed on the saving
# thread's torch function stack: (guard, owner thread). Popped by that thread
# once the staging is done (torch function modes are per thread).
_guards: List[Tuple[Any, int]] = []


def _add_guard(fut: "SaveFuture", deferred: List[Any]) -> None:
    from ._guard import StagingGuard, storage_ptr

    ptrs = {storage_ptr(leaf.obj) for leaf, _, clone in deferred if clone is None} - {0}
    guard = StagingGuard(ptrs, fut._staged)
    guard.enter_below()
    with _hooks_lock:
        _guards.append((guard, threading.get_ident()))


def _pop_finished_guards() -> None:
    """Remove this thread's guards whose staging is done from its torch
    function stack."""
    me = threading.get_ident()
    with _hooks_lock:
        for i in range(len(_guards) - 1, -1, -1):
            guard, owner = _guards[i]
            if owner == me and guard.staged.is_set():
                guard.remove()
                del _guards[i]


def _remove_finished_hooks() -> None:
    """Remove the hooks and guards of finished stagings this thread's saves
    added."""
    me = threading.get_ident()
    with _hooks_lock:
        keep = []
        for handle, fut, owner in _hooks:
            if owner == me and fut._staged.is_set():
                handle.remove()
            else:
                keep.append((handle, fut, owner))
        _hooks[:] = keep
    _pop_finished_guards()


# Repositories with a save in flight or a failed save nobody has seen: held
# strongly (from save() until wait() drains them), so an error cannot vanish
# with a garbage-collected Repository; the only ones exit must look at.
_pending: "set[Repository]" = set()
_pending_lock = threading.Lock()


def _raise_all(errors: List[BaseException]) -> None:
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise BaseExceptionGroup(f"{len(errors)} background saves failed", errors)


def _wait_all_at_exit() -> None:
    """At interpreter exit: wait for every save in flight; a failed save
    nobody observed is printed and makes the process exit with status 1
    (an exception in an atexit handler would only be printed, and the job
    would look successful)."""
    errors: List[BaseException] = []
    with _pending_lock:
        repos = list(_pending)
    for repo in repos:
        errors.extend(repo._drain())
    if errors:
        import sys

        for e in errors:
            print(f"ckvc: a background save failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_wait_all_at_exit)


class Repository:
    """A ckvc repository (the directory holding ``.ckvc``).

    ``Repository(path)`` opens an existing one, ``Repository.init(path)``
    creates one. No lock is held between calls: the command line may
    commit while this object exists; each save takes the write lock only
    while it commits. Opening a repository raises the process's soft limit
    on open files to its hard limit (the store keeps the blob files it has
    read open, about one per 32 MiB of chunks).

    ``keep_bases`` says how much of what a save stored this object keeps
    in memory as the next save's delta bases. A save is coded against the
    tensors of the save before where they are kept; where they are not, it
    is coded against the keyframe their chain started from (one record
    decoded from the store, not the save before's chain of up to
    ``max_chain`` deltas; the delta against that older tensor is a little
    larger, 3-13% a save on GPT-2 small + AdamW):

    - ``None`` (the default): the bases and the commit's own buffers hold
      at most one copy of the state beside the staging buffer: a blocking
      save keeps what it stored; a ``blocking=False`` save, whose staging
      buffer already is a copy, keeps only the memory budget's share (an
      eighth of it) and codes the rest against their keyframe;
    - ``True``: up to one copy of the state whatever the saves (beside a
      staging buffer: two copies), so every save is coded against the save
      before, but for the one after a first background save (that save
      reads its tensors in place, and copying them would lengthen
      ``optimizer.step()``'s wait);
    - ``False``: the memory budget's share.

    The bases are freed with this object.
    """

    def __init__(
        self, path: Union[str, os.PathLike], branch: Optional[str] = None, keep_bases: Optional[bool] = None
    ) -> None:
        self.path = os.fspath(path)
        self.branch = branch
        _ckvc.Reader(self.path)  # raises NotFoundError if not a repository
        self._lock = threading.Lock()
        self._inflight: Optional[Tuple[threading.Thread, SaveFuture]] = None
        self._unobserved: List[SaveFuture] = []
        self._staging = _state.Staging()
        self._keep_bases = keep_bases
        self._bases = _ckvc.Bases()
        # how busy the loop keeps the cores, for a first background save
        _watch_steps()

    def _bases_cap(self, state_bytes: int, blocking: bool, in_place: bool = False) -> int:
        """Bytes of delta bases a save of ``state_bytes`` may keep (see
        ``keep_bases``); at least the budget's share, which the store
        side adds. A background save that reads its tensors in place keeps
        only the share: it fills the staging buffer as it commits, and
        copying the bases would lengthen the wait of ``optimizer.step()``
        (3.6 s against 1.2 s for a first save of GPT-2 small + AdamW with
        ``keep_bases=True``, when it read the whole state in place)."""
        if self._keep_bases is False or in_place:
            return 0
        if self._keep_bases is True:
            return state_bytes
        held = self._staging.host.array.nbytes if self._staging.host is not None else 0
        if not blocking:
            held = max(held, state_bytes)
        return max(0, state_bytes - held)

    @classmethod
    def init(
        cls, path: Union[str, os.PathLike], row_frames: bool = True, keep_bases: Optional[bool] = None
    ) -> "Repository":
        """Create a repository in ``path`` (like ``ckvc init``) and open it.

        ``row_frames=False`` (``ckvc init --no-row-frames``) stores whole
        chunks of alike rows (Adam's moments of an embedding) as plain
        frames: a first save of GPT-2 small + AdamW then takes about a
        tenth less CPU and stores about 1.5% more. ``keep_bases`` as for
        ``Repository``.
        """
        p = os.fspath(path)
        # The library makes the directories (a file in the way is an
        # InvalidInputError, not Python's FileExistsError).
        _ckvc.init(p, row_frames)
        return cls(p, keep_bases=keep_bases)

    def _reader(self) -> "_ckvc.Reader":
        return _ckvc.Reader(self.path)

    # ------------------------------------------------------------ saving

    def save(
        self,
        state: Any,
        step: int,
        message: str = "",
        metrics: Optional[Dict[str, float]] = None,
        blocking: bool = True,
        staging: str = "background",
    ) -> Union[Commit, SaveFuture]:
        """Commit ``state`` at ``step`` on the current branch.

        ``state`` is what training code has: nested dicts (str or int
        keys), lists, tuples, torch tensors (any dtype, views, shared
        storage), numpy arrays, and numbers, str, bytes, bool, None. The
        tensors are laid out as one safetensors file.

        ``blocking=True`` returns the ``Commit`` once it is durable. The
        tensors are read where they are (contiguous CPU tensors and arrays;
        others are made contiguous first), nothing is copied into a
        staging buffer: do not change them from another thread during the
        call, as with ``torch.save``.
        ``blocking=False`` returns a ``SaveFuture``; the commit runs in a
        background thread (the GIL released). At most one save is in
        flight: a new save first waits for the previous one. Errors surface
        on ``result()`` and ``wait()`` (and at interpreter exit), never
        silently. The tensors are copied into one reused host staging
        buffer laid out as the file, so the state stored is the one at the
        call. The commit waits while an ``optimizer.step()`` runs (once
        the step has waited for the copy) and goes on when it returns
        (``STEP_PAUSE_LIMIT``).

        The first background save of a ``Repository`` object (and one whose
        state has outgrown the buffer) does not copy the state before its
        commit starts when its large tensors are contiguous CPU tensors (a
        GPU trainer's are copied to the staging buffer as below): the whole
        staging buffer beside the commit's own memory would be more than one
        copy of the state. Its commit reads the tensors where they are, from
        the front of the file, while a thread copies them from the back into
        the staging buffer; where the two meet, the commit goes on from the
        buffer (unless the training loop keeps the cores busy:
        ``MIRROR_MIN_FREE_CORES``; then the commit reads the whole state in
        place and the step waits for it). The rules are those of a copy
        under ``"background"`` below,
        except that the wait lasts until the two have met (and the commit has
        copied out the last piece it read in place), and the version check
        runs then: a tensor changed from another thread meanwhile fails the
        save with ``TensorModifiedError`` and nothing is committed. The commit
        and the copy run at the lowest priority (``IN_PLACE_NICE``: the step
        waits for them, so they take the cores while it waits and leave them
        to a forward and backward pass that runs beside them). Once that save
        is durable the rest of the staging buffer is faulted in by a thread of
        its own (nice +10), paced to a quarter of its time
        (``_state.WARM_DUTY``: faulting in slowed the optimizer step beside it
        even at nice +10), for the next save.
        ``scripts/bench_python.py --compute idle`` (GPT-2 small + AdamW, 1.4
        GiB), charged with every step until durable, on one VM: reading the
        whole state in place stalled the loop 3.2-3.5 s (0.76-1.30x
        ``torch.save`` + fsync), peaked at 0.97-0.99 of the state's size in
        extra memory and was durable in 1.04-1.40x; a copy of the whole state
        in the background thread stalled it 0.8-1.6 s (0.21-0.44x), peaked at
        1.03-1.07x and was durable in 2.1-2.3x (its commit ran at nice +10
        beside the steps). Reading in place while a thread copies from the
        back (as now), four pairs of runs alternating with reading the whole
        state in place: the first step waited 0.42-1.51 s against 2.51-3.19
        s, the loop stalled 0.16-0.46x against 0.76-0.93x, durable in
        1.00-1.47x against 0.98-1.02x, peak extra memory 0.97-1.01x against
        0.91-1.02x.

        ``staging`` (with ``blocking=False``) says when the tensors are
        copied into the staging buffer:

        - ``"background"`` (the default): numpy arrays and torch tensors
          under 1 MiB (BatchNorm statistics, step counters) are copied in
          the call; larger torch tensors in the background thread, while
          the next forward and backward pass run (they only read
          parameters and optimizer state). Until that copy is done
          (``SaveFuture.staged()``), every ``optimizer.step()`` first waits
          for it, and so does any torch call of the saving thread that
          changes one of the tensors still to copy in place (``add_``,
          ``copy_``, ``w[i] = x``, ``out=``, ``.data = ``: a torch function
          mode on this thread, popped once the copy is done), and the next
          ``save``, ``load``, ``wait`` and ``result``: the state stored is
          the one at the call. Changes the guard cannot see (from another
          thread; through a numpy view of the tensor) before
          ``SaveFuture.wait_staged()`` returns are detected by the tensor's
          version counter (``tensor._version``, compared after its copy and
          again when all are copied) where torch counts them, and fail the
          save with ``TensorModifiedError`` on ``result()`` / ``wait()``
          (nothing is committed); an in-place operation still running on
          another thread at the instant the staging finishes is not (torch
          counts the change when the kernel ends), nor is a write through
          a numpy view. Code compiled by ``torch.compile`` runs as if
          there were no guard (so that saves do not recompile it): an
          in-place change it makes to a saved tensor is caught by the
          version counter, not waited for. Use ``"sync"`` for those, or
          with compiled regions that mutate saved tensors.
        - ``"sync"``: every tensor is copied in the call; the tensors may be
          changed in any way as soon as ``save`` returns.
        """
        _check_step(step)
        if staging not in ("background", "sync"):
            raise ValueError(f'staging must be "background" or "sync", not {staging!r}')
        mets = []
        for k, v in (metrics or {}).items():
            mets.append((str(k), float(v)))
            if not math.isfinite(mets[-1][1]):
                # what the library refuses, refused in the call: a background
                # save would only fail in its thread, and be lost
                raise InvalidInputError(f"metric {k}={v} is not a finite number")
        _remove_finished_hooks()
        with self._lock:
            self._wait_inflight()
            _remove_finished_hooks()
            # A failed save nobody looked at is reported now, before the next
            # one: a loop of blocking=False saves must not fail for hours
            # unnoticed.
            failed = self._take_unobserved()
            if failed:
                _raise_all(failed)
            p = _state.plan(state)
            background = not blocking and staging == "background" and _state._TORCH
            # The first background save (or one whose state outgrew the
            # staging buffer) reads its tensors in place while it commits,
            # when they are contiguous CPU tensors: see `save`'s docs.
            in_place = background and not self._staging.warm_for(p.file_len) and _state.readable_in_place(p)
            bases_cap = self._bases_cap(p.file_len, blocking, in_place)
            if self._bases.held_bytes() > bases_cap:
                # Let go of the bases before a staging buffer takes the
                # memory they held (the commit fills the budget's share
                # again).
                self._bases.clear()
            tensors: Any
            mirror: Optional[Tuple[str, memoryview]] = None
            if blocking:
                # Read in place while this call waits: no staging copy.
                tensors, deferred = _state.in_place_parts(p), []
            elif in_place:
                tensors, deferred = _state.in_place_background_parts(p)
                free = _loop_free_cores()
                if free is None or free >= MIRROR_MIN_FREE_CORES:
                    # The copy from the back goes to the staging buffer,
                    # allocated here and faulted in only where it writes.
                    host = self._staging._holding(p.file_len)
                    mirror = (_state.TENSORS_FILE, memoryview(host.array)[: p.file_len])
            else:
                tensors, deferred = self._staging.stage(p, background=background)
            fut = SaveFuture()
            # A background commit waits while an optimizer step runs.
            pause = _step_pause() if not blocking else None
            if any(clone is None for _, _, clone in deferred):
                try:
                    _add_step_hook(fut)
                    _add_guard(fut, deferred)
                except BaseException as e:
                    _abandon(fut, e)
                    raise
            else:
                # only clones left to put in place: the caller's tensors
                # may change already
                fut._staged.set()
            files = [(_state.STATE_FILE, p.state_json), (_state.TENSORS_FILE, tensors)]
            now_msg = message
            staging_buf = self._staging

            def work() -> None:
                try:
                    if deferred and not in_place:
                        try:
                            staging_buf.copy_deferred(p, deferred)
                        finally:
                            fut._staged.set()
                    check = None
                    if in_place:

                        def check() -> None:
                            # Called (on the mirror's copying thread) once
                            # the commit reads no more of the tensors in
                            # place, before it is published: unchanged
                            # tensors are free from here, so the next
                            # optimizer.step() need not wait for the rest
                            # (reading the staging buffer's copy, coding,
                            # publishing, the durability barrier).
                            _state.check_versions(deferred)
                            fut._staged.set()

                    # Reading in place, the next optimizer.step() waits until
                    # the commit and the copy meet: IN_PLACE_NICE, on a thread
                    # of its own (the commit leaves its thread at that nice
                    # value, and this one starts the staging buffer's
                    # fault-in at BACKGROUND_NICE afterwards).
                    nice = IN_PLACE_NICE if in_place else BACKGROUND_NICE

                    def commit() -> Dict[str, Any]:
                        return _ckvc.commit_buffers(
                            self.path,
                            files,
                            step,
                            now_msg,
                            mets,
                            self.branch,
                            nice=nice,
                            check=check,
                            bases=self._bases,
                            bases_cap=bases_cap,
                            pause=pause,
                            mirror=mirror,
                        )

                    try:
                        d = _in_thread(commit, f"ckvc-save-{step}-commit") if in_place else commit()
                    finally:
                        # read in place: free once the commit has read them
                        # all (set by `check` already, unless it failed
                        # before)
                        fut._staged.set()
                    fut._finish(self._commit(d["id"]), None)
                except BaseException as e:  # noqa: BLE001 - handed to the future
                    fut._finish(None, e)
                    return
                if in_place:
                    # durable: fault the staging buffer in for the next save
                    staging_buf.warm(p.file_len)

            t = threading.Thread(target=work, name=f"ckvc-save-{step}", daemon=True)
            self._inflight = (t, fut)
            self._unobserved.append(fut)
            with _pending_lock:
                _pending.add(self)
            try:
                t.start()
            except BaseException as e:
                self._inflight = None
                _abandon(fut, e)
                raise
            if pause is not None:
                # Only a save whose thread runs: a step waits for its
                # staging, which only that thread ends.
                with _hooks_lock:
                    if not fut.done():
                        _background.add(fut)
        if blocking:
            return fut.result()
        return fut

    def _wait_inflight(self) -> None:
        _release_pause()
        if self._inflight is not None:
            t, _ = self._inflight
            t.join()
            self._inflight = None

    def _take_unobserved(self) -> List[BaseException]:
        """The errors of finished saves whose ``result()`` nobody took
        (marked observed: each is reported once); forgets the rest."""
        errors = []
        keep = []
        for f in self._unobserved:
            if not f.done():
                keep.append(f)
            elif not f._observed and f._error is not None:
                f._observed = True
                errors.append(f._error)
        self._unobserved = keep
        return errors

    def _wait_saved(self) -> None:
        """Wait until the save in flight (if any) is durable or has failed,
        so that a read sees it (its error stays for ``result``/``wait``)."""
        inflight = self._inflight
        if inflight is not None:
            _release_pause()
            inflight[1]._event.wait()
        _remove_finished_hooks()

    def _drain(self) -> List[BaseException]:
        """Wait for the save in flight; the unobserved errors."""
        with self._lock:
            self._wait_inflight()
            errors = self._take_unobserved()
        _remove_finished_hooks()
        with _pending_lock:
            _pending.discard(self)
        return errors

    def wait(self) -> None:
        """Wait until every save in flight is durable; raise the error of
        each background save whose ``result()`` nobody took (one error as
        itself, several as an ``ExceptionGroup``)."""
        _raise_all(self._drain())

    # ----------------------------------------------------------- loading

    def _resolve(self, r: "_ckvc.Reader", rev: Rev) -> str:
        # A step is looked up on this object's branch when it has one.
        if self.branch is not None and isinstance(rev, int) and not isinstance(rev, bool):
            return r.resolve(f"{self.branch}@{_rev(rev)}")
        return r.resolve(_rev(rev))

    def load(self, rev: Rev) -> Any:
        """The state saved at ``rev`` (a step on the current branch, a
        branch, a tag, or a commit id prefix).

        For a commit made by ``save``: the same structure and types (int
        keys stay int, tuples stay tuples, tied tensors come back as one
        object); tensors saved from torch come back as CPU torch tensors
        when torch is installed, numpy arrays otherwise (a dtype numpy
        lacks, like bfloat16, as its raw bits). For any other commit (e.g.
        a directory committed by the command line): ``{path: {tensor name:
        tensor}}`` for files holding tensors and ``{path: bytes}`` for the
        others (torch tensors when torch is installed).

        A background save still in flight is waited for first (until it is
        durable or has failed: the state it saves is what ``rev`` may name;
        its error is left to ``result()``/``wait()``).
        """
        with self.open(rev) as ck:
            return ck._load_all()

    def open(self, rev: Rev) -> "Checkpoint":
        """A lazy view of one commit (use as a context manager): ``keys()``
        and ``get_tensor(key)`` decode only the tensor asked for. A save in
        flight is waited for first, as by ``load``."""
        self._wait_saved()
        return Checkpoint(self, rev)

    def steps(self) -> List[int]:
        """The steps on the current branch, ascending (a save in flight
        waited for first)."""
        self._wait_saved()
        return list(self._reader().steps(self.branch))

    def log(self, rev: Optional[Rev] = None, limit: Optional[int] = None) -> List[Commit]:
        """The commits of the current branch (or from ``rev``), newest first
        (a save in flight waited for first)."""
        self._wait_saved()
        r = self._reader()
        if rev is not None:
            start: Optional[str] = _rev(rev)
        elif self.branch is not None:
            if not _has_branch_head(r, self.branch):
                return []
            start = self.branch
        else:
            start = None  # the current branch; no commits: []
        return [Commit._from(d) for d in r.log(start, limit)]

    def commit_dir(self, path: Union[str, os.PathLike], step: Optional[int] = None, message: str = "") -> Commit:
        """Commit a checkpoint directory, as ``ckvc commit DIR`` does (the
        step from ``step``, else ``trainer_state.json``, else the directory
        name; metrics from ``trainer_state.json``)."""
        if step is not None:
            _check_step(step)
        with self._lock:
            # after this object's save in flight (which holds the write
            # lock, and whose step comes first)
            self._wait_inflight()
            d = _ckvc.commit_dir(self.path, os.fspath(path), step, message, self.branch)
        return self._commit(d["id"])

    def checkout(self, rev: Rev, out_dir: Union[str, os.PathLike], force: bool = False) -> Commit:
        """Write the files of ``rev`` into ``out_dir``, byte for byte, as
        ``ckvc checkout REV -o OUT`` does; returns its ``Commit`` (a save in
        flight waited for first)."""
        self._wait_saved()
        r = self._reader()
        cid = self._resolve(r, rev)
        r.checkout(cid, os.fspath(out_dir), force)
        return Commit._from(r.commit(cid))

    def _commit(self, cid: str) -> Commit:
        return Commit._from(self._reader().commit(cid))

    def __repr__(self) -> str:
        return f"ckvc.Repository({self.path!r})"


def _has_branch_head(r: "_ckvc.Reader", branch: str) -> bool:
    try:
        r.resolve(branch)
        return True
    except NotFoundError:
        return False


class Checkpoint:
    """One commit opened for reading (``Repository.open``). Like
    safetensors' ``safe_open``: nothing is decoded until ``get_tensor``.

    Keys: for a commit made by ``save``, the tensor keys (the path in the
    state joined with dots, e.g. ``model.fc.weight``,
    ``optim.state.0.exp_avg``). For other commits, each tensor's name,
    or ``path:name`` where several files hold that name.
    """

    def __init__(self, repo: Repository, rev: Rev) -> None:
        self._repo = repo
        self._r = repo._reader()
        self.id = repo._resolve(self._r, rev)
        self._files = {p: (kind, n, ts) for p, kind, n, ts in self._r.list_files(self.id)}
        self._doc: Optional[_state.StateDoc] = None
        self._st: Dict[str, Tuple[str, List[int], int]] = {}
        if _state.STATE_FILE in self._files and _state.TENSORS_FILE in self._files:
            try:
                self._doc = _state.StateDoc(self._r.read_file(self.id, _state.STATE_FILE))
            except _state.NotAState:
                # Another tool's state.json beside a safetensors file: the
                # commit is read as plain files.
                self._doc = None
            except _state.BadState as e:
                raise self._corrupt(_state.STATE_FILE, str(e)) from None
        if self._doc is not None:
            for name, dt, shape, nbytes in self._files[_state.TENSORS_FILE][2]:
                self._st[name] = (dt, shape, nbytes)
            self._index = {k: (_state.TENSORS_FILE, k) for k in self._doc.tensors}
        else:
            count: Dict[str, int] = {}
            for _, (_, _, ts) in self._files.items():
                for name, *_ in ts:
                    count[name] = count.get(name, 0) + 1
            self._index = {}
            for p, (_, _, ts) in sorted(self._files.items()):
                for name, *_ in ts:
                    self._index[name if count[name] == 1 else f"{p}:{name}"] = (p, name)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._r = None  # type: ignore[assignment]

    def _reader(self) -> "_ckvc.Reader":
        """The open reader; ``ValueError`` once the ``with`` block is
        left (as a closed file's reads), not ``AttributeError`` on None.
        ``keys()`` and ``files()`` stay (they read nothing)."""
        if self._r is None:
            raise ValueError(f"the Checkpoint of commit {self.id[:12]} is closed (used after its with block)")
        return self._r

    @property
    def commit(self) -> Commit:
        """This commit's metadata."""
        return Commit._from(self._reader().commit(self.id))

    def keys(self) -> List[str]:
        """The tensor keys, in order."""
        return list(self._index)

    def files(self) -> List[str]:
        """The commit's file paths."""
        return list(self._files)

    def get_tensor(self, key: str) -> Any:
        """Decode one tensor (only its chunks are read, each verified)."""
        if key not in self._index:
            raise KeyError(key)
        path, name = self._index[key]
        if self._doc is not None:
            return self._read_state_tensor(name, self._doc.tensors[name])
        return self._read_plain(path, name)

    def _read_plain(self, path: str, name: str) -> Any:
        for tname, dt, shape, nbytes in self._files[path][2]:
            if tname == name:
                raw, finish = _state.alloc(nbytes, "any", dt, shape, dt)
                self._reader().read_tensor_into(self.id, path, name, raw)
                return finish()
        raise KeyError(name)

    def _corrupt(self, file: str, reason: str, tensor: Optional[str] = None) -> CorruptError:
        """A ``CorruptError`` about ``file`` of this commit (and
        ``tensor``), with the attributes the native ones carry."""
        e = CorruptError(f"{file} of commit {self.id[:12]}: {reason}")
        e.what = f"{file} of commit {self.id}"
        e.reason = reason
        e.reason_kind = "bad_encoding"
        e.commit, e.file, e.tensor = self.id, file, tensor
        return e

    def _read_state_tensor(self, key: str, node: Dict[str, Any]) -> Any:
        if key not in self._st:
            raise self._corrupt(_state.TENSORS_FILE, f"no tensor {key!r}", key)
        st_dtype, _, nbytes = self._st[key]
        why = _state.tensor_mismatch(node, nbytes)
        if why is not None:
            raise self._corrupt(_state.STATE_FILE, f"tensor {key!r}: {why}", key)
        raw, finish = _state.alloc(nbytes, node["kind"], node["dtype"], node["shape"], st_dtype)
        self._reader().read_tensor_into(self.id, _state.TENSORS_FILE, key, raw)
        return finish()

    def read_file(self, path: str) -> bytes:
        """One whole file of the commit (verified)."""
        return self._reader().read_file(self.id, path)

    def _load_all(self) -> Any:
        if self._doc is not None:
            try:
                return _state.build(self._doc.root, self._read_state_tensor, {})
            except _state.BadState as e:
                raise self._corrupt(_state.STATE_FILE, str(e)) from None
        out: Dict[str, Any] = {}
        for p, (_, _, ts) in self._files.items():
            if ts:
                out[p] = {name: self._read_plain(p, name) for name, *_ in ts}
            else:
                out[p] = self._reader().read_file(self.id, p)
        return out
