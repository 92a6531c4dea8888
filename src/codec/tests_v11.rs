//! Tests of frame version 11 (32 rANS states from 8 Ki symbols):
//! every frame this build writes decodes, and a codec-1 frame (plain,
//! element-mapped, palette, or a row frame's inner frame) says version 11
//! exactly when it holds a rANS-family block (mode 3, 4, 8 or 9) of
//! 8,192 to 16,383 symbols.

use super::tests::{blocks_of, is_rans};
use super::*;

/// Check a codec-1 frame's version against its blocks; returns whether it
/// has a block of 8-16 Ki symbols with rANS, and counts what it saw.
fn check_grouped(f: &[u8], what: &str, seen: &mut Seen) -> bool {
    let info = FrameInfo::parse(f).unwrap();
    let blocks = blocks_of(f);
    let wide = blocks
        .iter()
        .any(|&(m, n)| is_rans(m) && (8192..16384).contains(&n));
    let up = blocks.iter().any(|&(m, _)| m == BlockMode::RansUp as u8);
    let gamma = blocks.iter().any(|&(m, _)| m == BlockMode::RansGamma as u8);
    let want = if wide {
        WIDE_VERSION
    } else if up {
        UP_VERSION
    } else if gamma {
        GAMMA_VERSION
    } else {
        PLAIN_VERSION
    };
    assert_eq!(
        info.version, want,
        "{what}: version {} but blocks {blocks:?}",
        info.version
    );
    seen.frames += 1;
    seen.wide += wide as usize;
    seen.palette += info.palette as usize;
    seen.wide_palette += (info.palette && wide) as usize;
    seen.wide_mapped += (info.element_map && wide) as usize;
    seen.mapped += info.element_map as usize;
    for &(m, n) in &blocks {
        if is_rans(m) && (8192..16384).contains(&n) {
            seen.modes[m as usize] += 1;
        }
    }
    wide
}

#[derive(Default, Debug)]
struct Seen {
    frames: usize,
    wide: usize,
    palette: usize,
    mapped: usize,
    rows: usize,
    wide_palette: usize,
    wide_mapped: usize,
    wide_rows: usize,
    /// rANS-family blocks of 8-16 Ki symbols by mode.
    modes: [usize; 10],
}

/// Check any frame (a row frame by its inner frames).
fn check_frame(f: &[u8], what: &str, seen: &mut Seen) {
    let info = FrameInfo::parse(f).unwrap();
    if !info.rows {
        check_grouped(f, what, seen);
        return;
    }
    seen.rows += 1;
    let w = info.dtype.width();
    let n = info.raw_len as usize / w;
    let at = info.header_len;
    let ([len, lead, r], pos) = rows::read_numbers(f, at).unwrap();
    let g = rows::Geometry::new(n, Rows { len, lead }).unwrap();
    let (_, pos) = rows::read_plan(f, pos, g.count, r).unwrap();
    let (a_len, pos) = leb::read(f, pos, f.len(), 5).unwrap();
    let fa = &f[pos..pos + a_len as usize];
    let fd = &f[pos + a_len as usize..];
    let wa = check_grouped(fa, &format!("{what} roots"), seen);
    let wd = check_grouped(fd, &format!("{what} others"), seen);
    seen.wide_rows += (wa || wd) as usize;
    let va = FrameInfo::parse(fa).unwrap().version;
    let vd = FrameInfo::parse(fd).unwrap().version;
    assert_eq!(
        info.version,
        ROWS_VERSION.max(va).max(vd),
        "{what}: row frame"
    );
}

