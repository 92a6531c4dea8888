"""scripts/compare_zipnn.py reads the tensors codec-bench reads: every float
tensor of every safetensors file and PyTorch zip below a checkpoint, grouped
by file name, without executing a pickle (its ZipNN runs need zipnn, which
CI does not install; the reading does not)."""

import importlib.util
import json
import os
import struct

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "compare_zipnn.py")


def load_script():
    spec = importlib.util.spec_from_file_location("compare_zipnn", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_safetensors(path, tensors):
    """tensors: {name: (safetensors dtype, shape, raw bytes)}."""
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_every_tensor_file_of_a_checkpoint_is_read_and_grouped_by_file_name(tmp_path):
    torch = pytest.importorskip("torch")
    cz = load_script()
    ck = tmp_path / "run" / "checkpoint-3"
    (ck / "sub").mkdir(parents=True)
    a = np.arange(64, dtype="<f4")
    b = np.arange(32, dtype="<f2")
    write_safetensors(
        ck / "adapter_model.safetensors",
        {
            "lora_A": ("F32", [4, 16], a.tobytes()),
            "half": ("F16", [32], b.tobytes()),
            "tiny": ("F32", [3], a[:3].tobytes()),  # under 16 elements: skipped
            "ids": ("I64", [16], np.arange(16, dtype="<i8").tobytes()),  # not a float
        },
    )
    write_safetensors(ck / "sub" / "model-00002-of-00002.safetensors", {"w": ("BF16", [16], bytes(range(32)))})
    m = torch.arange(20, dtype=torch.float32)
    torch.save({"state": {0: {"exp_avg": m, "step": torch.tensor(1.0)}}}, ck / "optimizer.pt")
    torch.save({"model": {"w": m + 1}, "optimizer": {"m": m + 2}}, ck / "model_optim_rng.pt")
    (ck / "trainer_state.json").write_text("{}")

    groups = cz.load_checkpoint(str(ck))

    assert groups[("fp32", "weights")] == {"adapter_model.safetensors/lora_A": a.tobytes()}
    assert groups[("fp16", "weights")] == {"adapter_model.safetensors/half": b.tobytes()}
    assert groups[("bf16", "weights")] == {
        os.path.join("sub", "model-00002-of-00002.safetensors") + "/w": bytes(range(32))
    }
    # The zips' storages, keyed by their names in the zip; the 0-d step is
    # under 16 elements.
    assert sorted(groups[("fp32", "optimizer")].values()) == [m.numpy().tobytes()]
    assert sorted(groups[("fp32", "mixed")].values()) == sorted([(m + 1).numpy().tobytes(), (m + 2).numpy().tobytes()])
    assert set(groups) == {("fp32", "weights"), ("fp16", "weights"), ("bf16", "weights"), ("fp32", "optimizer"), ("fp32", "mixed")}


def test_file_groups_follow_codec_bench():
    cz = load_script()
    assert cz.file_group("optimizer.pt") == "optimizer"
    assert cz.file_group("optim_states.pt") == "optimizer"
    assert cz.file_group("model_optim_rng.pt") == "mixed"
    assert cz.file_group("adapter_model.safetensors") == "weights"
    assert cz.file_group("model-00001-of-00004.safetensors") == "weights"
