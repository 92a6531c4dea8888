//! Tests on the real corpus and robustness properties of [`parse`].

use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;

use super::*;

/// The developer corpus (`../shared/corpus/gpt-small` next to the
/// repository, or `$CKVC_CORPUS`). Required: a missing corpus fails the
/// tests that need it rather than skipping them silently.
fn corpus() -> Option<PathBuf> {
    let dir = std::env::var_os("CKVC_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../shared/corpus/gpt-small"
            ))
        });
    assert!(
        dir.is_dir(),
        "the corpus {} is missing (set CKVC_CORPUS)",
        dir.display()
    );
    Some(dir)
}

fn parse_file(path: &std::path::Path) -> (Layout, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let name = path.file_name().unwrap().to_str().unwrap();
    let mut f = std::fs::File::open(path).unwrap();
    let layout = parse(name, &mut f, bytes.len() as u64)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (layout, bytes)
}

fn step(dir: &std::path::Path, n: u32, file: &str) -> Layout {
    parse_file(&dir.join(format!("step-{n}")).join(file)).0
}

#[test]
fn every_corpus_file_parses_and_reassembles() {
    let Some(dir) = corpus() else { return };
    let mut files = 0;
    for step in std::fs::read_dir(&dir).unwrap() {
        let step = step.unwrap().path();
        if !step.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&step).unwrap() {
            let path = file.unwrap().path();
            let (layout, bytes) = parse_file(&path);
            layout.validate().unwrap();
            assert_eq!(layout.len, bytes.len() as u64);
            let mut joined = Vec::with_capacity(bytes.len());
            for s in &layout.segments {
                joined.extend_from_slice(
                    &bytes[s.offset() as usize..(s.offset() + s.len()) as usize],
                );
            }
            assert!(joined == bytes, "{}", path.display());
            let expected = match path.extension().and_then(|e| e.to_str()) {
                Some("safetensors") => FileKind::Safetensors,
                Some("pt") => FileKind::TorchZip,
                _ => FileKind::Opaque,
            };
            assert_eq!(layout.kind, expected, "{}", path.display());
            files += 1;
        }
    }
    assert_eq!(files, 44);
}

#[test]
fn corpus_safetensors_hold_52_tensors() {
    let Some(dir) = corpus() else { return };
    for n in [0, 300, 600] {
        let fp32 = step(&dir, n, "model.safetensors");
        let bf16 = step(&dir, n, "model.bf16.safetensors");
        assert_eq!(fp32.tensors().filter(|t| t.dtype == DType::F32).count(), 52);
        assert_eq!(
            bf16.tensors().filter(|t| t.dtype == DType::BF16).count(),
            52
        );
        assert_eq!(fp32.tensors().count(), 52);
        let shapes = |l: &Layout| {
            l.tensors()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect::<Vec<_>>()
        };
        let mut a = shapes(&fp32);
        let mut b = shapes(&bf16);
        a.sort();
        b.sort();
        assert_eq!(a, b);
        assert_eq!(
            fp32.tensors()
                .map(|t| t.shape.iter().product::<u64>())
                .sum::<u64>(),
            842_496
        );
    }
}

#[test]
fn corpus_optimizer_storages_are_named_by_state_path() {
    let Some(dir) = corpus() else { return };
    let opt60 = step(&dir, 60, "optimizer.pt");
    let moments: Vec<_> = opt60
        .tensors()
        .filter(|t| t.name.ends_with(".exp_avg") || t.name.ends_with(".exp_avg_sq"))
        .collect();
    assert_eq!(moments.len(), 104);
    assert!(moments.iter().all(|t| t.dtype == DType::F32));
    assert!(opt60
        .tensors()
        .any(|t| t.name == "state.0.exp_avg" && t.len == 131_072));
    assert!(moments.iter().any(|t| t.len == 65_536));
    assert!(moments.iter().any(|t| t.len == 512));
    let steps: Vec<_> = opt60
        .tensors()
        .filter(|t| t.name.ends_with(".step"))
        .collect();
    assert_eq!(steps.len(), 52);
    assert!(steps
        .iter()
        .all(|t| t.shape.is_empty() && t.dtype == DType::F32 && t.len == 4));
    assert_eq!(opt60.tensors().count(), 156);

    // exp_avg has the shape of its parameter.
    let model = step(&dir, 60, "model.safetensors");
    let mut param_shapes: Vec<_> = model.tensors().map(|t| t.shape.clone()).collect();
    let mut avg_shapes: Vec<_> = opt60
        .tensors()
        .filter(|t| t.name.ends_with(".exp_avg"))
        .map(|t| t.shape.clone())
        .collect();
    param_shapes.sort();
    avg_shapes.sort();
    assert_eq!(param_shapes, avg_shapes);

    // Names, dtypes and shapes are the same at every step (they key deltas).
    let sig = |l: &Layout| {
        l.tensors()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
            .collect::<Vec<_>>()
    };
    for n in (120..=600).step_by(60) {
        assert_eq!(sig(&step(&dir, n, "optimizer.pt")), sig(&opt60), "step {n}");
    }
}

