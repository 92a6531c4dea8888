//! Writes seed corpora for the fuzz targets in `fuzz/` from real data:
//! `cargo run --example fuzz_seeds -- [corpus dir] [out dir]`, by default
//! `../shared/corpus/gpt-small` and `fuzz/corpus`. The output is git-ignored;
//! rerun this after a clean checkout before `cargo +nightly fuzz run`.
//!
//! - `decode/`: frames of slices of real bf16 and fp32 tensors (several
//!   slice lengths, up to 12 Ki elements, dtypes and tails), with and
//!   without the previous checkpoint's slice as a base, default and LMC
//!   options.
//! - `roundtrip/`: the same slices (and bases) as round-trip inputs.
//! - `format_parse/`: the small real files (trainer_state.json,
//!   step-0/optimizer.pt, `tests/fixtures/format/*`) and small safetensors
//!   and npy files cut from the real checkpoints.

#[path = "../tests/fuzz_checks/mod.rs"]
mod fuzz_checks;

use std::path::{Path, PathBuf};

use ckvc::codec::{self, DType, ElementMap, Options};
use ckvc::format::{self, Segment};

use fuzz_checks::{decode_input, format_parse_input, roundtrip_input};

/// Name selectors in `fuzz_checks::FILE_NAMES`.
const SAFETENSORS: usize = 0;
const PT: usize = 1;
const BIN: usize = 2;
const NPY: usize = 3;
const TXT: usize = 4;

struct Tensor {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let corpus = PathBuf::from(args.get(1).map_or("../shared/corpus/gpt-small", |s| s));
    let out = PathBuf::from(args.get(2).map_or("fuzz/corpus", |s| s));
    let mut seeds = Seeds::new(&out);

