"""The guard of a background staging: while ``save(blocking=False)`` copies
large tensors in its thread, an in-place change of one of them made by the
training thread waits for that copy first, so the state stored is the state
at the call whatever the loop does after ``save`` returns.

The guard is a ``TorchFunctionMode`` pushed on the saving thread's (thread
local) torch function stack: every torch call of that thread passes its
``__torch_function__``, which lets calls through at once unless the call
changes a tensor in place (a name ending in one ``_`` such as ``add_``,
``copy_``, ``_foreach_mul_``; ``__setitem__``; the ``.data`` setter; an
``out=`` argument) and that tensor shares storage with a tensor still to be
copied; such a call waits until the staging is done. Forward and backward
passes read parameters and write activations and gradients, so they never
wait. ``optimizer.step()`` waits through its own pre-hook
(``_add_step_hook``).

Not covered (caught afterwards by the version counters, which fail the save
with ``TensorModifiedError`` instead of storing a torn state): changes made
by other threads, changes inside a C++ kernel that writes an argument
without saying so in its name (BatchNorm's running statistics; those are
small and copied in the call), and in-place changes made by code compiled
with ``torch.compile``: Dynamo traces it as if no guard were there, so
that a guard on the stack costs one more compile of the model, not one per
save (an optimizer step still waits in its pre-hook, which runs outside
the graph).

The guard is pushed under the modes already on the saving thread's stack
(``StagingGuard.enter_below``), so their ``with`` blocks pop them, not it,
and is taken out of the stack wherever it sits (``StagingGuard.remove``,
the modes above it staying in order) by that thread once the staging is
done (the next ``save``/``wait``/``load``/``result``/``wait_staged`` or
``optimizer.step()``); until then a finished guard lets every call
through.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Set

import torch
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._device import DeviceContext

# In-place operations whose names do not end in a single "_".
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__delitem__",
        "__set__",  # the .data setter
        "__iadd__",
        "__isub__",
        "__imul__",
        "__imatmul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)


def changes_in_place(name: str, kwargs: Any) -> bool:
    """Whether a torch call named ``name`` may change its first argument
    (or its ``out=``) in place."""
    if name.endswith("_") and not name.endswith("__"):
        return True
    if name in _INPLACE_DUNDERS:
        return True
    return bool(kwargs) and "out" in kwargs


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y


def _not_compiling() -> bool:
    return False


# True while Dynamo traces (a constant there), False when code runs.
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _not_compiling)


def storage_ptr(t: torch.Tensor) -> int:
    """The address of the storage ``t`` is a view of (0 when it has none)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


class StagingGuard(TorchFunctionMode):
    """See the module doc. ``ptrs``: storage addresses of the tensors still
    to copy; ``staged``: set when the copy is done (or failed)."""

    def __init__(self, ptrs: Set[int], staged: threading.Event) -> None:
        super().__init__()
        self.ptrs = ptrs
        self.staged = staged
        self.waits = 0  # calls that waited (tests, benchmarks)

    def _touches(self, args: Any, kwargs: Any) -> bool:
        targets = list(_tensors(args[0])) if args else []
        if kwargs and "out" in kwargs:
            targets.extend(_tensors(kwargs["out"]))
        return any(storage_ptr(t) in self.ptrs for t in targets)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if kwargs is None:
            kwargs = {}
        if _compiling():
            # Dynamo traces modes: reading this guard's state here would
            # make it a guard of the compiled code, and every save (a new
            # guard) a recompile, until Dynamo's recompile limit sends the
            # model back to eager for good. Compiled code is traced as if
            # no guard were there (one extra compile, for the mode on the
            # stack); an in-place change it makes to a tensor being copied
            # is caught by the version counters (``TensorModifiedError``).
            return func(*args, **kwargs)
        if not self.staged.is_set():
            name = getattr(func, "__name__", "")
            if changes_in_place(name, kwargs) and self._touches(args, kwargs):
                self.waits += 1
                self.staged.wait()
        return func(*args, **kwargs)

    def enter_below(self) -> None:
        """Push this guard under the modes already on the calling thread's
        torch function stack (above the ``torch.set_default_device``
        context at its bottom, which must stay there): a mode entered
        before the save (a ``with torch.device(...)`` block too) pops
        itself at the end of its ``with`` block, not this guard (their
        exits pop whatever is on top)."""
        above = [_pop_mode() for _ in range(torch._C._len_torch_function_stack())]  # top first
        default = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
        if above and isinstance(above[-1], DeviceContext) and above[-1] is default:
            _push_mode(above.pop())
        _push_mode(self)
        for mode in reversed(above):
            _push_mode(mode)

    def remove(self) -> None:
        """Remove this guard from the calling thread's torch function stack
        wherever it is (the modes above it stay, in order)."""
        n = torch._C._len_torch_function_stack()
        for i in range(n - 1, -1, -1):
            if torch._C._get_function_stack_at(i) is self:
                above = [_pop_mode() for _ in range(n - 1 - i)]  # top first
                _pop_mode()
                for mode in reversed(above):
                    _push_mode(mode)
                return