#[test]
fn corpus_step0_optimizer_has_no_tensors() {
    let Some(dir) = corpus() else { return };
    let l = step(&dir, 0, "optimizer.pt");
    assert_eq!(l.kind, FileKind::TorchZip);
    assert_eq!(l.tensors().count(), 0);
    assert_eq!(l.segments.len(), 1);
}

#[test]
fn unknown_extensions_and_empty_files_are_opaque() {
    let f = b"{\"global_step\": 3}";
    let l = parse("trainer_state.json", &mut Cursor::new(f), f.len() as u64).unwrap();
    assert_eq!(l, Layout::opaque(f.len() as u64));
    let l = parse("x.bin", &mut Cursor::new(b""), 0).unwrap();
    assert!(l.segments.is_empty());
    l.validate().unwrap();
    // A .bin that is no zip at all: opaque. A .safetensors that is empty: error.
    let l = parse("rng_state.pth", &mut Cursor::new(b"\x80\x02}q\x00."), 6).unwrap();
    assert_eq!(l.kind, FileKind::Opaque);
    assert!(parse("model.SafeTensors", &mut Cursor::new(b""), 0).is_err());
    assert!(parse("a.npy", &mut Cursor::new(b"abc"), 3).is_err());
}

#[test]
fn validate_rejects_broken_layouts() {
    let t = |offset, len| {
        Segment::Tensor(TensorInfo {
            name: "t".into(),
            dtype: DType::F32,
            shape: vec![len / 4],
            offset,
            len,
        })
    };
    let layout = |segments| Layout {
        kind: FileKind::Opaque,
        len: 12,
        segments,
    };
    layout(vec![Segment::Opaque { offset: 0, len: 4 }, t(4, 8)])
        .validate()
        .unwrap();
    for segs in [
        vec![t(0, 8)],
        vec![Segment::Opaque { offset: 0, len: 4 }, t(5, 8)],
        vec![
            Segment::Opaque { offset: 0, len: 4 },
            t(4, 8),
            Segment::Opaque { offset: 12, len: 0 },
        ],
        vec![
            Segment::Opaque { offset: 0, len: 4 },
            t(4, 4),
            t(8, 4),
            Segment::Opaque { offset: 12, len: 1 },
        ],
    ] {
        assert!(matches!(
            layout(segs).validate(),
            Err(FormatError::InvalidLayout { .. })
        ));
    }
    let mut bad = layout(vec![Segment::Opaque { offset: 0, len: 4 }, t(4, 8)]);
    if let Segment::Tensor(ti) = &mut bad.segments[1] {
        ti.shape = vec![3];
    }
    assert!(bad.validate().is_err());
}

/// A reader over `data` that ends at `len` and flips `mask` into byte `at`,
/// so large real files can be mutated without copying them.
struct Mutated<'a> {
    data: &'a [u8],
    len: usize,
    at: usize,
    mask: u8,
    pos: u64,
}

impl Read for Mutated<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let start = (self.pos as usize).min(self.len);
        let n = buf.len().min(self.len - start);
        buf[..n].copy_from_slice(&self.data[start..start + n]);
        if (start..start + n).contains(&self.at) {
            buf[self.at - start] ^= self.mask;
        }
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Mutated<'_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let base = match to {
            SeekFrom::Start(o) => Some(o),
            SeekFrom::End(d) => (self.len as u64).checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = base.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before 0")
        })?;
        Ok(self.pos)
    }
}