    // step-0 -> step-60 is the first delta a real repository stores.
    for file in ["model.bf16.safetensors", "model.safetensors"] {
        let old = tensors(&corpus.join("step-0").join(file));
        let new = tensors(&corpus.join("step-60").join(file));
        for (i, t) in new.iter().enumerate() {
            // Every fifth tensor keeps the corpus small; five does not
            // divide the twelve tensors of a block, so weights, biases and
            // norms all come up.
            if i % 5 != 0 {
                continue;
            }
            let base = old.iter().find(|o| o.name == t.name).map(|o| &o.data);
            for len in [96, 1000, 6000] {
                let len = len.min(t.data.len());
                let raw = &t.data[..len];
                let base = base.map(|b| &b[..len]);
                for lmc in [false, true] {
                    seeds.codec(t.dtype, lmc, raw, None);
                    if let Some(b) = base {
                        seeds.codec(t.dtype, lmc, raw, Some(b));
                    }
                }
            }
        }
        // Other dtypes and a tail: the same bytes, reinterpreted.
        let t = &new[1];
        let b = &old
            .iter()
            .find(|o| o.name == t.name)
            .expect("same tensors")
            .data;
        for dtype in [DType::U8, DType::I16, DType::F16, DType::I32, DType::F64] {
            for len in [61, 2051] {
                seeds.codec(dtype, false, &t.data[..len], Some(&b[..len]));
            }
        }
        // A delta of 12 Ki elements: blocks of 8-16 Ki symbols, which
        // have 32 rANS states from format version 11.
        if let Some(t) = new
            .iter()
            .find(|t| t.data.len() >= 12 * 1024 * t.dtype.width())
        {
            let len = 12 * 1024 * t.dtype.width();
            if let Some(b) = old.iter().find(|o| o.name == t.name) {
                seeds.codec(t.dtype, false, &t.data[..len], Some(&b.data[..len]));
            }
        }
        // A zstd block (format version 5): a row of 256 symbols of 23
        // values, unevenly (evenly spread 16 values would be bit-packed
        // before zstd is tried), repeated.
        let row: Vec<u8> = (0..256u32).map(|i| (i * i % 23) as u8).collect();
        seeds.codec(DType::U8, false, &row.repeat(16), None);
        // An RNG state (format version 6): 32-bit words in 64-bit slots,
        // stored as u8; grouped by 8-byte words, one zstd frame.
        let words: Vec<u8> = (0..200u64)
            .flat_map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32).to_le_bytes())
            .collect();
        seeds.codec(DType::U8, false, &words, None);
        // Palette frames (format version 6, transform bit 7): the tensor's
        // values quantized to 3, 16 and 200 levels, as f32 and bf16 (the
        // encoder picks the palette for these), with a tail; round trips
        // with the palette forced (flags bit 6).
        for levels in [3u32, 16, 200] {
            let q: Vec<u8> = t
                .data
                .chunks_exact(4)
                .take(1500)
                .enumerate()
                .flat_map(|(i, _)| ((i as u32 * 7919 % levels) as f32 * 0.01).to_le_bytes())
                .collect();
            for (dtype, bytes) in [(DType::F32, q.clone()), (DType::BF16, q[..2999].to_vec())] {
                seeds.codec(dtype, false, &bytes, None);
                let mut rt = roundtrip_input(dtype, false, &bytes, None);
                rt[1] |= 1 << 6;
                seeds.write("roundtrip", rt);
            }
        }
        // Sparse blocks (format version 7): 4096 u8 all 0 but a few, as
        // blocks (no element map, no whole-chunk zstd); and an f32 delta
        // whose elements all move by a few ULPs but one in ~100 by many,
        // so that its top streams are 0 but in a few places.
        let mut few = vec![0u8; 4096];
        for i in (7..4096).step_by(301) {
            few[i] = (i % 5) as u8 + 1;
        }
        let blocks = Options {
            element_map: ElementMap::Never,
            small_zstd_max: 0,
            regroup: false,
            ..Options::default()
        };
        let frame = codec::encode(&few, None, DType::U8, &blocks);
        seeds.write("decode", decode_input(&frame, None));
        let mut rt = roundtrip_input(DType::U8, false, &few, None);
        rt[1] |= 3 << 4;
        seeds.write("roundtrip", rt);
        let base: Vec<u32> = t
            .data
            .chunks_exact(4)
            .take(8192)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let moved: Vec<u8> = base
            .iter()
            .enumerate()
            .flat_map(|(i, &b)| {
                let h = (i as u32).wrapping_mul(2_654_435_761);
                let d = if h % 97 == 0 {
                    70_000 + (h >> 12)
                } else {
                    1 + (h >> 25)
                };
                b.wrapping_add(d).to_le_bytes()
            })
            .collect();
        let base: Vec<u8> = base.iter().flat_map(|b| b.to_le_bytes()).collect();
        let n = moved.len().min(base.len());
        seeds.codec(DType::F32, false, &moved[..n], Some(&base[..n]));
        // Row frames (format version 8): 40 rows of 16 elements of a real
        // tensor after a lead of 5, forced; the round trip seeds ask for
        // rows of 16 (dtype byte + 15 * 14, flags bit 7).
        let len = 5 + 40 * 16;
        let raw = &t.data[..len * t.dtype.width()];
        let always = Options {
            rows: codec::RowFrames::Always,
            ..Options::default()
        };
        let mut frame = Vec::new();
        let rows = codec::Rows { len: 16, lead: 5 };
        codec::encode_shaped_into(
            raw,
            None,
            t.dtype,
            Some(rows),
            &always,
            &mut frame,
            &mut codec::Scratch::default(),
        );
        assert!(codec::FrameInfo::parse(&frame).is_ok_and(|i| i.rows));
        seeds.write("decode", decode_input(&frame, None));
        let mut rt = roundtrip_input(t.dtype, false, raw, None);
        rt[0] += 15 * 14;
        rt[1] |= 1 << 7;
        seeds.write("roundtrip", rt);
        // More than one 64 KiB block per stream (no base: the decode seed's
        // base would need a u16-length frame).
        let big = &t.data[..t.data.len().min(200_000)];
        let frame = codec::encode(big, None, DType::U8, &Options::default());
        seeds.write("decode", decode_input(&frame, None));
        // Round trips of blocks of 16 Ki symbols or more, with the base:
        // their rANS blocks have 32 states and take the AVX2 kernels.
        // (libFuzzer keeps inputs short unless run with `-len_control=0
        // -max_len=300000`.)
        for t in new
            .iter()
            .filter(|t| t.data.len() >= 40_000 * t.dtype.width())
        {
            let len = 40_000 * t.dtype.width();
            if let Some(o) = old.iter().find(|o| o.name == t.name) {
                seeds.write(
                    "roundtrip",
                    roundtrip_input(t.dtype, false, &t.data[..len], Some(&o.data[..len])),
                );
            }
        }
    }

    // Real small files, under their own name and a few others.
    let real = [
        (
            corpus.join("step-0/trainer_state.json"),
            &[TXT, SAFETENSORS, NPY][..],
        ),
        (corpus.join("step-0/optimizer.pt"), &[PT, BIN][..]),
        ("tests/fixtures/format/small.pt".into(), &[PT, BIN][..]),
        ("tests/fixtures/format/rezipped.pt".into(), &[PT][..]),
        ("tests/fixtures/format/legacy.bin".into(), &[BIN][..]),
        ("tests/fixtures/format/names.pkl".into(), &[BIN, TXT][..]),
    ];
    for (path, names) in real {
        let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for &n in names {
            seeds.write("format_parse", format_parse_input(n, &file));
        }
    }
    // Small safetensors and npy files made of real tensors.
    let bf16 = tensors(&corpus.join("step-60/model.bf16.safetensors"));
    let small: Vec<&Tensor> = bf16.iter().filter(|t| t.data.len() <= 1024).collect();
    for k in [1, 3, 8] {
        let file = safetensors(&small[..k]);
        seeds.write("format_parse", format_parse_input(SAFETENSORS, &file));
    }
    for t in &small[..3] {
        for fortran in [false, true] {
            seeds.write("format_parse", format_parse_input(NPY, &npy(t, fortran)));
        }
    }
    seeds.report();
}

