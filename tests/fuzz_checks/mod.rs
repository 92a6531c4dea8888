//! The checks the fuzz targets run, shared with the regression replay.
//!
//! One function per fuzz target, each taking the raw input bytes the fuzzer
//! produced. `fuzz/fuzz_targets/*.rs` include this file with `#[path]`, and
//! `tests/it/fuzz_regressions.rs` includes it as a module, so a crash file
//! saved under `tests/fuzz-regressions/<target>/` is replayed by plain
//! `cargo test` through exactly the code that found it. It lives in a
//! subdirectory of `tests/` so cargo does not build it as a test binary of
//! its own, and it only uses ckvc's public API (no extra dependencies).
//!
//! The input encodings are documented on each function; `examples/fuzz_seeds.rs`
//! writes seed corpora in the same encodings with the `*_input` builders.

// Each includer uses only part of this file (one check, or only builders).
#![allow(dead_code)]

use std::io::Cursor;

use ckvc::codec::{self, DType, FrameInfo, Options, Scratch};
use ckvc::format::{self, FileKind};

/// Decoded sizes above this are refused (a `TooLarge` error), so a frame that
/// merely declares a big size cannot push the fuzzer into its memory limit.
pub const DECODE_MAX_RAW_LEN: u64 = 16 << 20;

/// A derived base is only built for frames up to this raw length.
pub const DECODE_MAX_BASE_LEN: u64 = 1 << 20;

/// `decode` target: `[mode][rest]`.
///
/// Even `mode`: `rest` is the frame, decoded with no base. Odd `mode`:
/// `rest` is `[frame_len: u16 LE][frame][base material]`; when the frame's
/// header asks for a base of `raw_len <= 1 MiB` bytes, the base is the
/// material repeated to `raw_len` bytes (zeros when there is none), so a
/// seed can carry the exact base its frame was encoded against. Otherwise
/// the material itself is passed as the base (a length the decoder must
/// reject, or ignore when the frame needs none).
///
/// Checks: no panic; a successful decode has `raw_len` bytes and needed no
/// base it did not get; decoding again with the now dirty scratch and
/// output buffers gives the same bytes.
pub fn check_decode(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (frame, base) = if mode & 1 == 0 {
        (rest, None)
    } else {
        let (frame, material) = split_u16_prefixed(rest);
        let base = match FrameInfo::parse(frame) {
            Ok(info) if info.needs_base() && info.raw_len <= DECODE_MAX_BASE_LEN => {
                Some(repeat_to(material, info.raw_len as usize))
            }
            _ => Some(material.to_vec()),
        };
        (frame, base)
    };
    let base = base.as_deref();
    let mut out = Vec::new();
    let mut scratch = Scratch::default();
    let first = codec::decode_into(frame, base, DECODE_MAX_RAW_LEN, &mut out, &mut scratch);
    if first.is_err() {
        return;
    }
    let info = FrameInfo::parse(frame).expect("a frame that decoded has a valid header");
    assert_eq!(out.len() as u64, info.raw_len, "decoded length");
    assert!(
        base.is_some() || !info.needs_base(),
        "delta decoded without a base"
    );
    let mut again = vec![0xa5; 3];
    codec::decode_into(frame, base, DECODE_MAX_RAW_LEN, &mut again, &mut scratch)
        .expect("the same frame decodes again with reused buffers");
    assert!(
        again == out,
        "decoding with reused buffers changed the output"
    );
}

/// Builds a `decode` input that decodes `frame` against exactly `base`.
pub fn decode_input(frame: &[u8], base: Option<&[u8]>) -> Vec<u8> {
    match base {
        None => [&[0u8][..], frame].concat(),
        Some(base) => {
            let len = u16::try_from(frame.len()).expect("seed frames are below 64 KiB");
            [&[1u8][..], &len.to_le_bytes(), frame, base].concat()
        }
    }
}