/// Sample files, each with the name that selects its parser.
fn samples() -> &'static [(&'static str, Vec<u8>)] {
    static SAMPLES: OnceLock<Vec<(&'static str, Vec<u8>)>> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let mut v = vec![
            ("small.pt", include_bytes!("../../tests/fixtures/format/small.pt").to_vec()),
            ("legacy.bin", include_bytes!("../../tests/fixtures/format/legacy.bin").to_vec()),
            ("rezipped.pt", include_bytes!("../../tests/fixtures/format/rezipped.pt").to_vec()),
            (
                "x.safetensors",
                safetensors_file(r#"{"__metadata__":{"a":"b"},"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#, 12),
            ),
            ("x.npy", npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 12)),
        ];
        if let Some(dir) = corpus() {
            for (name, rel) in [
                ("optimizer.pt", "step-0/optimizer.pt"),
                ("optimizer.pt", "step-60/optimizer.pt"),
                ("model.bf16.safetensors", "step-60/model.bf16.safetensors"),
            ] {
                v.push((name, std::fs::read(dir.join(rel)).unwrap()));
            }
        }
        v
    })
}

fn safetensors_file(header: &str, data: usize) -> Vec<u8> {
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.resize(f.len() + data, 0x3f);
    f
}

fn npy_file(dict: &str, data: usize) -> Vec<u8> {
    let mut f = b"\x93NUMPY\x01\x00".to_vec();
    f.extend_from_slice(&(dict.len() as u16 + 1).to_le_bytes());
    f.extend_from_slice(dict.as_bytes());
    f.push(b'\n');
    f.resize(f.len() + data, 1);
    f
}

/// Whatever `parse` returns must be a valid layout of the (mutated) file.
fn check(name: &str, r: &mut Mutated<'_>) {
    let len = r.len as u64;
    if let Ok(l) = parse(name, r, len) {
        assert_valid(&l, len);
    }
}

fn assert_valid(l: &Layout, len: u64) {
    assert_eq!(l.len, len);
    l.validate().expect("parse returned an invalid layout");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        ext in prop::sample::select(vec!["x.safetensors", "x.pt", "x.bin", "x.npy", "x.json"]),
        prefix in prop::sample::select(vec![&b""[..], b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY\x01\x00", b"\x10\x00\x00\x00\x00\x00\x00\x00{"]),
    ) {
        let mut f = prefix.to_vec();
        f.extend_from_slice(&bytes);
        let mut r = Mutated { data: &f, len: f.len(), at: usize::MAX, mask: 0, pos: 0 };
        check(ext, &mut r);
    }

    #[test]
    fn truncated_and_bit_flipped_files_never_panic(
        which in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
        region in 0u8..3,
        at in any::<prop::sample::Index>(),
        mask in 1u8..=255,
    ) {
        let (name, data) = &samples()[which.index(samples().len())];
        let n = data.len();
        let len = if truncate { cut.index(n + 1) } else { n };
        // Headers live at both ends of these files: aim there most of the time.
        let window = n.min(16 << 10);
        let at = match region {
            0 => at.index(window),
            1 => n - window + at.index(window),
            _ => at.index(n),
        };
        let mut r = Mutated { data, len, at, mask, pos: 0 };
        check(name, &mut r);
    }
}

#[test]
fn step_numbers_come_from_the_trailing_digits() {
    use super::step_of_dir_name;
    assert_eq!(step_of_dir_name("step-500"), Some(500));
    assert_eq!(step_of_dir_name("checkpoint-12000"), Some(12000));
    assert_eq!(step_of_dir_name("iter_0000500"), Some(500));
    assert_eq!(step_of_dir_name("final"), None);
}

// ---- PyTorch distributed checkpoints (tests/fixtures/dcp, written by
// scripts/gen_dcp_fixtures.py) ----

fn dcp_fixture(rel: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dcp")).join(rel)
}

#[test]
fn distcp_items_are_torch_archives_whose_tensors_are_seen() {
    let (layout, bytes) = parse_file(&dcp_fixture("step-1/__0_0.distcp"));
    layout.validate().unwrap();
    assert_eq!(layout.kind, FileKind::DistCp);
    // model: 2 weights + 2 biases; AdamW: exp_avg, exp_avg_sq and a 0-d
    // step counter per parameter.
    let tensors: Vec<&TensorInfo> = layout.tensors().collect();
    assert_eq!(tensors.len(), 4 + 4 * 3, "{tensors:?}");
    assert!(tensors.iter().any(|t| t.shape == [16, 32]));
    assert!(tensors.iter().all(|t| t.dtype == DType::F32));
    // Every element: 596 parameters in the model and twice in Adam's
    // moments, four 0-d step counters; names are unique.
    let tensor_bytes: u64 = tensors.iter().map(|t| t.len).sum();
    assert_eq!(tensor_bytes, (596 * 3 + 4) * 4);
    assert!(tensor_bytes < bytes.len() as u64);
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), tensors.len());
    // The same items in the same order at the next step: the same names.
    let (next, _) = parse_file(&dcp_fixture("step-2/__0_0.distcp"));
    let next_names: Vec<&str> = next.tensors().map(|t| t.name.as_str()).collect();
    let these: Vec<&str> = layout.tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(these, next_names);
}

