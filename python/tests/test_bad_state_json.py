"""A commit whose state.json names this package's format but is not well
formed (written by hand or by another program and committed with
``commit_dir`` / ``ckvc commit``) loads as a ``CorruptError`` that says
which commit, which file and what is wrong: never a raw KeyError,
TypeError or RecursionError from inside the package, never a wrong value."""

import json
import shutil

import numpy as np
import pytest

import ckvc
from ckvc import _state


@pytest.fixture
def good(repo, tmp_path):
    """A directory as a save of ``{"a": float32[4], "n": 1}`` checks out,
    and its state.json parsed."""
    repo.save({"a": np.arange(4, dtype=np.float32), "n": 1}, step=1)
    out = tmp_path / "good"
    repo.checkout(1, out)
    return out, json.loads((out / _state.STATE_FILE).read_text())


def commit_state(repo, tmp_path, good, text, step):
    """Commit ``good``'s files with state.json replaced by ``text``."""
    d = tmp_path / f"d{step}"
    shutil.copytree(good[0], d)
    (d / _state.STATE_FILE).write_text(text)
    repo.commit_dir(d, step=step)


def nested_lists(doc, n):
    head = json.dumps({k: v for k, v in doc.items() if k != "root"})[:-1]
    return head + ',"root":' + '{"type":"list","items":[' * n + "]}" * n + "}"


def tensor_node(**kw):
    n = {"type": "tensor", "key": "a", "kind": "numpy", "dtype": "<f4", "shape": [4]}
    n.update(kw)
    return n


def with_root(doc, root):
    return json.dumps({**doc, "root": root})


CASES = {
    # what the file holds -> a word the error must say
    "nesting past json's own recursion": (lambda d: nested_lists(d, 100_000), "not JSON"),
    "nesting past MAX_DEPTH": (lambda d: nested_lists(d, _state.MAX_DEPTH + 5), "deeper than"),
    "a tensor node without a key": (lambda d: with_root(d, {"type": "tensor"}), "no key"),
    "items that are not a list": (lambda d: with_root(d, {"type": "list", "items": 5}), "no items list"),
    "a dict item that is not a pair": (lambda d: with_root(d, {"type": "dict", "items": [[1]]}), "pair"),
    "an unhashable dict key": (
        lambda d: with_root(d, {"type": "dict", "items": [[{"type": "list", "items": []}, {"type": "none"}]]}),
        "not a str or int node",
    ),
    "an int node without a value": (lambda d: with_root(d, {"type": "int"}), "no int value"),
    "a bool that is a string": (lambda d: with_root(d, {"type": "bool", "value": "yes"}), "no bool value"),
    "a float that is a word": (lambda d: with_root(d, {"type": "float", "value": "lots"}), "no number value"),
    "a float past a float's range": (lambda d: with_root(d, {"type": "float", "value": 10**400}), "no number value"),
    "nan bits that are no NaN's": (
        lambda d: with_root(d, {"type": "float", "value": "nan", "bits": "3ff0000000000000"}),
        "no NaN's",
    ),
    "nan bits that are not hex": (
        lambda d: with_root(d, {"type": "float", "value": "nan", "bits": "7ff8zz0000000000"}),
        "no NaN's",
    ),
    "bits on a float that is no NaN": (
        lambda d: with_root(d, {"type": "float", "value": 1.5, "bits": "7ff8000000000000"}),
        "no NaN's",
    ),
    "bytes that are not base64": (lambda d: with_root(d, {"type": "bytes", "value": "!!!"}), "base64"),
    "an unknown node type": (lambda d: with_root(d, {"type": "set", "items": []}), "unknown node type"),
    "a node that is not an object": (lambda d: with_root(d, [1, 2]), "not an object"),
    "no root": (lambda d: json.dumps({k: v for k, v in d.items() if k != "root"}), "no root"),
    "a version that is not a number": (lambda d: json.dumps({**d, "version": "x"}), "not a version"),
    "a newer version": (lambda d: json.dumps({**d, "version": 99}), "newer"),
    "an object dtype": (lambda d: with_root(d, tensor_node(dtype="O")), "dtype"),
    "an unknown tensor kind": (lambda d: with_root(d, tensor_node(kind="pickle")), "unknown kind"),
    "a negative dimension": (lambda d: with_root(d, tensor_node(shape=[-4])), "shape"),
    "a shape the bytes cannot hold": (lambda d: with_root(d, tensor_node(shape=[1 << 40])), "bytes"),
    "a tensor the file does not hold": (lambda d: with_root(d, tensor_node(key="zz")), "no tensor"),
    "nodes of one tensor that disagree": (
        lambda d: with_root(d, {"type": "list", "items": [tensor_node(), tensor_node(dtype="<i4", shape=[2, 2])]}),
        "at another node of that key",
    ),
    "damaged JSON that names the format": (lambda d: json.dumps(d)[:-7], "not JSON"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_state_json_loads_as_a_corrupt_error_with_its_place(repo, tmp_path, good, case):
    make, says = CASES[case]
    commit_state(repo, tmp_path, good, make(good[1]), step=2)
    commit = repo.log()[0].id
    with pytest.raises(ckvc.CorruptError) as e:
        repo.load(2)
    assert says in str(e.value), str(e.value)
    assert e.value.commit == commit and e.value.file in (_state.STATE_FILE, _state.TENSORS_FILE)
    assert e.value.reason and e.value.reason_kind == "bad_encoding"
    assert commit[:12] in str(e.value)


def test_nodes_of_one_tensor_that_agree_load_as_one_object(repo, tmp_path, good):
    """Tied weights: two nodes of one key come back as one object."""
    root = {"type": "list", "items": [tensor_node(), tensor_node()]}
    commit_state(repo, tmp_path, good, with_root(good[1], root), step=2)
    a, b = repo.load(2)
    assert a is b
    np.testing.assert_array_equal(np.asarray(a), np.arange(4, dtype=np.float32))


def test_a_state_json_that_names_no_format_still_reads_as_plain_files(repo, tmp_path, good):
    commit_state(repo, tmp_path, good, "not json at all {", step=2)
    back = repo.load(2)
    assert back["state.json"] == b"not json at all {"


def test_saving_a_state_that_contains_itself_is_a_clear_value_error(repo):
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match="contain itself"):
        repo.save({"x": loop}, step=1)
    deep = np.float32(1)
    for _ in range(_state.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper than"):
        repo.save(deep, step=1)
    assert repo.steps() == []


def test_a_state_nested_max_depth_deep_round_trips(repo):
    deep = {"leaf": np.arange(3, dtype=np.int16)}
    for i in range(_state.MAX_DEPTH - 2):
        deep = [deep] if i % 2 else {"k": deep}
    repo.save(deep, step=1)
    back = repo.load(1)
    for i in reversed(range(_state.MAX_DEPTH - 2)):
        back = back[0] if i % 2 else back["k"]
    np.testing.assert_array_equal(back["leaf"], np.arange(3, dtype=np.int16))

