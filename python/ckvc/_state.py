"""A training state as two files: ``state.json`` and ``tensors.safetensors``.

The structure (nested dicts, lists, tuples, scalars) is stored as JSON data,
the tensors in a real safetensors file; nothing is ever pickled. The layout
is specified in ``docs/format/python-state.md``; this module is the only
code that writes or reads it.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from . import _ckvc
from ._ckvc import CkvcError

STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"
FORMAT = "ckvc-python-state"
VERSION = 1

try:  # torch is optional
    import torch

    _TORCH = True
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]
    _TORCH = False


# torch dtype name -> safetensors dtype, for the dtypes safetensors has; any
# other torch dtype is stored as U8 bytes.
_TORCH_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
}


def _torch_dtypes() -> Dict[Any, str]:
    """torch dtype -> safetensors dtype, for the dtypes this torch has."""
    if not _TORCH:
        return {}
    out = {}
    for attr, st in _TORCH_NAMES.items():
        dt = getattr(torch, attr, None)
        if dt is not None:
            out[dt] = st
    return out


_TORCH_TO_ST = _torch_dtypes()

# numpy dtype kind+size -> safetensors dtype (native byte order only).
_NUMPY_TO_ST = {
    "f8": "F64",
    "f4": "F32",
    "f2": "F16",
    "i8": "I64",
    "i4": "I32",
    "i2": "I16",
    "i1": "I8",
    "u8": "U64",
    "u4": "U32",
    "u2": "U16",
    "u1": "U8",
    "b1": "BOOL",
}


def torch_dtype(name: str):
    """The torch dtype called ``name`` (``"bfloat16"``); TypeError if unknown."""
    dt = getattr(torch, name, None) if _TORCH else None
    if not (_TORCH and isinstance(dt, torch.dtype)):
        raise TypeError(f"torch has no dtype {name!r}")
    return dt


class Leaf:
    """One tensor to store: its key, kind, dtype names, shape and bytes."""

    __slots__ = ("key", "kind", "obj", "dtype", "st_dtype", "shape", "nbytes", "offset", "align")

    def __init__(self, key, kind, obj, dtype, st_dtype, shape, nbytes, align=1):
        self.key = key
        self.kind = kind  # "torch" | "numpy"
        self.obj = obj  # the tensor / array (a 0-d array for numpy scalars)
        self.dtype = dtype  # torch: "bfloat16"; numpy: dtype.str ("<f4")
        self.st_dtype = st_dtype  # safetensors dtype of the stored bytes
        self.shape = shape
        self.nbytes = nbytes
        self.offset = 0
        self.align = min(max(int(align), 1), 8)  # element size, for the layout order


def _float_node(x: float) -> Dict[str, Any]:
    if math.isfinite(x):
        return {"type": "float", "value": x}
    if math.isnan(x):
        # A NaN's sign and payload (`-nan`, one from a bit pattern) are its
        # bits; "nan" alone loads as Python's own NaN.
        return {"type": "float", "value": "nan", "bits": struct.pack(">d", x).hex()}
    return {"type": "float", "value": "inf" if x > 0 else "-inf"}


def _float_value(node: Dict[str, Any]) -> float:
    bits = node.get("bits")
    if bits is not None:
        return struct.unpack(">d", bytes.fromhex(bits))[0]
    return float(node["value"])  # float("nan"), float("inf"), float("-inf") and numbers


def _is_nan_bits(v: Any) -> bool:
    """True for a float node's ``bits``: 16 lowercase hex digits of a
    big-endian IEEE 754 double that is a NaN."""
    if not isinstance(v, str) or len(v) != 16 or any(c not in "0123456789abcdef" for c in v):
        return False
    b = int(v, 16)
    return (b >> 52) & 0x7FF == 0x7FF and b & ((1 << 52) - 1) != 0


# JSON writes an int in decimal, and a default Python process refuses to
# read one of more than 4300 digits (`sys.int_info.default_max_str_digits`):
# such an int is refused at save, whatever this process's own limit, so
# that every saved state loads in a default process.
_INT_DIGITS = 4300
_INT_BOUND = 10**_INT_DIGITS


def _int_value(x: int, path: List[str]) -> int:
    if -_INT_BOUND < x < _INT_BOUND:
        return int(x)
    raise ValueError(
        f"{'.'.join(path) or 'state'}: cannot save an int of more than {_INT_DIGITS} digits "
        "(a default Python process cannot read it back from JSON); save it as bytes, "
        "e.g. x.to_bytes((x.bit_length() + 8) // 8, 'little', signed=True)"
    )


class Flattener:
    """Walks a state, producing its JSON tree and the tensor leaves."""

    def __init__(self) -> None:
        self.leaves: List[Leaf] = []
        self.used: set = set()
        # identity of a tensor view -> its leaf (tied weights stored once)
        self.by_view: Dict[Tuple, Leaf] = {}
        self.by_id: Dict[int, Leaf] = {}

    def key_for(self, path: List[str]) -> str:
        key = ".".join(path) if path else "tensor"
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (from a file name decoded with
            # surrogateescape): the safetensors header is UTF-8 JSON.
            raise ValueError(f"{key!r}: a tensor's path must be valid Unicode (it names the tensor)") from None
        # safetensors' own header entry: never a tensor name.
        if key not in self.used and key != "__metadata__":
            self.used.add(key)
            return key
        n = 1
        while f"{key}#{n}" in self.used:
            n += 1
        key = f"{key}#{n}"
        self.used.add(key)
        return key

    def tensor(self, x, path: List[str]) -> Dict[str, Any]:
        leaf = self.by_id.get(id(x))
        if leaf is None:
            if _TORCH and isinstance(x, torch.Tensor):
                leaf = self._torch_leaf(x, path)
            else:
                leaf = self._numpy_leaf(x, path)
            self.by_id[id(x)] = leaf
        node = {
            "type": "tensor",
            "key": leaf.key,
            "kind": leaf.kind,
            "dtype": leaf.dtype,
            "shape": list(leaf.shape),
        }
        if isinstance(x, np.generic):
            node["kind"] = "numpy_scalar"
        return node

    def _torch_leaf(self, t, path):
        if t.is_sparse or getattr(t, "is_quantized", False) or t.layout != torch.strided:
            raise TypeError(f"{'.'.join(path)}: only dense (strided) tensors can be saved, not {t.layout}")
        if t.device.type == "meta":
            raise TypeError(f"{'.'.join(path)}: a tensor on the meta device holds no data")
        try:
            storage = t.untyped_storage()
            # Lazy conjugate / negative views share storage but not values.
            view = (
                "torch",
                storage.data_ptr(),
                storage.device.type,
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t.is_conj(),
                t.is_neg(),
            )
        except Exception:  # pragma: no cover - tensor subclasses without storage
            view = None
        if view is not None and t.numel() > 0 and view in self.by_view:
            return self.by_view[view]
        dt = t.dtype
        name = str(dt).replace("torch.", "")
        st = _TORCH_TO_ST.get(dt)
        nbytes = t.numel() * t.element_size()
        shape = tuple(t.shape)
        if st is None:  # complex, fp8 fnuz variants, ...: stored as raw bytes
            st = "U8"
        leaf = Leaf(self.key_for(path), "torch", t, name, st, shape, nbytes, t.element_size())
        if view is not None and t.numel() > 0:
            self.by_view[view] = leaf
        self.leaves.append(leaf)
        return leaf

    def _numpy_leaf(self, a, path):
        if isinstance(a, np.generic):
            a = np.asarray(a)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(f"{'.'.join(path)}: numpy arrays of dtype {a.dtype} cannot be saved (objects or records)")
        view = None
        if a.size > 0:
            view = ("numpy", a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
            if view in self.by_view:
                return self.by_view[view]
        native = a.dtype.newbyteorder("=") if a.dtype.byteorder not in ("=", "|") else a.dtype
        key = f"{a.dtype.kind}{a.dtype.itemsize}"
        st = _NUMPY_TO_ST.get(key) if native == a.dtype else None
        if st is None:
            st = "U8"
        leaf = Leaf(self.key_for(path), "numpy", a, a.dtype.str, st, tuple(a.shape), a.nbytes, a.dtype.itemsize)
        if view is not None:
            self.by_view[view] = leaf
        self.leaves.append(leaf)
        return leaf

    def node(self, x, path: List[str]) -> Dict[str, Any]:
        if len(path) >= MAX_DEPTH:
            raise ValueError(
                f"{'.'.join(path[:8])}...: the state nests deeper than {MAX_DEPTH} levels "
                "(does it contain itself?)"
            )
        if x is None:
            return {"type": "none"}
        if isinstance(x, np.generic):  # before float: np.float64 subclasses it
            return self.tensor(x, path)
        if isinstance(x, bool):
            return {"type": "bool", "value": x}
        # Exact types only below: a subclass (an IntEnum, a namedtuple, a
        # defaultdict, torch.Size) would load as its base class.
        if type(x) is int:
            return {"type": "int", "value": _int_value(x, path)}
        if type(x) is float:
            return _float_node(float(x))
        if type(x) is str:
            return {"type": "str", "value": x}
        if type(x) in (bytes, bytearray):
            return {"type": "bytes", "value": base64.b64encode(bytes(x)).decode("ascii")}
        if (_TORCH and isinstance(x, torch.Tensor)) or isinstance(x, (np.ndarray, np.generic)):
            return self.tensor(x, path)
        if _TORCH and isinstance(x, torch.dtype):
            return {"type": "torch_dtype", "value": str(x).replace("torch.", "")}
        if type(x) in (dict, collections.OrderedDict):
            items = []
            for k, v in x.items():
                if type(k) not in (str, int):
                    raise TypeError(f"{'.'.join(path) or 'state'}: dict keys must be str or int, not {type(k).__name__}")
                if isinstance(k, str):
                    kn = {"type": "str", "value": k}
                else:
                    kn = {"type": "int", "value": _int_value(k, path + ["<key>"])}
                items.append([kn, self.node(v, path + [str(k)])])
            node = {"type": "dict", "items": items}
            if isinstance(x, collections.OrderedDict):
                node["ordered"] = True
            return node
        if type(x) is tuple:
            return {"type": "tuple", "items": [self.node(v, path + [str(i)]) for i, v in enumerate(x)]}
        if type(x) is list:
            return {"type": "list", "items": [self.node(v, path + [str(i)]) for i, v in enumerate(x)]}
        raise TypeError(
            f"{'.'.join(path) or 'state'}: cannot save a {type(x).__module__}.{type(x).__qualname__} "
            "(only dicts, lists, tuples, tensors, numpy arrays, numbers, str, bytes, bool and None)"
        )


class Plan:
    """A flattened state: ``state.json`` bytes and the safetensors layout."""

    def __init__(self, state_json: bytes, header: bytes, leaves: List[Leaf], data_len: int):
        self.state_json = state_json
        self.header = header  # 8-byte length + padded JSON
        self.leaves = leaves
        self.data_len = data_len

    @property
    def file_len(self) -> int:
        return len(self.header) + self.data_len


def plan(state: Any) -> Plan:
    """Flatten ``state`` and lay its tensors out as a safetensors file."""
    fl = Flattener()
    root = fl.node(state, [])
    # Widest elements first: every tensor starts aligned to its width.
    order = sorted(range(len(fl.leaves)), key=lambda i: -fl.leaves[i].align)
    header: Dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": str(VERSION)}}
    off = 0
    leaves = []
    for i in order:
        leaf = fl.leaves[i]
        leaf.offset = off
        shape = list(leaf.shape) if leaf.st_dtype != "U8" or _is_u8(leaf) else [leaf.nbytes]
        header[leaf.key] = {"dtype": leaf.st_dtype, "shape": shape, "data_offsets": [off, off + leaf.nbytes]}
        off += leaf.nbytes
        leaves.append(leaf)
    hjson = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    hjson += b" " * (-(len(hjson)) % 8)
    head = len(hjson).to_bytes(8, "little") + hjson
    doc = {"format": FORMAT, "version": VERSION, "tensors_file": TENSORS_FILE, "root": root}
    state_json = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return Plan(state_json, head, leaves, off)


def _is_u8(leaf: Leaf) -> bool:
    """True when a U8-stored leaf really is uint8 (so keeps its shape)."""
    return leaf.dtype in ("uint8", "|u1")


# madvise(2) advice that faults a range in, writable, in one call (Linux
# 5.14+); Python 3.11's mmap module has no name for it.
MADV_POPULATE_WRITE = 23

# ``HostBuffer.populate`` faults the buffer in this many bytes per call.
POPULATE_PIECE = 16 << 20

# The share of its time the staging buffer's fault-in after a first
# background save spends faulting (``HostBuffer.populate``'s ``duty``): it
# sleeps three times as long as each piece took. At nice +10 and at full
# speed it lengthened the optimizer step beside it by about as long as it
# ran (GPT-2 small + AdamW: 1.4 GiB faulted in in 0.38-0.55 s; the part
# of that step after its wait for the commit took 0.57-0.74 s, against
# 0.37-0.38 s with no fault-in and 0.33 s for a step with no save; paced,
# the whole step took 0.99-1.07 s against 0.95-1.02 s with no fault-in,
# and the fault-in 2.3 s). `scripts/bench_python.py --compute idle`, six
# pairs of runs alternating the two: first save's stall 0.122-0.200x
# (mean 0.154) -> 0.103-0.177x (mean 0.134) `torch.save` + fsync, lower
# in five pairs. The buffer is only needed by the next save; a save that
# comes sooner faults the rest in as it copies.
WARM_DUTY = 0.25


class HostBuffer:
    """``n`` bytes of anonymous memory of their own mapping (given back to
    the system when freed), 4 KiB pages, faulted in by ``populate``.

    Not ``MADV_HUGEPAGE``: with the kernel's default THP ``defrag``
    setting (``madvise``) a fault in such a region compacts memory
    synchronously until it finds a 2 MiB page, and on a machine whose
    memory has been fragmented for hours that made the first save's copy
    of 1.4 GiB take 0.85-1.70 s against 0.32-0.56 s with plain pages
    (fresh processes, alternating; the second copy ~0.1 s either way);
    only on unfragmented memory were huge pages faster (0.22-0.26 s)."""

    def __init__(self, n: int) -> None:
        self._map: Any = None
        try:
            import mmap

            self._map = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.array = np.frombuffer(self._map, dtype=np.uint8)
        except (ImportError, OSError, ValueError, AttributeError):
            self.array = np.empty(n, dtype=np.uint8)
        self.populated = self._map is None
        # A thread of `Staging.warm` is faulting it in (or will, having
        # been started): a copy into it meanwhile faults its own pages.
        self.warming = False

    def populate(self, duty: float = 1.0) -> None:
        """Fault the whole buffer in with ``MADV_POPULATE_WRITE`` before
        the first copy into it (a no-op after the first call, and where the
        kernel has no such advice). With ``duty`` below 1, a sleep after
        each piece makes the faulting that share of the time taken.

        The first copy of a state into fresh memory is the first save's
        cost: a page fault per 4 KiB (torch's ``copy_`` of GPT-2 small +
        AdamW, 1.4 GiB, took 1.95-1.99 s into a fresh buffer against
        0.08-0.09 s into the same buffer again). Faulting 1.4 GiB in by one
        madvise took 0.41-0.44 s against 0.74-1.77 s by touching it (three
        alternating runs in fresh processes); the first background staging
        of that state in a training process took 0.93-1.77 s with it
        against 1.04-1.83 s without (three alternating runs). What is left
        is the machine: on these VMs a page the guest has not touched for
        a while costs ~10 us to fault in however it is asked for (2.6 s per
        GiB, one thread or two)."""
        if self.populated:
            return
        self.populated = True
        madvise = _libc_madvise()
        if madvise is not None:
            # ctypes releases the GIL for the call (mmap.madvise does not,
            # and would stop the training thread for the whole fault-in);
            # a failure (an older kernel) leaves the faults to the copy.
            # In pieces: the kernel holds the process's mmap lock while it
            # faults a range in, and a training thread that maps or unmaps
            # memory meanwhile (torch's allocator, in optimizer.step())
            # waited for all of it: with one call for 1.4 GiB right after a
            # first save, the training step beside it took 2.7-3.9 s longer
            # than one with no save, with pieces 0.4-0.7 s (the wait for
            # the commit included; GPT-2 small + AdamW, two runs each).
            addr, n = self.array.ctypes.data, self.array.nbytes
            for at in range(0, n, POPULATE_PIECE):
                t = time.perf_counter()
                if madvise(addr + at, min(POPULATE_PIECE, n - at), MADV_POPULATE_WRITE) != 0:
                    break
                if duty < 1.0 and at + POPULATE_PIECE < n:
                    time.sleep((time.perf_counter() - t) * (1.0 / duty - 1.0))


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: free memory of every malloc arena back
    to the system (best effort; a no-op elsewhere)."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass


def _libc() -> Any:
    """The C library through ctypes, or None where it cannot be loaded."""
    try:
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except (ImportError, OSError):
        return None


def _libc_madvise() -> Any:
    """libc's ``madvise`` through ctypes, or None where there is none."""
    libc = _libc()
    try:
        import ctypes

        f = libc.madvise
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
        return f
    except (ImportError, AttributeError):
        return None