#[test]
fn distcp_of_each_rank_parses() {
    let mut total = 0;
    for rank in 0..2 {
        let (layout, _) = parse_file(&dcp_fixture(&format!("ranks2-step-1/__{rank}_0.distcp")));
        layout.validate().unwrap();
        assert_eq!(layout.kind, FileKind::DistCp);
        total += layout.tensors().count();
    }
    assert_eq!(total, 16);
}

#[test]
fn distcp_not_understood_is_opaque_not_an_error() {
    let bytes = std::fs::read(dcp_fixture("step-1/__0_0.distcp")).unwrap();
    let parse_bytes = |b: &[u8]| parse("__0_0.distcp", &mut Cursor::new(b), b.len() as u64);
    // Garbage, a truncated file, a file with bytes before its first archive
    // and one with a flipped end record: opaque, every byte kept.
    let mut flipped = bytes.clone();
    let n = flipped.len();
    flipped[n - 10] ^= 0xff;
    let mut prefixed = b"junk".to_vec();
    prefixed.extend_from_slice(&bytes);
    for b in [
        b"not a dcp file".to_vec(),
        bytes[..bytes.len() - 1].to_vec(),
        bytes[1..].to_vec(),
        flipped,
        prefixed,
        Vec::new(),
    ] {
        let layout = parse_bytes(&b).unwrap();
        layout.validate().unwrap();
        assert_eq!(layout.kind, FileKind::Opaque, "{} bytes", b.len());
    }
}

#[test]
fn distcp_tensors_are_named_by_their_state_dict_keys_from_metadata() {
    for (dir, files) in [
        ("step-1", &["__0_0.distcp"][..]),
        ("ranks2-step-1", &["__0_0.distcp", "__1_0.distcp"][..]),
    ] {
        let root = dcp_fixture(dir);
        let meta = root.join(".metadata");
        let ctx = DirContext::read([(".metadata", meta.as_path())]);
        let mut names = Vec::new();
        for f in files {
            let path = root.join(f);
            let len = std::fs::metadata(&path).unwrap().len();
            let layout = ctx
                .parse(f, &mut std::fs::File::open(&path).unwrap(), len)
                .unwrap();
            layout.validate().unwrap();
            names.extend(layout.tensors().map(|t| t.name.clone()));
        }
        names.sort();
        assert_eq!(names.len(), 16, "{dir}: {names:?}");
        for want in [
            "model.0.weight",
            "model.2.bias",
            "optim.state.0.exp_avg",
            "optim.state.3.exp_avg_sq",
            "optim.state.0.step",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{dir}: {want} in {names:?}"
            );
        }
    }
    // Without .metadata, items are named by position.
    let (layout, _) = parse_file(&dcp_fixture("step-1/__0_0.distcp"));
    assert!(layout.tensors().all(|t| t.name.contains("/data/")));
}

#[test]
fn dcp_metadata_that_is_not_dcp_names_nothing() {
    assert!(DcpIndex::parse(b"not a pickle").is_err());
    // A pickle of something else: (1, 2).
    assert!(DcpIndex::parse(&[0x80, 0x02, 0x4b, 0x01, 0x4b, 0x02, 0x86, 0x2e]).is_err());
}

/// A `.metadata` pickle whose `storage_data` has `n` items, all with the
/// same index object (by memo), whose fqn is `fqn_len` bytes.
fn metadata_sharing_one_fqn(fqn_len: usize, n: usize) -> Vec<u8> {
    let s = |x: &str| [&[0x8c, x.len() as u8][..], x.as_bytes()].concat();
    let mut p = b"\x80\x02c__main__\nM\nq\x000)q\x010".to_vec();
    p.push(0x8d);
    p.extend_from_slice(&(fqn_len as u64).to_le_bytes());
    p.extend(std::iter::repeat_n(b'w', fqn_len));
    p.extend_from_slice(b"q\x020");
    for (i, k) in [
        "fqn",
        "relative_path",
        "offset",
        "length",
        "a",
        "storage_data",
    ]
    .iter()
    .enumerate()
    {
        p.extend_from_slice(&s(k));
        p.extend_from_slice(&[b'q', 3 + i as u8, b'0']);
    }
    p.extend_from_slice(b"h\x00h\x01\x81}(h\x03h\x02ubq\x090"); // the index object
    p.extend_from_slice(b"h\x00h\x01\x81}(h\x08}"); // root, its state, storage_data
    for i in 0..n as i32 {
        p.extend_from_slice(b"h\x09h\x00h\x01\x81}(h\x04h\x07h\x05J");
        p.extend_from_slice(&i.to_le_bytes());
        p.extend_from_slice(b"h\x06K\x01ubs");
    }
    p.extend_from_slice(b"ub.");
    p
}

