#!/usr/bin/env python3
"""Measure ZipNN (the published peer compressor) on the ckvc codec-benchmark tensors.

Usage:
    python3 scripts/compare_zipnn.py ../shared/corpus/gpt-small
    python3 scripts/compare_zipnn.py ../shared/corpus/gpt-small --json
    python3 scripts/compare_zipnn.py ../shared/corpus/gpt-small --threads 4
    python3 scripts/compare_zipnn.py ../shared/corpus/gpt-small --files > zipnn-files.json

--files: the run kept as ZipNN files, for `ckvc debug repo-bench --peer`.
Every file of every checkpoint is compressed on its own, as ZipNN would store
it: in safetensors files and PyTorch zips (.pt/.pth/.bin) every bf16, fp16
or fp32 tensor of at least 16 elements is compressed with ZipNN (same
settings as below, dtype from the safetensors header or from the storage
types in data.pkl, read without executing the pickle); all the other bytes
of the file (headers, zip structure, pickle, small or other-dtype tensors)
are concatenated and compressed with zstd -19, as are other files whole.
No delta between checkpoints (ZipNN files are independent). Every ZipNN
blob is decompressed and compared. Prints one JSON object on stdout:
  {"codec": "zipnn-files", "bytes": N, "bytes_in": M, "files": K}
(bytes = total compressed bytes, bytes_in = total file bytes).

Input is a directory holding the checkpoint directories of one training run
(e.g. step-0 ... step-600, ordered by the number in the name). Every file
below a checkpoint directory is read as the Rust bench reads it: the bf16,
fp16 and fp32 tensors of safetensors files (model.safetensors, sharded
model-0000N-of-0000M.safetensors, a LoRA run's adapter_model.safetensors)
and of PyTorch zips (.pt/.pth/.bin, storages typed from data.pkl read
without executing it), keyed by the file's path and the tensor's name (the
storage's in a zip). Groups follow codec-bench's rule by file name:
"optimizer" for optimizer files (optimizer.pt, optim_states.pt), "mixed"
for files holding model and optimizer (Megatron's model_optim_rng.pt; the
bench splits those by tensor name, which is not read here), "weights" for
the rest. A dtype's "all" group is every group of it combined (printed
when it has two groups or more, as codec-bench does). As in the
Rust bench, a tensor with fewer than 16 elements is skipped (this drops the
0-d AdamW `step` tensors; no weight tensor of gpt-small is affected).

Modes:
  FULL   every tensor of every checkpoint compressed on its own.
  DELTA  every tensor compressed against the same tensor (same name, same
         byte length) of the previous checkpoint in step order, using ZipNN's
         own delta mode: ZipNN(delta_compressed_type='byte') and
         compress(data, delta_second_data=prev) / decompress(blob,
         delta_second_data=prev). In zipnn 0.5.x that mode XORs the raw bytes
         with the base (numpy) and then runs the normal ZipNN pipeline on the
         XOR; the XOR is inside ZipNN's compress/decompress and therefore
         inside the timed region. Tensors without a predecessor (the first
         checkpoint; the optimizer state of the first checkpoint after an
         empty step-0 optimizer) are not part of DELTA and are counted as
         "no base" in the notes.

ZipNN settings (the authors' defaults for raw byte input): method='AUTO'
(per-chunk Huffman/zstd choice in zipnn_core), input_format='byte',
bytearray_dtype='bfloat16' or 'float32' (selects byte grouping + sign-bit
reordering for that dtype), compression_chunk=256 KiB, compression_threshold
0.95, threads=--threads (default 1 = single-core numbers).

Every tensor is round-tripped and checked byte-exact against the original
bytes. time.perf_counter() wraps only the compress() / decompress() calls.
ratio = compressed bytes / original bytes (summed over the group; ZipNN's
32-byte per-blob header is included). MiB/s = original bytes / time.

Note: zipnn 0.5.x bit-reorders a byte input *in place* during FULL-mode
compress (even an immutable `bytes` object), so each call gets a fresh
bytearray copy made outside the timed region and the round trip is compared
with a pristine copy of the original bytes.

Output: a human table, or with --json a JSON array of rows
  {"mode": "FULL"|"DELTA", "dtype": "bf16"|"fp16"|"fp32",
   "group": "weights"|"optimizer"|"mixed"|"all", "codec": "zipnn", "threads": N,
   "bytes_in": N, "ratio": x, "compress_mib_s": x, "decompress_mib_s": x}
on stdout (notes go to stderr).
"""

import argparse
import json
import os
import re
import struct
import sys
import time
import warnings