# Tensors of at least this many bytes may be copied in the background
# (``save(..., staging="background")``); smaller ones (BatchNorm running
# statistics, step counters: what a forward pass or a scheduler changes in
# place) are always copied in the call.
BACKGROUND_MIN_BYTES = 1 << 20

# Tests only: called with a tensor's key in the staging thread just before
# that tensor is copied, or, for a save that reads its tensors in place,
# just before that tensor's version is checked (to make races
# deterministic).
_before_background_copy: Optional[Callable[[str], None]] = None


class TensorModifiedError(CkvcError):
    """A tensor was modified in place while a background save was still
    copying it, so the state at the call could not be stored; nothing was
    committed. Attributes: ``key`` (the tensor's key in the state),
    ``version_at_call`` and ``version_seen`` (torch's ``tensor._version``).
    Wait for ``SaveFuture.wait_staged()`` before changing tensors in place
    outside ``optimizer.step()``, or save with ``staging="sync"``."""

    def __init__(self, key: str, version_at_call: int, version_seen: int) -> None:
        super().__init__(
            f"tensor {key!r} was modified in place while it was being staged "
            f"(version {version_at_call} at the call, {version_seen} after its copy); "
            "nothing was committed: wait for SaveFuture.wait_staged() before changing "
            "tensors in place, or save with staging=\"sync\""
        )
        self.key = key
        self.version_at_call = version_at_call
        self.version_seen = version_seen