#[test]
fn dcp_metadata_cannot_copy_one_shared_fqn_without_bound() {
    // Read as a DCP index when the names stay small.
    let index = DcpIndex::parse(&metadata_sharing_one_fqn(16, 100)).expect("an index");
    assert_eq!(index.items_of("a").map(|m| m.len()), Some(100));
    // A 1 MiB fqn shared by 100 items: 2 MB of pickle, 100 MiB of names
    // (a 64 MiB .metadata could ask for terabytes).
    assert!(DcpIndex::parse(&metadata_sharing_one_fqn(1 << 20, 100)).is_err());
}

#[test]
fn distcp_in_safetensors_serialization_is_split_by_the_metadata_ranges() {
    let root = dcp_fixture("st-step-1");
    let meta = root.join(".metadata");
    let ctx = DirContext::read([(".metadata", meta.as_path())]);
    let path = root.join("__0_0.distcp");
    let len = std::fs::metadata(&path).unwrap().len();
    let layout = ctx
        .parse(
            "__0_0.distcp",
            &mut std::fs::File::open(&path).unwrap(),
            len,
        )
        .unwrap();
    layout.validate().unwrap();
    assert_eq!(layout.kind, FileKind::DistCp);
    let names: Vec<&str> = layout.tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(names.len(), 16, "{names:?}");
    assert!(names.contains(&"model.0.weight"), "{names:?}");
    // The same elements as the torch.save serialization of the same state.
    let (zipped, _) = parse_file(&dcp_fixture("step-1/__0_0.distcp"));
    let bytes = |l: &Layout| l.tensors().map(|t| t.len).sum::<u64>();
    assert_eq!(bytes(&layout), bytes(&zipped));
    // Without .metadata there is no way back through safetensors blobs:
    // opaque, not an error.
    let (alone, _) = parse_file(&path);
    assert_eq!(alone.kind, FileKind::Opaque);
}

// ---- legacy torch.save (tests/fixtures/torch-legacy, written by
// scripts/gen_legacy_fixtures.py) ----

fn legacy_fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torch-legacy"
    ))
    .join(name)
}

#[test]
fn legacy_torch_save_tensors_are_seen_as_in_the_zip_format() {
    let (legacy, bytes) = parse_file(&legacy_fixture("legacy.pt"));
    legacy.validate().unwrap();
    assert_eq!(legacy.kind, FileKind::TorchLegacy);
    let (zipped, _) = parse_file(&legacy_fixture("zip.pt"));
    let describe = |l: &Layout| {
        let mut v: Vec<(String, DType, Vec<u64>, u64)> = l
            .tensors()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.len))
            .collect();
        v.sort();
        v
    };
    assert_eq!(describe(&legacy), describe(&zipped));
    // model 2 weights + 2 biases, AdamW 4 x (step, exp_avg, exp_avg_sq),
    // the bf16 and the int64 tensors (the view shares the int64 storage).
    assert_eq!(legacy.tensors().count(), 4 + 12 + 2);
    // The bf16 tensor's bytes are its elements, at its offset.
    let t = legacy.tensors().find(|t| t.dtype == DType::BF16).unwrap();
    assert_eq!((t.shape.as_slice(), t.len), (&[5u64, 4][..], 40));
    assert!(t.offset + t.len <= bytes.len() as u64);
}

#[test]
fn legacy_torch_save_not_understood_is_opaque_not_an_error() {
    let bytes = std::fs::read(legacy_fixture("legacy.pt")).unwrap();
    let n = bytes.len();
    let mut grown = bytes.clone();
    grown.push(0);
    // Protocol version 1002 instead of 1001 (BININT2 right after the magic).
    let mut other_version = bytes.clone();
    assert_eq!(&other_version[15..21], b"\x80\x02M\xe9\x03.");
    other_version[18] += 1;
    for b in [
        bytes[..n - 1].to_vec(),
        grown,
        other_version,
        bytes[..40].to_vec(),
    ] {
        let layout = parse("optimizer.pt", &mut Cursor::new(&b), b.len() as u64).unwrap();
        layout.validate().unwrap();
        assert_eq!(layout.kind, FileKind::Opaque, "{} bytes", b.len());
    }
}