/// `roundtrip` target: `[dtype][flags][rest]`.
///
/// `dtype` is a code modulo 15. `flags` bit 0 selects [`Options::lmc`]
/// instead of the default options; bits 1-2 how the base is made from
/// `rest`: 0 no base (`raw = rest`), 1 `rest` split in halves (`raw`, then a
/// base of the same length), 2 `raw = rest` and the base is `raw` with a
/// sparse perturbation (a likely delta), 3 `raw = rest` and a base one byte
/// short (which the encoder must ignore); bit 3 forces an element map
/// (format version 4) into the frame, whatever it saves; bit 4 turns off
/// storing a small chunk as one zstd frame and bit 5 grouping integer
/// bytes by a wider word (format version 6), so that fuzzed inputs, all
/// small, still reach the block coders and the dtype's own width; bit 6
/// writes a palette frame whenever the chunk has at most 256 distinct
/// values (format version 6, transform bit 7), whatever it saves; bit 7
/// gives the encoder the chunk's rows (rows of `2 + dtype / 15` elements
/// after a lead of `rest.len()` modulo that) and, when `dtype / 15` is
/// even, has it write a row frame (format version 8) whenever a float
/// chunk holds two rows, whatever it saves; when odd, no row frame, so
/// the plain frame's blocks of 16 Ki symbols or more may take the row a
/// whole number of rows up as context (block mode 9, format version 10).
///
/// Checks: the frame's header states the dtype and length, and decoding it
/// (with the base when its header asks for one) returns `raw`, also under a
/// `max_raw_len` of exactly `raw.len()`.
pub fn check_roundtrip(data: &[u8]) {
    let [d, flags, rest @ ..] = data else {
        return;
    };
    let dtype = DType::from_code(d % DType::ALL.len() as u8).expect("code below 15");
    let mut opts = if flags & 1 == 0 {
        Options::default()
    } else {
        Options::lmc()
    };
    if flags & 8 != 0 {
        opts.element_map = codec::ElementMap::Always;
    }
    if flags & 16 != 0 {
        opts.small_zstd_max = 0;
    }
    if flags & 32 != 0 {
        opts.regroup = false;
    }
    if flags & 64 != 0 {
        opts.palette = codec::Palette::Always;
    }
    let rows = (flags & 128 != 0).then(|| {
        opts.rows = if (d / 15) % 2 == 0 {
            codec::RowFrames::Always
        } else {
            codec::RowFrames::Never
        };
        let len = 2 + usize::from(d / 15);
        codec::Rows {
            len,
            lead: rest.len() % len,
        }
    });
    let (raw, base): (&[u8], Option<Vec<u8>>) = match (flags >> 1) & 3 {
        0 => (rest, None),
        1 => {
            let h = rest.len() / 2;
            (&rest[..h], Some(rest[h..2 * h].to_vec()))
        }
        2 => (rest, Some(perturb(rest))),
        _ => (rest, Some(rest[..rest.len().saturating_sub(1)].to_vec())),
    };
    let base = base.as_deref();
    let mut frame = Vec::new();
    let mut scratch = Scratch::default();
    codec::encode_shaped_into(raw, base, dtype, rows, &opts, &mut frame, &mut scratch);
    let info = FrameInfo::parse(&frame).expect("the encoder writes a valid header");
    assert_eq!(info.dtype, dtype, "frame dtype");
    assert_eq!(info.raw_len, raw.len() as u64, "frame raw_len");
    if info.needs_base() {
        assert!(
            base.is_some_and(|b| b.len() == raw.len()),
            "the encoder used a base it was not given (or of the wrong length)"
        );
    }
    let base = base.filter(|_| info.needs_base());
    let mut out = Vec::new();
    codec::decode_into(&frame, base, raw.len() as u64, &mut out, &mut scratch)
        .expect("a frame the encoder wrote decodes");
    assert!(out == raw, "round trip changed the bytes");
}

/// Builds a `roundtrip` input encoding `raw` against `base` (same length).
pub fn roundtrip_input(dtype: DType, lmc: bool, raw: &[u8], base: Option<&[u8]>) -> Vec<u8> {
    let mut v = vec![dtype.code(), lmc as u8];
    v.extend_from_slice(raw);
    if let Some(base) = base {
        assert_eq!(base.len(), raw.len(), "a seed base has the raw length");
        v[1] |= 1 << 1;
        v.extend_from_slice(base);
    }
    v
}

/// The file names the `format_parse` target chooses from.
pub const FILE_NAMES: [&str; 6] = [
    "model.safetensors",
    "optimizer.pt",
    "x.bin",
    "a.npy",
    "notes.txt",
    "__0_0.distcp",
];

/// `format_parse` target: `[name][file]`, the name being
/// `FILE_NAMES[name % FILE_NAMES.len()]`.
///
/// Checks: no panic; a successful parse covers the file exactly
/// (`Layout::validate` and `layout.len`), and `notes.txt` is opaque.
pub fn check_format_parse(data: &[u8]) {
    let Some((&sel, file)) = data.split_first() else {
        return;
    };
    let name = FILE_NAMES[sel as usize % FILE_NAMES.len()];
    let len = file.len() as u64;
    let Ok(layout) = format::parse(name, &mut Cursor::new(file), len) else {
        return;
    };
    assert_eq!(layout.len, len, "layout length");
    if let Err(e) = layout.validate() {
        panic!("parse of {name} returned an invalid layout: {e}");
    }
    if name == "notes.txt" {
        assert_eq!(
            layout.kind,
            FileKind::Opaque,
            "unknown extensions are opaque"
        );
    }
}