def _version(t) -> Optional[int]:
    """torch's in-place version counter of ``t``; None when it has none
    (inference-mode tensors)."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError, TypeError):
        return None


class Staging:
    """One reused host buffer holding the tensors file being saved."""

    def __init__(self) -> None:
        self.host: Optional[HostBuffer] = None
        self.buf: Optional[np.ndarray] = None

    def _holding(self, n: int) -> HostBuffer:
        """The buffer, replaced by a fresh one when it holds fewer than
        ``n`` bytes (the old one freed before the new is allocated)."""
        if self.host is None or self.host.array.nbytes < n:
            self.host = self.buf = None
            self.host = HostBuffer(max(n, 1))
            self.buf = self.host.array
        return self.host

    def warm_for(self, n: int) -> bool:
        """True when the buffer holds ``n`` bytes and has been faulted in
        (or is being faulted in by ``warm``): a background copy into it
        runs at memory speed, not at the machine's page-in speed."""
        host = self.host
        return host is not None and host.array.nbytes >= n and (host.populated or host.warming)

    def warm(self, n: int) -> None:
        """Allocate the buffer for ``n`` bytes (if it is smaller) and fault
        it in on a daemon thread at a nice value 10 above the process's
        (the binding's ``lower_priority``, as a background commit's), paced
        to ``WARM_DUTY`` of its time: for the next background save, after a first one that
        read its tensors in place. A copy into the buffer meanwhile is
        correct (it faults the pages it writes itself); the thread keeps
        the buffer mapped until it is done, even if a larger one replaces
        it."""
        host = self._holding(n)
        if not host.populated:
            # The commit that just ended left its buffers free in glibc's
            # arenas: give them back before the buffer takes its memory.
            _malloc_trim()

            def populate() -> None:
                _ckvc.lower_priority(10)
                host.populate(duty=WARM_DUTY)

            # Warm from now on, not from when the thread gets to run: a
            # save right after this one copies into the buffer.
            host.warming = True
            threading.Thread(target=populate, name="ckvc-staging-warm", daemon=True).start()

    def stage(self, p: Plan, background: bool = False) -> Tuple[memoryview, List[Tuple[Leaf, Any, Any]]]:
        """Copy the header and the tensors of ``p`` into the buffer; the
        returned view is the whole ``tensors.safetensors`` file once
        ``copy_deferred`` has copied the deferred tensors.

        With ``background``, torch tensors of at least
        ``BACKGROUND_MIN_BYTES`` that have a version counter are not copied
        here but returned with their ``_version`` at the call, for
        ``copy_deferred`` (in another thread); smaller torch tensors are
        cloned now and put in place by ``copy_deferred`` (they lie all over
        the buffer: writing them into it here would fault in a page per
        tensor, a fresh 2 MiB one each on the first save); numpy arrays are
        copied into the buffer now.

        The deferred entries are ``(leaf, version at the call or None, the
        clone to copy from or None)``."""
        host = self._holding(p.file_len)
        if not background:
            host.populate()
        buf = host.array
        h = len(p.header)
        buf[:h] = np.frombuffer(p.header, dtype=np.uint8)
        deferred: List[Tuple[Leaf, Any, Any]] = []
        tbuf = None
        for leaf in p.leaves:
            if leaf.nbytes == 0:
                continue
            if background and leaf.kind == "torch":
                v = _watched_version(leaf)
                if v is not None:
                    # The tensor as it is now: a later `param.data =
                    # other` must not redirect the copy (detach shares
                    # the storage and the version counter).
                    leaf.obj = leaf.obj.detach()
                    deferred.append((leaf, v, None))
                    continue
                if leaf.nbytes < BACKGROUND_MIN_BYTES:
                    deferred.append((leaf, None, leaf.obj.detach().clone()))
                    continue
            if leaf.kind == "torch" and tbuf is None:
                tbuf = torch.from_numpy(buf)
            _copy_leaf(buf, tbuf, h, leaf)
        return memoryview(buf)[: p.file_len], deferred

    def copy_deferred(self, p: Plan, deferred: List[Tuple[Leaf, Any, Any]]) -> None:
        """Copy the tensors ``stage`` deferred (in the staging thread; the
        copies release the GIL). Each tensor's ``_version`` is compared
        after its copy with the one at the call, and all of them again at
        the end: ``TensorModifiedError`` when one was modified in place
        (its copy may be torn or later than the call)."""
        if not deferred:
            return
        buf = self.buf
        assert buf is not None and self.host is not None
        self.host.populate()
        h = len(p.header)
        tbuf = torch.from_numpy(buf)
        for leaf, v, clone in deferred:
            if clone is not None:
                _copy_leaf(buf, tbuf, h, leaf, clone)
                continue
            hook = _before_background_copy
            if hook is not None:
                hook(leaf.key)
            _copy_leaf(buf, tbuf, h, leaf)
            _check_version(leaf, v)
        # An in-place op bumps the version after its kernel: one that was
        # still writing a tensor when that tensor's copy ended has finished
        # by now unless it runs at this very instant.
        for leaf, v, clone in deferred:
            if clone is None:
                _check_version(leaf, v)


