"""Type stubs of the native module ``ckvc._ckvc`` (Rust, PyO3).

Writers open the repository for one call (the write lock is never held
between calls); ``Reader`` opens it read-only. Library errors are raised as
the exceptions below, with the library's fields as attributes.
"""

from os import PathLike
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

_Path = Union[str, PathLike[str]]
_Buffer = Any  # any C-contiguous object with the buffer protocol (bytes, bytearray, numpy, memoryview)

class CkvcError(Exception):
    """Base class of every ckvc error."""

class CorruptError(CkvcError):
    """Stored data is damaged or missing."""

    what: str
    reason: str
    commit: Optional[str]
    file: Optional[str]
    tensor: Optional[str]

class LockedError(CkvcError):
    """Another process holds the write lock (or rewrites the repository); retry."""

class NotFoundError(CkvcError):
    """No such revision, branch or tag, or not a repository."""

class StepOrderError(CkvcError):
    """The step is not after the branch head's."""

    branch: str
    step: int
    head_step: int

class AlreadyExistsError(CkvcError):
    """A repository, branch or tag exists, or the output directory is not empty."""

class InvalidInputError(CkvcError):
    """Input the library refuses (bad path, name, metric, checkpoint file, no such file/tensor)."""

class StorageFullError(CkvcError):
    """Too little free space to write safely; nothing was changed."""

def rocksdb_crc_calls() -> int:
    """CRC32Cs RocksDB computed with ckvc's hardware CRC in this process."""

def lower_priority(by: int) -> None:
    """Set the calling thread's nice value ``by`` above the process's
    (unless it is that or more already; best effort, Linux)."""

def init(path: _Path, row_frames: bool = True) -> None:
    """Create a repository in ``path`` (like ``ckvc init``; ``row_frames``
    false: ``--no-row-frames``)."""

def commit_buffers(
    path: _Path,
    files: Sequence[Tuple[str, Union[_Buffer, List[_Buffer]]]],
    step: int,
    message: str = "",
    metrics: Sequence[Tuple[str, float]] = (),
    branch: Optional[str] = None,
    nice: int = 0,
    check: Optional[Callable[[], Any]] = None,
    bases: Optional["Bases"] = None,
    bases_cap: int = 0,
    pause: Optional["Pause"] = None,
    mirror: Optional[Tuple[str, _Buffer]] = None,
) -> Dict[str, Any]:
    """Internal (``Repository.save`` calls it with its own staging buffer,
    or, for a blocking save, with a list of buffers per file: the header
    and each tensor in place, the file being their concatenation).
    Commit in-memory files at ``step`` with the GIL released: the buffers
    are read without the GIL, so no other thread may write them during the
    call (that would be a data race). With ``nice`` above 0 (a background
    save) the calling thread's nice value is set that much above the
    process's, for good, and the commit runs on a pool of threads of that
    priority. ``check`` is called (with the GIL) once every buffer has
    been read and stored, before the commit is published: an exception it
    raises abandons the commit (the branch stays where it was) and is
    raised by this call. With ``mirror`` (``(path, staging)``: one of the
    files and a writable buffer at least as long), a thread copies that
    file from its end into ``staging`` while the commit reads it from its
    start, and the commit reads the rest from ``staging`` once they meet:
    ``check`` is called then, once no byte of that file's buffers will be
    read again (the caller may change them from its return; ``staging``
    must not be touched until this call returns). With ``pause``, the
    commit's reading and coding wait while it is held. Returns the commit
    report: id, step, branch, already_committed, logical_bytes,
    stored_bytes, files, new_chunks, max_depth."""

def commit_dir(
    path: _Path,
    dir: _Path,
    step: Optional[int] = None,
    message: str = "",
    branch: Optional[str] = None,
    nice: int = 0,
) -> Dict[str, Any]:
    """Commit a checkpoint directory (``ckvc commit DIR``); the same report.
    ``nice`` as for ``commit_buffers`` (the Trainer callback's commits)."""

class Bases:
    """Internal: the delta bases a ``Repository`` object keeps between its
    saves (``commit_buffers(bases=, bases_cap=)``: at most ``bases_cap``
    bytes, at least the memory budget's share)."""

    def __init__(self) -> None: ...
    def held_bytes(self) -> int: ...
    def clear(self) -> None: ...

class Pause:
    """Internal: holds the reading and coding of the commits given it
    (``commit_buffers(pause=)``) while an optimizer step runs: until
    ``resume`` (once per ``hold``) or ``clear``, and at most ``limit``
    seconds from the last ``hold``."""

    def __init__(self) -> None: ...
    def hold(self, limit: float) -> None: ...
    def resume(self) -> None: ...
    def clear(self) -> None: ...
    def is_held(self) -> bool: ...

class Reader:
    """A read-only view of the repository at ``path``, as of opening."""

    def __init__(self, path: _Path) -> None: ...
    def resolve(self, rev: str) -> str:
        """The 64-hex-digit commit id a revision names."""
    def current_branch(self) -> str: ...
    def commit(self, id: str) -> Dict[str, Any]:
        """id, step, branch, message, metrics_json, time, parents,
        logical_bytes, stored_bytes, files, max_depth."""
    def log(self, rev: Optional[str] = None, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """Commits newest first (dicts as ``commit``)."""
    def list_files(self, id: str) -> List[Tuple[str, str, int, List[Tuple[str, str, List[int], int]]]]:
        """``[(path, kind, length, [(tensor, safetensors dtype, shape, bytes)])]``."""
    def read_file(self, id: str, file: str) -> bytes:
        """A whole file, every chunk and the file verified."""
    def read_tensor_into(self, id: str, file: str, tensor: str, out: _Buffer) -> None:
        """Decode one tensor into ``out`` (writable, C-contiguous, exactly its length)."""
    def checkout(self, id: str, out: _Path, force: bool = False) -> Tuple[int, int]:
        """Write the commit's files into ``out``; ``(files, bytes)``."""
    def steps(self, branch: Optional[str] = None) -> List[int]:
        """Steps on the branch, ascending."""
    def holds_dir(self, id: str, dir: _Path) -> bool:
        """True when the commit holds exactly ``dir``'s files and all read back whole."""