MIN_ELEMENTS = 16  # same rule as the Rust bench: fewer elements -> skipped
ZIPNN_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SHORT_DTYPE = {v: k for k, v in ZIPNN_DTYPE.items()}
GROUPS = ("weights", "optimizer", "mixed")


def import_zipnn():
    try:
        with warnings.catch_warnings():
            # importing zipnn imports torch, which may emit deprecation noise
            warnings.simplefilter("ignore")
            import zipnn  # noqa: F401
            from zipnn import ZipNN
    except ImportError as exc:
        sys.exit(
            f"error: the ZipNN Python package is not installed ({exc}).\n"
            "Install it with:  pip install zipnn"
        )
    try:
        from importlib.metadata import version

        ver = version("zipnn")
    except Exception:  # pragma: no cover - metadata missing
        ver = "unknown"
    return ZipNN, ver


def step_number(name):
    nums = re.findall(r"\d+", name)
    return int(nums[-1]) if nums else None


def list_checkpoints(root):
    if not os.path.isdir(root):
        sys.exit(f"error: {root} is not a directory")
    cps = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        n = step_number(name)
        if os.path.isdir(path) and n is not None:
            cps.append((n, name, path))
    cps.sort()
    if not cps:
        sys.exit(f"error: no checkpoint directories (names with a step number) in {root}")
    return cps


def file_group(fname):
    """The codec-bench group of a file's tensors (its rule, by file name):
    "optimizer" for optimizer files (optimizer.pt, optim_states.pt),
    "mixed" for files holding model and optimizer together (Megatron's
    model_optim_rng.pt: the tensors' names are not read here), else
    "weights"."""
    low = fname.lower()
    if "optim" in low:
        return "mixed" if "model" in low else "optimizer"
    return "weights"


def checkpoint_files(cdir):
    """(path, bytes) of every file below a checkpoint directory, in path
    order."""
    for dirpath, _, names in sorted(os.walk(cdir)):
        for fname in sorted(names):
            path = os.path.join(dirpath, fname)
            with open(path, "rb") as f:
                yield path, f.read()


def load_checkpoint(path):
    """{(dtype, group): {key: bytes}} for one checkpoint directory: the
    float tensors of every safetensors file and PyTorch zip below it, keyed
    by the file's path in the checkpoint and the tensor's name (storage key
    in a zip)."""
    groups = {}
    for p, blob in checkpoint_files(path):
        rel = os.path.relpath(p, path)
        for start, end, dt, tname in file_tensor_ranges(p, blob):
            key = (SHORT_DTYPE[dt], file_group(os.path.basename(p)))
            groups.setdefault(key, {})[f"{rel}/{tname}"] = blob[start:end]
    return groups


class Acc:
    def __init__(self):
        self.tensors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.t_comp = 0.0
        self.t_decomp = 0.0

    def add(self, other):
        self.tensors += other.tensors
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.t_comp += other.t_comp
        self.t_decomp += other.t_decomp