def in_place_background_parts(p: Plan) -> Tuple[List[Any], List[Tuple[Leaf, Any, Any]]]:
    """The tensors file of ``p`` for a background save that reads the
    large tensors in place while it commits (the first one, before the
    staging buffer is faulted in; a thread copies the file from its back
    into the staging buffer meanwhile): as ``in_place_parts``, but torch
    tensors of at least ``BACKGROUND_MIN_BYTES`` with a version counter
    are read where they are and returned with their ``_version`` at the
    call (as ``Staging.stage`` defers them: the caller guards them until
    the commit and the copy have read them, and then checks the versions
    with ``check_versions``), and everything else (numpy arrays, small
    tensors, tensors without a version counter) is copied now."""
    parts: List[Any] = [p.header]
    watched: List[Tuple[Leaf, Any, Any]] = []
    for leaf in p.leaves:
        if leaf.nbytes == 0:
            continue
        v = _watched_version(leaf)
        if v is not None:
            # as in Staging.stage: the tensor as it is now
            leaf.obj = leaf.obj.detach()
            parts.append(_leaf_bytes(leaf))
            watched.append((leaf, v, None))
            continue
        parts.append(np.array(_leaf_bytes(leaf), copy=True))
    return parts, watched


def readable_in_place(p: Plan) -> bool:
    """True when every torch tensor of ``p`` that a background save would
    read after the call (``_watched_version``) is a contiguous
    CPU tensor, so a commit can read it where it is: tensors on an
    accelerator (or strided ones) would be copied in the call instead,
    which is what background staging exists to avoid."""
    for leaf in p.leaves:
        if _watched_version(leaf) is not None:
            t = leaf.obj
            if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
                return False
    return True


