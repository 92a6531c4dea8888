"""Hugging Face Trainer integration: commit each checkpoint the Trainer writes.

>>> from ckvc.integrations.transformers import CkvcCallback
>>> trainer = Trainer(..., callbacks=[CkvcCallback("ckvc-repo", keep_local=2)])

Each ``checkpoint-N/`` directory is committed in a background thread (one
at a time, in order) while training goes on, with the step from the
Trainer state and the metrics of its log history (``trainer_state.json``).
``on_save`` first links the checkpoint's files into a private snapshot
(``OUTPUT_DIR/.ckvc-snapshots/``, hard links: no copy), so the Trainer's
own ``save_total_limit`` may delete the directory before its commit runs.
At most one checkpoint waits behind the one being committed; a further
``on_save`` waits for it. ``on_train_end`` waits for every pending commit.
Only the main process (``state.is_world_process_zero``) commits.

Resuming: ``repo.checkout(step, dir)`` then
``trainer.train(resume_from_checkpoint=dir)``; the files are byte for byte
those the Trainer wrote.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from typing import List, Optional, Tuple

from .. import _ckvc
from .. import BACKGROUND_NICE, CkvcError, Repository

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover
    raise ImportError("ckvc.integrations.transformers needs transformers (pip install transformers)") from e


class CkvcCallback(TrainerCallback):
    """Commit every checkpoint directory the Trainer saves into the ckvc
    repository at ``repo_path`` (created if missing).

    ``keep_local=K`` deletes committed local ``checkpoint-N`` directories
    beyond the newest K, each only after its commit is durable and holds
    exactly the directory's files, every one read back whole from the
    repository (what ``ckvc watch --prune-local`` checks). ``branch``
    commits on that branch instead of the current one.

    An error of a background commit is raised by ``wait()`` and at the end
    of training; ``errors`` lists them.
    """

    def __init__(self, repo_path: str, keep_local: Optional[int] = None, branch: Optional[str] = None) -> None:
        if keep_local is not None and keep_local < 0:
            raise ValueError("keep_local must be >= 0")
        self.repo_path = os.fspath(repo_path)
        self.keep_local = keep_local
        self.branch = branch
        self.errors: List[BaseException] = []
        self.committed: List[Tuple[int, str, str]] = []  # (step, commit id, dir)
        # (checkpoint dir, its snapshot, step); one waits, one is committed.
        self._queue: "queue.Queue[Optional[Tuple[str, str, int]]]" = queue.Queue(maxsize=1)
        # The Trainer's best checkpoint (load_best_model_at_end): never pruned.
        self._best: Optional[str] = None
        # The last committed snapshot: kept until the next commit, which
        # reads its delta bases from it.
        self._last_snapshot: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._repo: Optional[Repository] = None

    # ------------------------------------------------------------ worker

    def _ensure(self) -> None:
        if self._repo is None:
            if not os.path.isdir(os.path.join(self.repo_path, ".ckvc")):
                Repository.init(self.repo_path)
            self._repo = Repository(self.repo_path, branch=self.branch)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="ckvc-trainer-commits", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                d, snap, step = item
                try:
                    r = _ckvc.commit_dir(
                        self.repo_path, snap, step, "", self.branch, nice=BACKGROUND_NICE
                    )
                    self.committed.append((step, r["id"], d))
                    if self._last_snapshot is not None:
                        shutil.rmtree(self._last_snapshot, ignore_errors=True)
                    self._last_snapshot = snap
                    if self.keep_local is not None:
                        self._prune()
                except BaseException as e:  # noqa: BLE001 - kept, raised by wait()
                    shutil.rmtree(snap, ignore_errors=True)
                    self.errors.append(e)
            finally:
                self._queue.task_done()

    def _prune(self) -> None:
        keep = self.keep_local or 0
        best = os.path.realpath(self._best) if self._best else None
        live = [
            (s, cid, d)
            for s, cid, d in self.committed
            if os.path.isdir(d) and os.path.realpath(d) != best
        ]
        old = live[: max(len(live) - keep, 0)]
        if not old:
            return
        reader = _ckvc.Reader(self.repo_path)
        for _, cid, d in old:
            # Durable (the commit call returned) and verified against the
            # directory before anything is deleted.
            try:
                if reader.holds_dir(cid, d):
                    shutil.rmtree(d)
            except FileNotFoundError:
                # A file of it vanished: someone else (the Trainer's own
                # rotation) is deleting it; skipping a prune loses nothing.
                continue
            except (OSError, CkvcError):
                # The Trainer's own rotation (save_total_limit, in the main
                # thread) deleted it meanwhile: nothing left to prune.
                if os.path.lexists(d):
                    raise

    def wait(self) -> None:
        """Wait for every pending commit; raise the error of a failed one
        (several: an ``ExceptionGroup``). Each error is raised once."""
        self._queue.join()
        errors, self.errors = self.errors, []
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise BaseExceptionGroup(f"{len(errors)} checkpoint commits failed", errors)

    @staticmethod
    def _snapshot(d: str, root: str) -> str:
        """Hard-link every file of ``d`` into a fresh directory under
        ``root`` (copy where linking fails, e.g. across file systems). The
        Trainer never rewrites a saved file in place, so the links keep the
        checkpoint as it was even if the directory is deleted."""
        snap = os.path.join(root, f"{os.path.basename(d)}-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(snap, ignore_errors=True)

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        shutil.copytree(d, snap, copy_function=link, symlinks=True)
        return snap

    # --------------------------------------------------------- callbacks

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        d = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self._best = state.best_model_checkpoint
        if os.path.isdir(d):
            self._ensure()
            root = os.path.join(args.output_dir, ".ckvc-snapshots")
            os.makedirs(root, exist_ok=True)
            snap = self._snapshot(d, root)
            # Blocks while one checkpoint already waits: at most one behind
            # the commit in progress, so a slow commit cannot pile them up.
            self._queue.put((d, snap, int(state.global_step)))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self._thread is not None:
            try:
                self.wait()
            finally:
                if self._last_snapshot is not None:
                    shutil.rmtree(self._last_snapshot, ignore_errors=True)
                    self._last_snapshot = None
                try:
                    os.rmdir(os.path.join(args.output_dir, ".ckvc-snapshots"))
                except OSError:
                    pass
        return control