/// The tensors of a safetensors file, read through `format::parse`.
fn tensors(path: &Path) -> Vec<Tensor> {
    let file = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .expect("file name");
    let layout = format::parse(name, &mut std::io::Cursor::new(&file), file.len() as u64)
        .expect("corpus files parse");
    layout
        .segments
        .iter()
        .filter_map(|s| match s {
            Segment::Tensor(t) => Some(Tensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: file[t.offset as usize..(t.offset + t.len) as usize].to_vec(),
            }),
            Segment::Opaque { .. } => None,
        })
        .collect()
}

fn safetensors(ts: &[&Tensor]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut data = Vec::new();
    for t in ts {
        let start = data.len();
        data.extend_from_slice(&t.data);
        header.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.dtype.safetensors_name(),
                "shape": t.shape,
                "data_offsets": [start, data.len()],
            }),
        );
    }
    let header = serde_json::to_vec(&header).expect("json");
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    file
}

fn npy(t: &Tensor, fortran: bool) -> Vec<u8> {
    // numpy has no bf16: store the bytes as '<f2' of the same shape.
    let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
    let shape = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!("({})", shape.join(", ")),
    };
    let order = if fortran { "True" } else { "False" };
    let mut dict = format!("{{'descr': '<f2', 'fortran_order': {order}, 'shape': {shape}, }}");
    // numpy pads the header so the data starts at a multiple of 64.
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut file = b"\x93NUMPY\x01\x00".to_vec();
    file.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    file.extend_from_slice(dict.as_bytes());
    file.extend_from_slice(&t.data);
    file
}

struct Seeds {
    out: PathBuf,
    count: std::collections::BTreeMap<&'static str, usize>,
}

impl Seeds {
    fn new(out: &Path) -> Seeds {
        Seeds {
            out: out.to_path_buf(),
            count: Default::default(),
        }
    }

    /// A decode seed (the frame, against its base) and a round-trip seed.
    fn codec(&mut self, dtype: DType, lmc: bool, raw: &[u8], base: Option<&[u8]>) {
        let opts = if lmc {
            Options::lmc()
        } else {
            Options::default()
        };
        let frame = codec::encode(raw, base, dtype, &opts);
        let needs_base = codec::FrameInfo::parse(&frame)
            .expect("valid frame")
            .needs_base();
        self.write("decode", decode_input(&frame, base.filter(|_| needs_base)));
        self.write("roundtrip", roundtrip_input(dtype, lmc, raw, base));
        if !lmc {
            self.element_maps(dtype, raw, base);
        }
    }

    /// Element maps (format version 4): the slice with a map forced, and a
    /// copy whose every other run of 64 elements is zero (or the base's),
    /// where the encoder chooses one; round trips with the map forced
    /// (flags bit 3).
    fn element_maps(&mut self, dtype: DType, raw: &[u8], base: Option<&[u8]>) {
        let always = Options {
            element_map: ElementMap::Always,
            ..Options::default()
        };
        let run = 64 * dtype.width();
        let mut holed = raw.to_vec();
        for (i, c) in holed
            .chunks_mut(run)
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
        {
            match base {
                Some(b) => c.copy_from_slice(&b[i * run..i * run + c.len()]),
                None => c.fill(0),
            }
        }
        for (bytes, opts) in [(raw, &always), (&holed[..], &Options::default())] {
            let frame = codec::encode(bytes, base, dtype, opts);
            let needs_base = codec::FrameInfo::parse(&frame)
                .expect("valid frame")
                .needs_base();
            self.write("decode", decode_input(&frame, base.filter(|_| needs_base)));
            let mut rt = roundtrip_input(dtype, false, bytes, base);
            rt[1] |= 1 << 3;
            self.write("roundtrip", rt);
        }
    }

    /// Writes one seed, named by its content hash like libFuzzer does.
    fn write(&mut self, target: &'static str, data: Vec<u8>) {
        let dir = self.out.join(target);
        std::fs::create_dir_all(&dir).expect("create corpus dir");
        let name = blake3::hash(&data).to_hex()[..16].to_string();
        std::fs::write(dir.join(name), &data).expect("write seed");
        *self.count.entry(target).or_default() += 1;
    }

    fn report(&self) {
        for (target, n) in &self.count {
            println!("{n:4} seeds -> {}", self.out.join(target).display());
        }
    }
}