def run(root, threads):
    ZipNN, ver = import_zipnn()
    if sys.byteorder != "little":
        sys.exit("error: this script assumes a little-endian host")

    def make(dtype, delta):
        kw = dict(
            method="AUTO",
            input_format="byte",
            bytearray_dtype=ZIPNN_DTYPE[dtype],
            threads=threads,
        )
        if delta:
            kw["delta_compressed_type"] = "byte"
        # separate instances for compression and decompression: ZipNN's
        # decompress() overwrites instance fields from the blob header
        return ZipNN(**kw), ZipNN(**kw)

    codecs = {
        (mode, dtype): make(dtype, mode == "DELTA")
        for mode in ("FULL", "DELTA")
        for dtype in ZIPNN_DTYPE
    }
    keys = [(d, g) for d in ZIPNN_DTYPE for g in GROUPS]
    acc = {(m, d, g): Acc() for m in ("FULL", "DELTA") for d, g in keys}
    no_base = {k: 0 for k in keys}

    def measure(mode, dtype, group, data, base=None):
        comp, decomp = codecs[(mode, dtype)]
        buf = bytearray(data)  # zipnn mutates byte input in place (see docstring)
        if base is None:
            t0 = time.perf_counter()
            blob = comp.compress(buf)
            t1 = time.perf_counter()
            out = decomp.decompress(blob)
            t2 = time.perf_counter()
        else:
            t0 = time.perf_counter()
            blob = comp.compress(buf, delta_second_data=base)
            t1 = time.perf_counter()
            out = decomp.decompress(blob, delta_second_data=base)
            t2 = time.perf_counter()
        if bytes(out) != data:
            raise AssertionError(f"ZipNN {mode} round trip mismatch: {dtype}/{group}")
        a = acc[(mode, dtype, group)]
        a.tensors += 1
        a.bytes_in += len(data)
        a.bytes_out += len(blob)
        a.t_comp += t1 - t0
        a.t_decomp += t2 - t1

    cps = list_checkpoints(root)
    prev = None
    for _, name, path in cps:
        cur = load_checkpoint(path)
        for dtype, group in keys:
            tensors = cur.get((dtype, group), {})
            base_set = prev.get((dtype, group), {}) if prev is not None else {}
            for tname, data in tensors.items():
                measure("FULL", dtype, group, data)
                base = base_set.get(tname)
                if base is not None and len(base) == len(data):
                    measure("DELTA", dtype, group, data, base=base)
                else:
                    no_base[(dtype, group)] += 1
        prev = cur

    rows = []
    for mode in ("FULL", "DELTA"):
        for dtype, group in keys + [(d, "all") for d in ZIPNN_DTYPE]:
            if group == "all":
                # As codec-bench: "all" equal to the only group adds nothing.
                present = [g for g in GROUPS if acc[("FULL", dtype, g)].tensors]
                if len(present) < 2:
                    continue
                a = Acc()
                for g in present:
                    a.add(acc[(mode, dtype, g)])
            else:
                a = acc[(mode, dtype, group)]
            if a.tensors == 0:
                continue
            mib = a.bytes_in / (1 << 20)
            rows.append(
                {
                    "mode": mode,
                    "dtype": dtype,
                    "group": group,
                    "codec": "zipnn",
                    "threads": threads,
                    "bytes_in": a.bytes_in,
                    "ratio": a.bytes_out / a.bytes_in,
                    "compress_mib_s": mib / a.t_comp if a.t_comp > 0 else float("inf"),
                    "decompress_mib_s": mib / a.t_decomp if a.t_decomp > 0 else float("inf"),
                    "_tensors": a.tensors,
                }
            )
    notes = [
        f"zipnn {ver}; ZipNN(method='AUTO', input_format='byte', "
        f"bytearray_dtype='bfloat16'|'float16'|'float32', threads={threads}), defaults otherwise "
        "(compression_chunk=256KiB, compression_threshold=0.95)",
        "FULL: compress(data) / decompress(blob)",
        "DELTA: ZipNN native delta mode, ZipNN(..., delta_compressed_type='byte'); "
        "compress(data, delta_second_data=prev) / decompress(blob, delta_second_data=prev) "
        "(ZipNN XORs with the previous checkpoint's tensor, then compresses the XOR)",
        f"{len(cps)} checkpoints: " + ", ".join(n for _, n, _ in cps),
        "tensors without a base in the previous checkpoint (not in DELTA): "
        + ", ".join(f"{d}/{g}={n}" for (d, g), n in no_base.items() if n),
        f"tensors with < {MIN_ELEMENTS} elements skipped; all round trips byte-exact",
    ]
    return rows, notes


