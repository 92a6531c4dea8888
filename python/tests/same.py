"""The tests' one comparison of saved and loaded state: the same nested
structure (dict keys in the same order, lists and tuples of the same
type and length) and tensors and arrays equal bit for bit, with their
dtype and shape."""

from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # the tests that need torch skip without it
    torch = None


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Assert `b` is `a` as a lossless round trip keeps it; `path` names
    where in the structure a difference is."""
    if torch is not None and isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