/// `crate::testing::Rng` with uniform and roughly Gaussian floats.
struct Rng(crate::testing::Rng);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn gauss(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() - 2.0
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

/// Inputs of `n` elements: (name, dtype, new, base).
fn inputs(n: usize, seed: u64) -> Vec<(String, DType, Vec<u8>, Vec<u8>)> {
    let mut r = Rng(crate::testing::Rng(
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
    ));
    let base: Vec<f32> = (0..n).map(|_| r.gauss() * 0.02).collect();
    // A small step: delta streams mostly zero (rANS / context rANS).
    let step: Vec<f32> = base.iter().map(|b| b + r.gauss() * 1e-4).collect();
    // Sparse updates with zeros: element map material.
    let sparse: Vec<f32> = base
        .iter()
        .map(|&b| {
            if r.unit() < 0.3 {
                b + r.gauss() * 1e-3
            } else {
                b
            }
        })
        .collect();
    let zeros: Vec<f32> = base
        .iter()
        .map(|&b| if r.unit() < 0.4 { 0.0 } else { b })
        .collect();
    // Adam second-moment-like rows: exponents repeating by column.
    let cols: Vec<f32> = (0..257).map(|_| (r.gauss() * 4.0).exp2()).collect();
    let rowsy: Vec<f32> = (0..n)
        .map(|i| cols[i % 257] * (1.0 + 0.01 * r.gauss()))
        .collect();
    // Few distinct values, skewed: palette material.
    let levels: Vec<f32> = (0..40).map(|i| i as f32 * 0.37 - 3.0).collect();
    let pal: Vec<f32> = (0..n)
        .map(|_| {
            let u = r.unit();
            if u < 0.9 {
                levels[7]
            } else {
                levels[((u - 0.9) * 400.0) as usize % 40]
            }
        })
        .collect();
    let pal_step: Vec<f32> = pal
        .iter()
        .map(|&v| {
            if r.unit() < 0.05 {
                levels[(r.next() % 40) as usize]
            } else {
                v
            }
        })
        .collect();
    // Skewed small integers.
    let ints: Vec<u8> = (0..n)
        .map(|_| {
            let u = r.unit();
            ((u * u * u * u) * 60.0) as i8 as u8
        })
        .collect();
    let ints2: Vec<u8> = ints
        .iter()
        .map(|&v| if r.unit() < 0.1 { v.wrapping_add(1) } else { v })
        .collect();
    let i32s: Vec<u8> = ints
        .iter()
        .flat_map(|&v| ((v as i32) * 3 - 50).to_le_bytes())
        .collect();
    let i32s2: Vec<u8> = ints2
        .iter()
        .flat_map(|&v| ((v as i32) * 3 - 50).to_le_bytes())
        .collect();
    vec![
        (
            "f32 step".into(),
            DType::F32,
            f32_bytes(&step),
            f32_bytes(&base),
        ),
        (
            "f32 sparse".into(),
            DType::F32,
            f32_bytes(&sparse),
            f32_bytes(&base),
        ),
        (
            "f32 zeros".into(),
            DType::F32,
            f32_bytes(&zeros),
            f32_bytes(&base),
        ),
        (
            "f32 rows".into(),
            DType::F32,
            f32_bytes(&rowsy),
            f32_bytes(&base),
        ),
        (
            "bf16 step".into(),
            DType::BF16,
            bf16_bytes(&step),
            bf16_bytes(&base),
        ),
        (
            "bf16 rows".into(),
            DType::BF16,
            bf16_bytes(&rowsy),
            bf16_bytes(&rowsy),
        ),
        (
            "f32 palette".into(),
            DType::F32,
            f32_bytes(&pal_step),
            f32_bytes(&pal),
        ),
        (
            "bf16 palette".into(),
            DType::BF16,
            bf16_bytes(&pal_step),
            bf16_bytes(&pal),
        ),
        ("i8".into(), DType::I8, ints2.clone(), ints.clone()),
        ("u8".into(), DType::U8, ints.clone(), ints2.clone()),
        ("i32".into(), DType::I32, i32s2, i32s),
    ]
}

fn option_sets() -> Vec<(&'static str, Options)> {
    vec![
        ("default", Options::default()),
        (
            "palette",
            Options {
                palette: Palette::Always,
                ..Options::default()
            },
        ),
        (
            "rows",
            Options {
                rows: RowFrames::Always,
                ..Options::default()
            },
        ),
        (
            "rows-nogain",
            Options {
                rows: RowFrames::Always,
                rans_min_gain: 0.0,
                plain_rans_min_gain: 0.0,
                ..Options::default()
            },
        ),
        (
            "map",
            Options {
                element_map: ElementMap::Always,
                ..Options::default()
            },
        ),
        (
            "no-gain",
            Options {
                rans_min_gain: 0.0,
                plain_rans_min_gain: 0.0,
                zstd_level: 0,
                small_zstd_max: 0,
                sparse: false,
                packed: false,
                ..Options::default()
            },
        ),
    ]
}

const LENGTHS: [usize; 17] = [
    8190,
    8191,
    8192,
    8193,
    8200,
    12288,
    16380,
    16383,
    16384,
    16385,
    16390,
    65536 + 8191,
    65536 + 8192,
    65536 + 12288,
    65536 + 16383,
    65536 + 16384,
    131072 + 9000,
];

#[test]
fn version_11_iff_a_rans_block_of_8_to_16_ki_symbols() {
    let mut seen = Seen::default();
    let mut scratch = Scratch::default();
    let mut out = Vec::new();
    for (li, &n) in LENGTHS.iter().enumerate() {
        for (name, dtype, raw, base) in inputs(n, li as u64 + 1) {
            for (oname, opts) in option_sets() {
                for with_base in [false, true] {
                    let b = with_base.then_some(base.as_slice());
                    // Plain encode, and shaped (rows: row frames, row context).
                    let row_len = [0usize, 96, 257];
                    for &len in &row_len {
                        let what = format!("{name} n={n} {oname} base={with_base} rows={len}");
                        if len == 0 {
                            encode_into(&raw, b, dtype, &opts, &mut out, &mut scratch);
                        } else {
                            encode_shaped_into(
                                &raw,
                                b,
                                dtype,
                                Some(Rows { len, lead: 0 }),
                                &opts,
                                &mut out,
                                &mut scratch,
                            );
                        }
                        let back = decode(&out, b).unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert!(back == raw, "{what}: decodes wrongly");
                        check_frame(&out, &what, &mut seen);
                    }
                }
            }
        }
    }
    assert!(seen.wide > 0 && seen.palette > 0 && seen.rows > 0 && seen.mapped > 0);
    assert!(
        seen.wide_palette > 0 && seen.wide_mapped > 0 && seen.wide_rows > 0,
        "{seen:?}"
    );
}

/// A version 11 frame relabelled 10 (or a frame with such a block
/// relabelled) must not decode to the input: the label is load-bearing.
#[test]
fn relabelled_version_11_frames_do_not_decode_alike() {
    for (li, &n) in [8192usize, 12288, 65536 + 8192].iter().enumerate() {
        for (name, dtype, raw, base) in inputs(n, 100 + li as u64) {
            let f = encode(&raw, Some(&base), dtype, &Options::default());
            let info = FrameInfo::parse(&f).unwrap();
            if info.version != WIDE_VERSION || info.rows {
                continue;
            }
            let mut old = f.clone();
            old[2] = UP_VERSION;
            let b = info.needs_base().then_some(base.as_slice());
            assert!(
                decode(&old, b).map_or(true, |x| x != raw),
                "{name} n={n}: relabelled frame decodes alike"
            );
        }
    }
}

/// `n` elements of `w` bytes of one of five kinds: gaussian floats (the
/// top bytes of an f32 for narrower widths), noise, near-noise low bytes
/// over a wide alphabet under structured high ones, a constant, small
/// skewed integers.
fn elements_of_kind(n: usize, w: usize, kind: u32, r: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * w);
    for i in 0..n {
        let v: u64 = match kind {
            // gaussian float bits of the width
            0 => {
                let g = r.gauss() as f64 * 0.02;
                match w {
                    8 => g.to_bits(),
                    4 => (g as f32).to_bits() as u64,
                    2 => ((g as f32).to_bits() >> 16) as u64,
                    _ => ((g as f32).to_bits() >> 24) as u64,
                }
            }
            // noise
            1 => r.next(),
            // near-noise low bytes over an alphabet, high bytes structured
            2 => {
                let k = 160 + (i as u64 % 3) * 40;
                let mut x = r.next() % k;
                for b in 1..w {
                    x |= ((r.next() % 5) + 60) << (8 * b);
                }
                x
            }
            // constant
            3 => 0x3c00_1234_5678_9abc,
            // small skewed ints
            _ => {
                let u = r.unit();
                ((u * u * u) * 50.0) as u64
            }
        };
        out.extend_from_slice(&v.to_le_bytes()[..w]);
    }
    out
}