def _watched_version(leaf: Leaf) -> Optional[int]:
    """The version at the call of a tensor a background save reads after
    the call (copied by ``copy_deferred`` or read in place by the commit):
    a torch tensor of at least ``BACKGROUND_MIN_BYTES`` with a version
    counter. None for every other leaf, which is copied in the call."""
    if leaf.kind != "torch" or leaf.nbytes < BACKGROUND_MIN_BYTES:
        return None
    return _version(leaf.obj)


def check_versions(watched: List[Tuple[Leaf, Any, Any]]) -> None:
    """``TensorModifiedError`` when a tensor ``in_place_background_parts``
    read in place was modified since the call (called once the commit and
    the copy from the back have read them all, before the commit is
    published)."""
    for leaf, v, _ in watched:
        hook = _before_background_copy
        if hook is not None:
            hook(leaf.key)
        _check_version(leaf, v)


def in_place_parts(p: Plan) -> List[Any]:
    """The tensors file of ``p`` as a list of buffers whose concatenation
    is the file: the header, then each tensor's bytes read where they are
    (a contiguous CPU tensor or array is not copied; another is made
    contiguous, or copied to the CPU, first). For a save that blocks until
    its commit is durable: the caller's tensors must not change meanwhile."""
    parts: List[Any] = [p.header]
    for leaf in p.leaves:
        if leaf.nbytes == 0:
            continue
        parts.append(_leaf_bytes(leaf))
    return parts