/// Builds a `format_parse` input parsing `file` under `FILE_NAMES[name]`.
pub fn format_parse_input(name: usize, file: &[u8]) -> Vec<u8> {
    assert!(name < FILE_NAMES.len());
    [&[name as u8][..], file].concat()
}

fn split_u16_prefixed(data: &[u8]) -> (&[u8], &[u8]) {
    let [a, b, rest @ ..] = data else {
        return (data, &[]);
    };
    let n = (u16::from_le_bytes([*a, *b]) as usize).min(rest.len());
    rest.split_at(n)
}

fn repeat_to(material: &[u8], len: usize) -> Vec<u8> {
    if material.is_empty() {
        return vec![0; len];
    }
    material.iter().copied().cycle().take(len).collect()
}

/// `raw` with a small change in every 13th byte: close enough that the
/// encoder's delta search picks a delta, different enough to matter.
fn perturb(raw: &[u8]) -> Vec<u8> {
    raw.iter()
        .enumerate()
        .map(|(i, &b)| if i % 13 == 0 { b.wrapping_add(1) } else { b })
        .collect()
}

/// `objects` target: `[kind][bytes]`, decoded as the object `kind % 5`
/// names: a chunk record (and its header alone), a file manifest, a tree,
/// a commit, a ref-log entry. These bytes come from remotes.
///
/// Checks: no panic; what decodes re-encodes to bytes that decode to the
/// same value (so an object's id, the hash of its encoding, is stable).
pub fn check_objects(data: &[u8]) {
    use ckvc::repo::objects::{ChunkRecord, Commit, FileManifest, RefLogEntry, Tree};
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    match kind % 5 {
        0 => {
            let header = ChunkRecord::decode_header(bytes);
            if let Ok(r) = ChunkRecord::decode(bytes) {
                let h = header.expect("a record that decodes has a header");
                assert_eq!((h.raw_len, h.base, h.depth), (r.raw_len, r.base, r.depth));
                assert_eq!(ChunkRecord::decode(&r.encode()).expect("re-decodes"), r);
            }
        }
        1 => {
            if let Ok(m) = FileManifest::decode(bytes) {
                assert_eq!(FileManifest::decode(&m.encode()).expect("re-decodes"), m);
            }
        }
        2 => {
            if let Ok(t) = Tree::decode(bytes) {
                assert_eq!(Tree::decode(&t.encode()).expect("re-decodes"), t);
            }
        }
        3 => {
            if let Ok(c) = Commit::decode(bytes) {
                assert_eq!(Commit::decode(&c.encode()).expect("re-decodes"), c);
            }
        }
        _ => {
            if let Ok(e) = RefLogEntry::decode("refs/heads/main", bytes) {
                assert_eq!(
                    RefLogEntry::decode("refs/heads/main", &e.encode()).expect("re-decodes"),
                    e
                );
            }
        }
    }
}

/// `pack` target: `[which][bytes]`: even `which`, the bytes as a pack
/// (named by their own blake3, so only the structure is tested); odd, as
/// a pack index. These come from remotes.
///
/// Checks: no panic; a verified pack's entries lie inside it, in order, and
/// an index written for them decodes to the same entries.
pub fn check_pack(data: &[u8]) {
    use ckvc::remote::pack;
    use ckvc::store::Hash32;
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        let name = Hash32::digest(bytes);
        if let Ok(entries) = pack::verify_pack(bytes, &name, "fuzz") {
            let mut end = 0;
            for e in &entries {
                assert!(e.offset >= end && e.offset + e.len <= bytes.len() as u64);
                end = e.offset + e.len;
            }
            let idx = pack::encode_index(&name, bytes.len() as u64, &entries);
            let back = pack::decode_index(&idx, "fuzz").expect("a written index decodes");
            assert_eq!(back.entries, entries);
        }
    } else if let Ok(idx) = pack::decode_index(bytes, "fuzz") {
        let again = pack::encode_index(&idx.pack, idx.pack_len, &idx.entries);
        assert_eq!(
            pack::decode_index(&again, "fuzz")
                .expect("re-decodes")
                .entries,
            idx.entries
        );
    }
}