/// Every dtype, at lengths around the delta search's sample sizes and
/// the 8 Ki (32 rANS states) and 16 Ki (sampled blocks) thresholds, five
/// kinds of data,
/// no base or a related, unrelated or identical one, four option sets,
/// with and without a trailing partial element: every frame decodes to
/// its input and has the version its blocks call for (from a review of
/// the encoder's sampled estimates).
#[test]
fn every_dtype_length_and_base_round_trips_around_the_sample_sizes() {
    let lens = [
        0usize, 1, 2, 3, 7, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 2050, 4095, 4096,
        4097, 8191, 8192, 8193, 12288, 16383, 16384, 16385, 20001,
    ];
    let dtypes = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F64,
        DType::F8E4M3,
        DType::U8,
        DType::I32,
        DType::I64,
    ];
    let opts = [
        ("default", Options::default()),
        ("lmc", Options::lmc()),
        (
            "no-gain",
            Options {
                rans_min_gain: 0.0,
                plain_rans_min_gain: 0.0,
                ..Options::default()
            },
        ),
        (
            "map",
            Options {
                element_map: ElementMap::Always,
                ..Options::default()
            },
        ),
    ];
    let mut seen = Seen::default();
    let mut scratch = Scratch::default();
    let mut out = Vec::new();
    let mut r = Rng(crate::testing::Rng(77));
    for &n in &lens {
        for &dtype in &dtypes {
            let w = dtype.width();
            for kind in 0..5u32 {
                let raw = elements_of_kind(n, w, kind, &mut r);
                // related base: flip low bits of some elements; unrelated; identical
                let mut related = raw.clone();
                for (i, b) in related.iter_mut().enumerate() {
                    if i % w == 0 && r.next() % 3 == 0 {
                        *b ^= (r.next() % 4) as u8;
                    }
                }
                let unrelated = elements_of_kind(n, w, (kind + 1) % 5, &mut r);
                let bases: [Option<&[u8]>; 4] =
                    [None, Some(&related), Some(&unrelated), Some(&raw)];
                for (oname, o) in &opts {
                    for (bi, b) in bases.iter().enumerate() {
                        let what = format!("{dtype} n={n} kind={kind} {oname} base#{bi}");
                        encode_into(&raw, *b, dtype, o, &mut out, &mut scratch);
                        let back = decode(&out, *b).unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert!(back == raw, "{what}: decodes wrongly");
                        check_frame(&out, &what, &mut seen);
                        // and with a trailing partial element
                        let mut raw2 = raw.clone();
                        raw2.push(7);
                        let b2: Option<Vec<u8>> = b.map(|b| {
                            let mut v = b.to_vec();
                            v.push(9);
                            v
                        });
                        if w > 1 {
                            encode_into(&raw2, b2.as_deref(), dtype, o, &mut out, &mut scratch);
                            let back = decode(&out, b2.as_deref())
                                .unwrap_or_else(|e| panic!("{what} tail: {e}"));
                            assert!(back == raw2, "{what} tail: decodes wrongly");
                            check_frame(&out, &what, &mut seen);
                        }
                    }
                }
            }
        }
    }
    assert!(seen.wide > 0);
}