def _leaf_bytes(leaf: Leaf) -> np.ndarray:
    """One leaf's stored bytes as a flat uint8 array, a view of the tensor
    or array where it is contiguous (the bytes ``_copy_leaf`` would put in
    the staging buffer)."""
    if leaf.kind == "torch":
        # as _copy_leaf's byte copy: on the CPU, lazy conj/neg resolved
        t = leaf.obj.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        b = _flat(t).view(torch.uint8).numpy()
        if b.nbytes != leaf.nbytes:  # never store bytes of another length
            raise ValueError(f"tensor {leaf.key!r}: {b.nbytes} bytes, its layout says {leaf.nbytes}")
        return b
    a = np.ascontiguousarray(leaf.obj)
    return a.reshape(-1).view(np.uint8)


def _flat(t):
    """A contiguous tensor as a 1-d view of stride 1. ``reshape(-1)`` keeps
    the stride of a one-element view (``x[:, 0]`` of a 1-row matrix:
    shape (1,), stride (8,)), which torch counts as contiguous but will
    not ``view`` as bytes."""
    return t.as_strided((t.numel(),), (1,))


def _check_version(leaf: Leaf, v: int) -> None:
    seen = _version(leaf.obj)
    if seen != v:
        raise TensorModifiedError(leaf.key, v, -1 if seen is None else seen)


