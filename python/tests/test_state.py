"""Round trips of nested states through save/load and open/get_tensor."""

import collections
import json
import math

import numpy as np
import pytest

import ckvc


def test_numpy_only_round_trip(repo):
    state = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "nested": {0: [np.zeros((0, 3), dtype=np.float64), (np.int8(-3), np.array(7, dtype=np.int64))], "s": "x"},
        "flags": np.array([True, False, True]),
        "f16": np.linspace(0, 1, 5, dtype=np.float16),
        "u": {"u16": np.arange(4, dtype=np.uint16), "u32": np.arange(4, dtype=np.uint32), "u64": np.arange(4, dtype=np.uint64)},
        "c64": np.array([1 + 2j, -3j], dtype=np.complex64),
        "be": np.arange(3, dtype=">i4"),
        "nc": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],
        "scalars": [1, 2.5, float("nan"), float("inf"), -float("inf"), None, True, "str", b"\x00\xff", 2**70],
    }
    c = repo.save(state, step=1, message="np", metrics={"loss": 1.5})
    assert isinstance(c, ckvc.Commit) and c.step == 1 and c.metrics == {"loss": 1.5}
    back = repo.load(1)
    assert set(back) == set(state)
    np.testing.assert_array_equal(back["w"], state["w"])
    assert back["w"].dtype == np.float32
    assert 0 in back["nested"] and isinstance(back["nested"][0][1], tuple)
    assert back["nested"][0][0].shape == (0, 3)
    assert back["nested"][0][1][0] == -3 and isinstance(back["nested"][0][1][0], np.int8)
    assert back["nested"][0][1][1].shape == () and back["nested"][0][1][1] == 7
    for k in ["flags", "f16", "c64", "be", "nc"]:
        np.testing.assert_array_equal(back[k], state[k])
        assert back[k].dtype == state[k].dtype, k
    for k, v in state["u"].items():
        np.testing.assert_array_equal(back["u"][k], v)
        assert back["u"][k].dtype == v.dtype
    s = back["scalars"]
    assert s[0] == 1 and s[1] == 2.5 and math.isnan(s[2]) and s[3] == math.inf and s[4] == -math.inf
    assert s[5:] == [None, True, "str", b"\x00\xff", 2**70]
    assert isinstance(s[6], bool)


def test_a_float_nan_keeps_its_sign_and_payload_and_a_plain_nan_node_still_loads(repo, tmp_path):
    import struct

    def bits(x):
        return struct.pack(">d", x).hex()

    nans = [float("nan"), -float("nan"), struct.unpack(">d", bytes.fromhex("7ff4000000000123"))[0],
            struct.unpack(">d", bytes.fromhex("fff0000000000001"))[0]]
    repo.save({"nans": nans, "x": np.zeros(2, dtype=np.float32)}, step=1)
    back = repo.load(1)["nans"]
    assert [bits(x) for x in back] == [bits(x) for x in nans]
    # A state.json written before NaN nodes had bits: Python's own NaN.
    out = tmp_path / "co"
    repo.checkout(1, out)
    doc = json.loads((out / "state.json").read_text())
    for n in doc["root"]["items"][0][1]["items"]:
        assert n["type"] == "float" and n["value"] == "nan" and "bits" in n
        del n["bits"]
    (out / "state.json").write_text(json.dumps(doc))
    repo.commit_dir(out, step=2)
    assert all(bits(x) == bits(float("nan")) for x in repo.load(2)["nans"])


# docs/format/python-state.md, byte for byte: one node of every type.
PINNED_STATE_JSON = (
    '{"format":"ckvc-python-state","version":1,"tensors_file":"tensors.safetensors","root":{"type":"dict","items":['
    '[{"type":"str","value":"n"},{"type":"none"}],'
    '[{"type":"str","value":"b"},{"type":"bool","value":true}],'
    '[{"type":"str","value":"i"},{"type":"int","value":-7}],'
    '[{"type":"str","value":"big"},{"type":"int","value":1180591620717411303424}],'
    '[{"type":"str","value":"f"},{"type":"float","value":1.5}],'
    '[{"type":"str","value":"nan"},{"type":"float","value":"nan","bits":"fff8000000000001"}],'
    '[{"type":"str","value":"inf"},{"type":"float","value":"inf"}],'
    '[{"type":"str","value":"s"},{"type":"str","value":"x"}],'
    '[{"type":"str","value":"by"},{"type":"bytes","value":"AP8="}],'
    '[{"type":"str","value":"l"},{"type":"list","items":[{"type":"int","value":1},'
    '{"type":"tuple","items":[{"type":"int","value":2},{"type":"int","value":3}]}]}],'
    '[{"type":"str","value":"d"},{"type":"dict","items":[[{"type":"int","value":3},{"type":"str","value":"a"}]]}],'
    '[{"type":"str","value":"od"},{"type":"dict","items":[[{"type":"str","value":"z"},{"type":"int","value":1}]],"ordered":true}],'
    '[{"type":"str","value":"t"},{"type":"tensor","key":"t","kind":"numpy","dtype":"<f4","shape":[3]}]]}}'
)
PINNED_TENSORS = bytes.fromhex(
    "7800000000000000"
    + b'{"__metadata__":{"format":"ckvc-python-state","version":"1"},'
    b'"t":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}     '.hex()
    + "000000000000803f00000040"
)