class _Any:
    """Stands for every global a torch pickle names; accepts anything."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Any()

    def __setitem__(self, key, value):
        pass

    def __setstate__(self, state):
        pass


class _StorageScan(__import__("pickle").Unpickler):
    """Reads data.pkl of a torch zip only to learn each storage's type:
    persistent ids are ('storage', <torch.XStorage>, key, location, numel).
    Every global becomes _Any (or the storage type's name), so nothing of
    the pickle is executed."""

    def __init__(self, f):
        super().__init__(f)
        self.storages = {}

    def find_class(self, module, name):
        if module == "torch" and name.endswith("Storage"):
            return name
        return _Any

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
            self.storages[str(pid[2])] = pid[1] if isinstance(pid[1], str) else ""
        return _Any()


STORAGE_DTYPE = {"FloatStorage": ("float32", 4), "BFloat16Storage": ("bfloat16", 2), "HalfStorage": ("float16", 2)}
SAFETENSORS_DTYPE = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}


def file_tensor_ranges(path, blob):
    """[(start, end, zipnn dtype, name)] of the float tensors in a checkpoint
    file (name: the tensor's in safetensors, the storage's in a zip)."""
    import io
    import zipfile

    name = os.path.basename(path)
    out = []
    if name.endswith(".safetensors"):
        (hlen,) = struct.unpack("<Q", blob[:8])
        base = 8 + hlen
        for tname, meta in json.loads(blob[8:base]).items():
            if tname == "__metadata__" or meta["dtype"] not in SAFETENSORS_DTYPE:
                continue
            dt, width = SAFETENSORS_DTYPE[meta["dtype"]]
            start, end = meta["data_offsets"]
            if (end - start) // width >= MIN_ELEMENTS:
                out.append((base + start, base + end, dt, tname))
    elif name.endswith((".pt", ".pth", ".bin")) and zipfile.is_zipfile(io.BytesIO(blob)):
        z = zipfile.ZipFile(io.BytesIO(blob))
        pkl = [i for i in z.infolist() if i.filename.endswith("data.pkl")]
        types = {}
        if pkl:
            scan = _StorageScan(io.BytesIO(z.read(pkl[0])))
            scan.load()
            types = scan.storages
        for info in z.infolist():
            m = re.search(r"(?:^|/)data/(\d+)$", info.filename)
            if not m or info.compress_type != zipfile.ZIP_STORED:
                continue
            kind = STORAGE_DTYPE.get(types.get(m.group(1), ""))
            if kind is None or info.file_size // kind[1] < MIN_ELEMENTS:
                continue
            h = info.header_offset
            fn_len, extra_len = struct.unpack("<HH", blob[h + 26 : h + 30])
            start = h + 30 + fn_len + extra_len
            out.append((start, start + info.file_size, kind[0], info.filename))
    return sorted(out)


def zstd19_len(data):
    if not data:
        return 0
    try:
        import zstandard

        return len(zstandard.ZstdCompressor(level=19).compress(data))
    except ImportError:
        import subprocess

        r = subprocess.run(["zstd", "-19", "-q", "-c"], input=data, stdout=subprocess.PIPE, check=True)
        return len(r.stdout)


def run_files(root, threads):
    ZipNN, ver = import_zipnn()
    codecs = {}
    total_in = total_out = nfiles = 0
    for _, _, cdir in list_checkpoints(root):
        for path, blob in checkpoint_files(cdir):
            rest, pos, out = [], 0, 0
            for start, end, dt, _ in file_tensor_ranges(path, blob):
                rest.append(blob[pos:start])
                pos = end
                if dt not in codecs:
                    kw = dict(method="AUTO", input_format="byte", bytearray_dtype=dt, threads=threads)
                    codecs[dt] = (ZipNN(**kw), ZipNN(**kw))
                comp, decomp = codecs[dt]
                data = blob[start:end]
                z = comp.compress(bytearray(data))  # zipnn mutates byte input in place
                if bytes(decomp.decompress(z)) != data:
                    raise AssertionError(f"ZipNN round trip mismatch in {path}")
                out += len(z)
            rest.append(blob[pos:])
            out += zstd19_len(b"".join(rest))
            total_in += len(blob)
            total_out += out
            nfiles += 1
    print(f"# zipnn {ver}, threads={threads}; {nfiles} files; ratio {total_out / max(total_in, 1):.4f}", file=sys.stderr)
    return {"codec": "zipnn-files", "bytes": total_out, "bytes_in": total_in, "files": nfiles}


def print_table(rows, notes):
    hdr = ("mode", "dtype", "group", "tensors", "bytes_in", "ratio", "comp MiB/s", "decomp MiB/s")
    lines = [
        (
            r["mode"],
            r["dtype"],
            r["group"],
            str(r["_tensors"]),
            str(r["bytes_in"]),
            f"{r['ratio']:.4f}",
            f"{r['compress_mib_s']:.1f}",
            f"{r['decompress_mib_s']:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(hdr)]
    left = {0, 1, 2}

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(fmt(hdr))
    print("  ".join("-" * w for w in widths))
    for l in lines:
        print(fmt(l))
    print()
    for n in notes:
        print("# " + n)


def main():
    ap = argparse.ArgumentParser(
        description="ZipNN ratio/speed on the ckvc codec-benchmark tensors (FULL and DELTA)."
    )
    ap.add_argument("corpus", help="directory of checkpoint directories of one run (e.g. step-0 ... step-600)")
    ap.add_argument("--threads", type=int, default=1, help="ZipNN threads (default 1 = single core)")
    ap.add_argument("--json", action="store_true", help="print a JSON array of rows on stdout")
    ap.add_argument(
        "--files",
        action="store_true",
        help="total bytes of the run kept as per-file ZipNN files (JSON, for ckvc debug repo-bench --peer)",
    )
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be >= 1 (ZipNN treats 0 as 'all cores')")
    if args.files:
        json.dump(run_files(args.corpus, args.threads), sys.stdout)
        sys.stdout.write("\n")
        return

    rows, notes = run(args.corpus, args.threads)
    if args.json:
        for r in rows:
            del r["_tensors"]
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        for n in notes:
            print("# " + n, file=sys.stderr)
    else:
        print_table(rows, notes)


if __name__ == "__main__":
    main()