def _copy_leaf(buf: np.ndarray, tbuf, h: int, leaf: Leaf, src: Any = None) -> None:
    """Copy one tensor's bytes (from ``src``, a clone of it, when given) to
    its place in the staging buffer."""
    start = h + leaf.offset
    dst = buf[start : start + leaf.nbytes]
    if leaf.kind == "torch":
        t = (leaf.obj if src is None else src).detach()
        d = tbuf[start : start + leaf.nbytes]
        try:
            d.view(t.dtype).view(t.shape).copy_(t)
        except (RuntimeError, TypeError):
            # dtypes whose views torch refuses: copy their bytes
            src = _flat(t.to("cpu").resolve_conj().resolve_neg().contiguous()).view(torch.uint8)
            d.copy_(src)
    else:
        a = leaf.obj
        if a.dtype.kind == "b" or leaf.st_dtype == "U8" and not _is_u8(leaf):
            np.copyto(dst, np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        else:
            np.copyto(dst.view(a.dtype).reshape(a.shape), a)


# ---------------------------------------------------------------- loading


class NotAState(ValueError):
    """``state.json`` is not one this package wrote (another tool's file)."""


class BadState(ValueError):
    """``state.json`` says it is this package's but is not well formed
    (the message says where): the commit's files were written by hand or
    by another program. The caller raises it as ``CorruptError``."""


#: How deep a state may nest (dicts, lists and tuples; a tensor or number
#: is one level more). ``save`` refuses deeper states (a structure that
#: contains itself among them) and ``load`` deeper ``state.json`` trees,
#: so that neither recurses past Python's stack.
MAX_DEPTH = 200

_FLOAT_WORDS = ("nan", "inf", "-inf")
_TENSOR_KINDS = ("torch", "numpy", "numpy_scalar")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class StateDoc:
    """A parsed ``state.json``: the tree and its tensor nodes by key.

    The whole tree is checked here, once, without recursion: every node
    has a known type and the fields that type needs, of the right JSON
    types, tensors a dtype this build can make and a shape of
    non-negative ints, nesting at most ``MAX_DEPTH`` deep. What ``build``
    then does cannot fail on the tree's form (a tensor's bytes are checked
    against its shape when it is read)."""

    def __init__(self, raw: bytes):
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            # Not JSON: ours only if it names our format (damaged or
            # crafted), else another tool's file.
            if FORMAT.encode("ascii") in raw:
                raise BadState(f"not JSON ({type(e).__name__}: {e})") from None
            raise NotAState(f"state.json is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise NotAState("state.json is not a ckvc Python state")
        v = doc.get("version")
        if not _is_int(v) or v < 1:
            raise BadState(f"version {v!r} is not a version number")
        if v > VERSION:
            raise BadState(f"version {v} is newer than this ckvc reads ({VERSION})")
        tf = doc.get("tensors_file", TENSORS_FILE)
        if not isinstance(tf, str):
            raise BadState("tensors_file is not a string")
        if "root" not in doc:
            raise BadState("no root node")
        self.root = doc["root"]
        self.tensors_file = tf
        self.tensors: Dict[str, Dict[str, Any]] = {}
        self._check(self.root)

    def _check(self, root: Any) -> None:
        stack: List[Tuple[Any, int, str]] = [(root, 1, "root")]
        while stack:
            n, depth, where = stack.pop()
            if depth > MAX_DEPTH:
                raise BadState(f"{where}: nested deeper than {MAX_DEPTH} levels")
            if not isinstance(n, dict):
                raise BadState(f"{where}: a node is not an object")
            t = n.get("type")
            v = n.get("value")

            def need(ok: bool, what: str) -> None:
                if not ok:
                    raise BadState(f"{where}: the {t} node {what}")

            if t == "none":
                pass
            elif t == "bool":
                need(isinstance(v, bool), "has no bool value")
            elif t == "int":
                need(_is_int(v), "has no int value")
            elif t in ("str", "bytes"):
                need(isinstance(v, str), "has no string value")
            elif t == "float":
                need(_is_float_value(v), "has no number value a float holds")
                if "bits" in n:
                    need(v == "nan" and _is_nan_bits(n["bits"]), "has bits that are no NaN's (16 hex digits)")
            elif t == "torch_dtype":
                need(isinstance(v, str) and (not _TORCH or _is_torch_dtype(v)), f"names no torch dtype ({v!r})")
            elif t == "tensor":
                self._check_tensor(n, where)
            elif t in ("list", "tuple"):
                items = n.get("items")
                need(isinstance(items, list), "has no items list")
                for i, c in enumerate(items):
                    stack.append((c, depth + 1, f"{where}.{i}"))
            elif t == "dict":
                items = n.get("items")
                need(isinstance(items, list), "has no items list")
                need(isinstance(n.get("ordered", False), bool), "has a non-bool ordered flag")
                for i, kv in enumerate(items):
                    need(isinstance(kv, list) and len(kv) == 2, f"has an item {i} that is not a [key, value] pair")
                    k = kv[0]
                    # keys are str or int nodes (hashable, one level)
                    need(isinstance(k, dict) and k.get("type") in ("str", "int"), f"has a key {i} that is not a str or int node")
                    stack.append((k, depth + 1, f"{where}.key{i}"))
                    stack.append((kv[1], depth + 1, f"{where}.{i}"))
            else:
                raise BadState(f"{where}: unknown node type {t!r}")

    def _check_tensor(self, n: Dict[str, Any], where: str) -> None:
        key, kind, dtype, shape = n.get("key"), n.get("kind"), n.get("dtype"), n.get("shape")
        if not isinstance(key, str):
            raise BadState(f"{where}: a tensor node has no key")
        if kind not in _TENSOR_KINDS:
            raise BadState(f"{where}: tensor {key!r} has an unknown kind {kind!r}")
        if not isinstance(dtype, str) or _itemsize(kind, dtype) is None:
            raise BadState(f"{where}: tensor {key!r} has a dtype this build cannot make ({dtype!r})")
        if not isinstance(shape, list) or len(shape) > 64 or not all(_is_int(d) and d >= 0 for d in shape):
            raise BadState(f"{where}: tensor {key!r} has no shape of at most 64 non-negative ints")
        if kind == "numpy_scalar" and shape:
            raise BadState(f"{where}: numpy scalar {key!r} has a shape")
        first = self.tensors.setdefault(key, n)
        # Nodes of one key are one tensor (tied weights, saved once): every
        # node gets the object the first one builds, so they must agree.
        if first is not n and (first["kind"], first["dtype"], first["shape"]) != (kind, dtype, shape):
            raise BadState(
                f"{where}: tensor {key!r} is {kind} {dtype} {shape} here but "
                f"{first['kind']} {first['dtype']} {first['shape']} at another node of that key"
            )


def _is_float_value(v: Any) -> bool:
    """True for what a float node's value may be: a JSON number a float
    holds (an integer 10**400 does not), or one of the three words."""
    if isinstance(v, str):
        return v in _FLOAT_WORDS
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _is_torch_dtype(name: str) -> bool:
    try:
        torch_dtype(name)
        return True
    except TypeError:
        return False


def _itemsize(kind: str, dtype: str) -> Optional[int]:
    """Bytes per element of a ``state.json`` tensor of ``kind`` and
    ``dtype``; 0 where this build reads it as raw bytes whatever its width
    (a torch dtype safetensors lacks, without torch installed); None where
    it cannot make that dtype."""
    if kind == "torch":
        if _TORCH:
            try:
                return torch.empty(0, dtype=torch_dtype(dtype)).element_size()
            except TypeError:
                return None
        st = _TORCH_NAMES.get(dtype)
        return np.dtype(_ST_TO_NUMPY[st]).itemsize if st is not None else 0
    try:
        d = np.dtype(dtype)
    except (TypeError, ValueError):
        return None
    if d.hasobject or d.fields is not None or d.subdtype is not None or d.itemsize == 0:
        return None
    return d.itemsize


def tensor_mismatch(node: Dict[str, Any], nbytes: int) -> Optional[str]:
    """Why the ``nbytes`` stored for a checked tensor node cannot hold the
    tensor it describes, or None when they agree."""
    size = _itemsize(node["kind"], node["dtype"]) or 0
    if size == 0:
        return None
    count = 1
    for d in node["shape"]:
        count *= d
    if count * size != nbytes:
        return f"shape {node['shape']} of {node['dtype']} needs {count * size} bytes, the file holds {nbytes}"
    return None


def build(node, get_tensor: Callable[[str, Dict[str, Any]], Any], cache: Dict[str, Any]):
    """The value of a node of a checked ``state.json`` (``StateDoc``);
    tensors from ``get_tensor``, each key once (so tied tensors come back
    as one object)."""
    t = node["type"]
    if t == "none":
        return None
    if t in ("bool", "int", "str"):
        return node["value"]
    if t == "float":
        return _float_value(node)
    if t == "bytes":
        try:
            return base64.b64decode(node["value"], validate=True)
        except ValueError as e:  # binascii.Error
            raise BadState(f"a bytes node is not base64: {e}") from None
    if t == "torch_dtype":
        return torch_dtype(node["value"]) if _TORCH else node["value"]
    if t == "tensor":
        key = node["key"]
        if key not in cache:
            cache[key] = get_tensor(key, node)
        return cache[key]
    if t == "list":
        return [build(c, get_tensor, cache) for c in node["items"]]
    if t == "tuple":
        return tuple(build(c, get_tensor, cache) for c in node["items"])
    if t == "dict":
        d = collections.OrderedDict() if node.get("ordered") else {}
        for k, v in node["items"]:
            d[build(k, get_tensor, cache)] = build(v, get_tensor, cache)
        return d
    raise BadState(f"unknown node type {t!r}")


_ST_TO_NUMPY = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "|i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "|u1",
    "BOOL": "|b1",
    # no numpy dtype: the raw bits
    "BF16": "<u2",
    "F8_E4M3": "|u1",
    "F8_E5M2": "|u1",
}

_ST_TO_TORCH = {v: k for k, v in _TORCH_TO_ST.items()}


def alloc(nbytes: int, kind: str, dtype: str, shape, st_dtype: str):
    """A fresh array of ``nbytes`` bytes and a function that turns it, once
    filled, into the tensor: torch when ``kind`` is torch and torch is
    there, else numpy (for a dtype numpy lacks: its raw bits)."""
    shape = tuple(int(s) for s in shape)
    if _TORCH and kind in ("torch", "any"):
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if kind == "torch":
            tdt = torch_dtype(dtype)
        else:
            tdt = _ST_TO_TORCH.get(st_dtype, torch.uint8)
        return raw.numpy(), lambda: raw.view(tdt).view(shape)
    raw = np.empty(nbytes, dtype=np.uint8)
    if kind in ("numpy", "numpy_scalar"):
        ndt = np.dtype(dtype)
    elif kind == "torch":
        ndt = np.dtype(_ST_TO_NUMPY.get(_TORCH_NAMES.get(dtype, "U8"), "|u1"))
    else:
        ndt = np.dtype(_ST_TO_NUMPY.get(st_dtype, "|u1"))

    def finish():
        a = raw.view(ndt)
        if a.size == int(np.prod(shape, dtype=np.int64)):
            a = a.reshape(shape)
        if kind == "numpy_scalar":
            return a.reshape(())[()]
        return a

    return raw, finish