def test_state_json_and_tensors_file_bytes_are_pinned(repo, tmp_path):
    import struct

    nan = struct.unpack(">d", bytes.fromhex("fff8000000000001"))[0]
    state = {
        "n": None, "b": True, "i": -7, "big": 2**70, "f": 1.5, "nan": nan, "inf": float("inf"), "s": "x",
        "by": b"\x00\xff", "l": [1, (2, 3)], "d": {3: "a"}, "od": collections.OrderedDict(z=1),
        "t": np.arange(3, dtype=np.float32),
    }
    repo.save(state, step=1)
    out = tmp_path / "out"
    repo.checkout(1, out)
    assert (out / "state.json").read_text() == PINNED_STATE_JSON
    assert (out / "tensors.safetensors").read_bytes() == PINNED_TENSORS
    # And the pinned files load as that state.
    d = tmp_path / "pinned"
    d.mkdir()
    (d / "state.json").write_text(PINNED_STATE_JSON)
    (d / "tensors.safetensors").write_bytes(PINNED_TENSORS)
    repo.commit_dir(d, step=2)
    back = repo.load(2)
    assert struct.pack(">d", back.pop("nan")).hex() == "fff8000000000001"
    t = back.pop("t")
    np.testing.assert_array_equal(t, state.pop("t"))
    state.pop("nan")
    assert back == state and type(back["od"]) is collections.OrderedDict and type(back["l"][1]) is tuple


def _raw(t):
    """A tensor's bytes (any dtype, any strides) as a uint8 tensor."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def test_torch_round_trip_every_dtype(repo):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    dtypes = [
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    ]
    for name in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"]:
        if hasattr(torch, name):
            dtypes.append(getattr(torch, name))
    tensors = {}
    for dt in dtypes:
        base = torch.randn(3, 5, generator=g) * 4
        if dt.is_complex:
            t = torch.complex(base, base.flip(0)).to(dt)
        elif dt == torch.bool:
            t = base > 0
        elif dt.is_floating_point:
            t = base.to(dt)
        else:
            t = base.abs().to(torch.int64).to(dt)
        key = str(dt).replace("torch.", "")
        tensors[key] = t
        tensors[key + "_0d"] = t[1, 2].clone()
        tensors[key + "_empty"] = t[:0]
    w = torch.randn(6, 4, generator=g)
    state = {
        "t": tensors,
        "views": {"T": w.t(), "slice": w[1:4, ::2], "expanded": torch.arange(3.0).expand(4, 3)},
        "ordered": collections.OrderedDict([("b", torch.ones(2)), ("a", torch.zeros(2))]),
        "step": 3,
        "dtype": torch.float16,
    }
    repo.save(state, step=5)
    back = repo.load(5)
    for k, v in tensors.items():
        b = back["t"][k]
        assert isinstance(b, torch.Tensor) and b.dtype == v.dtype and b.shape == v.shape, k
        assert torch.equal(_raw(b), _raw(v)), k
    for k, v in state["views"].items():
        assert torch.equal(back["views"][k], v)
    assert isinstance(back["ordered"], collections.OrderedDict) and list(back["ordered"]) == ["b", "a"]
    assert back["step"] == 3 and back["dtype"] == torch.float16


def test_a_blocking_save_reads_tensors_in_place_and_stores_what_staging_stores(repo):
    torch = pytest.importorskip("torch")
    from ckvc import _state

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 33, generator=g)
    z = torch.complex(torch.randn(5, generator=g), torch.randn(5, generator=g))
    state = {
        "w": w,
        "bf16": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "views": {"T": w.t(), "slice": w[3:9, ::2], "expanded": torch.arange(3.0).expand(4, 3)},
        "conj": z.conj(),
        "neg": torch._neg_view(torch.randn(4, generator=g)),
        "flags": torch.randn(6, generator=g) > 0,
        "step": torch.tensor(3.0),
        "np": {"be": np.arange(5, dtype=">i4"), "nc": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]},
    }
    p = _state.plan(state)
    parts = _state.in_place_parts(p)
    assert bytes(parts[0]) == p.header
    by_key = {leaf.key: part for leaf, part in zip([x for x in p.leaves if x.nbytes], parts[1:])}
    assert by_key["w"].ctypes.data == w.data_ptr(), "a contiguous tensor is read where it is"
    assert sum(len(memoryview(x).cast("B")) for x in parts) == p.file_len
    repo.save(state, step=1)
    repo.save(state, step=2, blocking=False, staging="sync").result()
    with repo.open(1) as a, repo.open(2) as b:
        assert a.read_file(_state.TENSORS_FILE) == b.read_file(_state.TENSORS_FILE)
    back = repo.load(1)
    assert torch.equal(back["conj"], z.conj().resolve_conj())
    assert torch.equal(back["neg"], state["neg"].resolve_neg())
    assert torch.equal(back["views"]["slice"], w[3:9, ::2])


def test_shared_storage_is_stored_once_and_stays_tied(repo):
    torch = pytest.importorskip("torch")
    emb = torch.randn(50, 8)
    state = {"model": {"wte.weight": emb, "lm_head.weight": emb}, "other": emb[0]}
    repo.save(state, step=1)
    with repo.open(1) as ck:
        keys = ck.keys()
    assert keys.count("model.wte.weight") == 1 and "model.lm_head.weight" not in keys
    back = repo.load(1)
    assert back["model"]["wte.weight"] is back["model"]["lm_head.weight"]
    assert torch.equal(back["other"], emb[0])
    # a tied pair of a module keeps its tie through load_state_dict
    m = torch.nn.Linear(8, 50, bias=False)
    m.weight = torch.nn.Parameter(emb.clone())
    repo.save({"m": m.state_dict()}, step=2)
    assert torch.equal(repo.load(2)["m"]["weight"], m.weight.detach())


def test_key_collisions_get_a_suffix(repo):
    a, b = np.ones(2, np.float32), np.zeros(3, np.float32)
    state = {"a.b": a, "a": {"b": b}}
    repo.save(state, step=1)
    with repo.open(1) as ck:
        keys = ck.keys()
        assert sorted(keys) == ["a.b", "a.b#1"]
        assert {tuple(ck.get_tensor(k).shape) for k in keys} == {(2,), (3,)}
    back = repo.load(1)
    np.testing.assert_array_equal(back["a.b"], a)
    np.testing.assert_array_equal(back["a"]["b"], b)


def test_lazy_open_reads_one_tensor(repo):
    torch = pytest.importorskip("torch")
    state = {"model": {"fc": {"weight": torch.randn(64, 32), "bias": torch.randn(64)}}, "optim": {"state": {0: {"exp_avg": torch.ones(3)}}}}
    repo.save(state, step=10)
    with repo.open(10) as ck:
        assert set(ck.keys()) == {"model.fc.weight", "model.fc.bias", "optim.state.0.exp_avg"}
        assert torch.equal(ck.get_tensor("model.fc.weight"), state["model"]["fc"]["weight"])
        assert torch.equal(ck.get_tensor("optim.state.0.exp_avg"), torch.ones(3))
        with pytest.raises(KeyError):
            ck.get_tensor("nope")


def test_unsupported_objects_are_refused_not_pickled(repo):
    class Thing:
        pass

    with pytest.raises(TypeError):
        repo.save({"x": Thing()}, step=1)
    with pytest.raises(TypeError):
        repo.save({(1, 2): 3}, step=1)
    assert repo.steps() == []


def test_state_json_is_data(repo, tmp_path):
    repo.save({"x": np.ones(3, np.float32), "n": 1}, step=1)
    out = tmp_path / "out"
    repo.checkout(1, out)
    doc = json.loads((out / "state.json").read_text())
    assert doc["format"] == "ckvc-python-state" and doc["version"] == 1
    raw = (out / "tensors.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["x"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}


def test_log_steps_and_errors(repo, tmp_path):
    assert repo.steps() == [] and repo.log() == []
    c1 = repo.save({"a": np.zeros(4)}, step=1, message="first")
    c2 = repo.save({"a": np.ones(4)}, step=2, metrics={"loss": 0.5})
    assert repo.steps() == [1, 2]
    log = repo.log()
    assert [c.id for c in log] == [c2.id, c1.id]
    assert log[1].message == "first" and log[0].metrics == {"loss": 0.5}
    assert len(log[0].id) == 64 and log[0].logical_bytes > 0 and log[0].time > 0
    with pytest.raises(ckvc.NotFoundError):
        repo.load(7)
    with pytest.raises(ckvc.StepOrderError) as e:
        repo.save({"a": np.ones(4)}, step=1)
    assert e.value.step == 1 and e.value.head_step == 2
    assert isinstance(e.value, ckvc.CkvcError)
    with pytest.raises(ckvc.NotFoundError):
        ckvc.Repository(tmp_path / "nowhere")
    # a commit id prefix and the branch name resolve too
    assert repo.load(c1.id[:10])["a"].sum() == 0
    assert repo.load("main")["a"].sum() == 4


def test_rocksdb_checksums_with_ckvcs_crc_in_the_extension(repo):
    # The extension module defines librocksdb's CRC32C function (the CPU's
    # CRC instruction in place of a table loop): a save's RocksDB writes
    # must have gone through it, and the state must read back.
    from ckvc import _ckvc

    before = _ckvc.rocksdb_crc_calls()
    state = {"w": np.arange(300_000, dtype=np.float32)}
    repo.save(state, step=1)
    assert _ckvc.rocksdb_crc_calls() > before
    np.testing.assert_array_equal(repo.load(1)["w"], state["w"])


def test_commit_buffers_check_that_raises_abandons_the_commit_with_its_exception(repo):
    from ckvc import _ckvc

    class Changed(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        raise Changed("a tensor changed while it was read")

    data = np.arange(100_000, dtype=np.float32).tobytes()
    with pytest.raises(Changed, match="changed while it was read"):
        _ckvc.commit_buffers(repo.path, [("w.bin", data)], 1, check=check)
    assert calls == [1] and repo.steps() == []
    d = _ckvc.commit_buffers(repo.path, [("w.bin", data)], 1, check=lambda: calls.append(2))
    assert calls == [1, 2] and repo.steps() == [1] and d["step"] == 1


def test_init_without_row_frames_stores_alike_rows_as_plain_frames(tmp_path):
    # Rows alike up to scale (Adam's moments of an embedding): a row frame
    # by default, plain with row_frames=False (`ckvc init --no-row-frames`);
    # both load back bit for bit.
    rng = np.random.default_rng(0)
    direction = rng.standard_normal(256).astype(np.float32)
    scale = np.exp2(rng.uniform(-7, -6, size=(1024, 1))).astype(np.float32)
    noise = rng.standard_normal((1024, 256)).astype(np.float32) * np.float32(1e-4)
    state = {"exp_avg": (scale * (direction + noise)).astype(np.float32)}
    stored = {}
    for row_frames in (True, False):
        r = ckvc.Repository.init(tmp_path / str(row_frames), row_frames=row_frames)
        stored[row_frames] = r.save(state, step=1).stored_bytes
        back = r.load(1)
        assert back["exp_avg"].tobytes() == state["exp_avg"].tobytes()
    assert stored[True] < stored[False] * 0.9, stored


def test_a_tensor_path_that_is_not_unicode_is_refused_at_save(repo):
    # Was: InvalidInputError "tensors.safetensors: corrupt at byte 8", as if
    # the repository's file were damaged. A str value is data, and stays.
    with pytest.raises(ValueError, match="valid Unicode"):
        repo.save({"\ud800": np.ones(3, np.float32)}, step=1)
    repo.save({"name": "\ud800", "w": np.ones(3, np.float32)}, step=1)
    assert repo.load(1)["name"] == "\ud800"


def test_a_step_past_u64_is_a_value_error_not_an_overflow(repo, tmp_path):
    # Was: OverflowError from the binding's conversion.
    with pytest.raises(ValueError, match="largest step"):
        repo.save({"a": 1}, step=1 << 64)
    d = tmp_path / "d"
    d.mkdir()
    (d / "f.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="largest step"):
        repo.commit_dir(d, step=1 << 64)
    with pytest.raises(TypeError):
        repo.commit_dir(d, step=-1)
    repo.save({"a": 1}, step=(1 << 64) - 1)
    assert repo.steps() == [(1 << 64) - 1]


def test_a_checkpoint_used_after_its_with_block_is_a_value_error(repo):
    # Was: AttributeError "'NoneType' object has no attribute ...".
    repo.save({"a": np.ones(3, np.float32)}, step=1)
    with repo.open(1) as ck:
        assert ck.get_tensor("a").shape == (3,)
    assert ck.keys() == ["a"]
    for read in (lambda: ck.get_tensor("a"), lambda: ck.commit, lambda: ck.read_file("state.json")):
        with pytest.raises(ValueError, match="closed"):
            read()


def test_init_on_a_file_and_commit_dir_of_a_missing_directory_are_invalid_input(tmp_path):
    # Was: FileExistsError (Python's, from os.makedirs) and a plain CkvcError.
    f = tmp_path / "a-file"
    f.write_bytes(b"x")
    for p in (f, f / "sub"):
        with pytest.raises(ckvc.InvalidInputError) as e:
            ckvc.Repository.init(p)
        assert e.value.path == str(p)
    repo = ckvc.Repository.init(tmp_path / "new" / "repo")
    with pytest.raises(ckvc.InvalidInputError, match="no such directory"):
        repo.commit_dir(tmp_path / "nope", step=1)
    assert repo.steps() == []
