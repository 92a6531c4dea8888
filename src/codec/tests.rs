//! Whole-codec tests: round trips, known answers (the golden frames that
//! pin the on-disk bytes), corrupt frames. Each module's own tests sit
//! beside it.

use super::*;
use proptest::prelude::*;

fn rt(raw: &[u8], base: Option<&[u8]>, dtype: DType, opts: &Options) -> Vec<u8> {
    let f = encode(raw, base, dtype, opts);
    let info = FrameInfo::parse(&f).unwrap();
    assert_eq!(info.raw_len, raw.len() as u64);
    let back = decode(&f, base).unwrap();
    assert_eq!(
        back,
        raw,
        "dtype {dtype} len {} base {}",
        raw.len(),
        base.is_some()
    );
    f
}

fn all_options() -> [Options; 4] {
    let no_rans = Options {
        rans: false,
        ..Options::default()
    };
    let mapped = Options {
        element_map: ElementMap::Always,
        ..Options::default()
    };
    [Options::default(), Options::lmc(), no_rans, mapped]
}

/// 32 random bits at a time from the project's deterministic generator
/// (a non-zero seed).
fn random_u32s(seed: u32) -> impl FnMut() -> u32 {
    let mut r = crate::testing::Rng(seed as u64);
    move || (r.next_u64() >> 32) as u32
}

/// Bytes that look like a trained layer: N(0, 0.02) via a cheap generator.
fn gaussian_f32(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    let mut r = random_u32s(seed.wrapping_mul(2654435761).max(1));
    let mut next = || (r() as f32) / (u32::MAX as f32);
    (0..n)
        .map(|_| {
            let s: f32 = (0..4).map(|_| next()).sum::<f32>() - 2.0;
            s * scale
        })
        .collect()
}

/// 64 rows of 256 f32 whose exponents repeat from row to row (a row scale
/// times a column scale, as in Adam's second moment) while every mantissa
/// is noise.
fn repeated_exponent_rows() -> Vec<u8> {
    let mut next = random_u32s(11);
    let cols: Vec<f32> = (0..256)
        .map(|_| 2f32.powi(-((next() % 24) as i32)))
        .collect();
    let v: Vec<f32> = (0..64 * 256)
        .map(|i| cols[i % 256] * (1.0 + (next() % 1000) as f32 / 1001.0))
        .collect();
    f32_bytes(&v)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn unhex(h: &str) -> Vec<u8> {
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
        .collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&f| half::bf16::from_f32(f).to_le_bytes())
        .collect()
}

#[test]
fn edge_lengths_and_values_round_trip_for_every_dtype() {
    let specials: Vec<u8> = [
        0.0f32,
        -0.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE / 4.0,
        -1e-45,
        f32::MAX,
        f32::MIN,
        1.0,
    ]
    .iter()
    .flat_map(|f| f.to_le_bytes())
    .collect();
    for dtype in DType::ALL {
        for opts in all_options() {
            for len in [0usize, 1, 2, 3, 7, 9, 17, 100] {
                let raw: Vec<u8> = specials.iter().cycle().take(len).copied().collect();
                rt(&raw, None, dtype, &opts);
                let base: Vec<u8> = raw.iter().map(|b| b.wrapping_add(1)).collect();
                rt(&raw, Some(&base), dtype, &opts);
            }
            rt(&[0u8; 1000], None, dtype, &opts);
            rt(&[7u8; 200_003], None, dtype, &opts);
            rt(&specials, Some(&specials), dtype, &opts);
        }
    }
}

#[test]
fn multi_block_tensors_round_trip_full_and_delta() {
    let a = gaussian_f32(100_001, 1, 0.02);
    let b: Vec<f32> = a
        .iter()
        .zip(gaussian_f32(100_001, 2, 1e-4))
        .map(|(x, d)| x + d)
        .collect();
    for opts in all_options() {
        let (a32, b32) = (f32_bytes(&a), f32_bytes(&b));
        let full = rt(&b32, None, DType::F32, &opts);
        let delta = rt(&b32, Some(&a32), DType::F32, &opts);
        assert!(
            full.len() < b32.len() * 87 / 100,
            "fp32 full {}",
            full.len()
        );
        assert!(delta.len() < full.len(), "delta helps a small update");
        let (a16, b16) = (bf16_bytes(&a), bf16_bytes(&b));
        let full = rt(&b16, None, DType::BF16, &opts);
        assert!(
            full.len() < b16.len() * 72 / 100,
            "bf16 full {}",
            full.len()
        );
        rt(&b16, Some(&a16), DType::BF16, &opts);
        rt(&b16, Some(&a16), DType::F16, &opts);
        rt(&b32, Some(&a32), DType::F64, &opts);
    }
}

/// A large block's code is built on a sample of its symbols; symbols the
/// sample never sees (here every one off the sampled places, some of them
/// once only, one at each end of the range) must still get codes, under
/// Huffman and rANS alike, and the block must still be entropy coded.
#[test]
fn symbols_the_sample_misses_are_still_coded() {
    let n = 1 << 16;
    let mut seen = Vec::new();
    for skew in [3u32, 40] {
        let mut next = random_u32s(0x9e37_79b9);
        let syms: Vec<u8> = (0..n)
            .map(|i| {
                let x = next();
                match i {
                    _ if i % 4 == 0 => 100,
                    1 => 20,
                    5 => 250,
                    _ if x % skew == 0 => 90 + (x >> 8) as u8 % 16,
                    _ => 100,
                }
            })
            .collect();
        // (Sparse blocks are exact, whatever the sample saw: 1 in 40
        // symbols off the most common is sparse coding's.)
        for opts in all_options().map(|o| Options { sparse: false, ..o }) {
            let mut out = Vec::new();
            let mode = block::encode(
                &syms,
                None,
                None,
                &opts,
                &mut out,
                &mut block::EncodeScratch::default(),
            );
            assert!(
                matches!(
                    mode,
                    BlockMode::Huffman | BlockMode::Rans | BlockMode::RansGamma
                ),
                "skew {skew}: {mode:?}"
            );
            assert!(out.len() < n / 2, "skew {skew}: {} bytes", out.len());
            let mut back = vec![0u8; n];
            let mut tables = block::Tables::default();
            block::decode(
                FORMAT_VERSION,
                mode,
                &out,
                0,
                out.len(),
                None,
                &mut back,
                &mut tables,
            )
            .unwrap();
            assert_eq!(back, syms, "skew {skew} {mode:?}");
            seen.push(mode);
        }
    }
    assert!(
        seen.contains(&BlockMode::Huffman)
            && (seen.contains(&BlockMode::Rans) || seen.contains(&BlockMode::RansGamma))
    );
}

/// The 1-in-4 sample of a block past the noise screen is the screen's
/// 1-in-16 counts plus `sampled_rest`: the same counts as sampling afresh,
/// whatever the length.
#[test]
fn the_fine_sample_reuses_the_noise_screen() {
    let mut next = random_u32s(0x1234_5678);
    let syms: Vec<u8> = (0..70_000).map(|_| (next() % 97) as u8).collect();
    for n in (0..300).chain([16_383, 16_384, 16_400, 65_536, 69_999]) {
        let s = &syms[..n];
        let mut sum = stats::sampled_histogram(s, block::COARSE_STEP);
        for (a, b) in sum.iter_mut().zip(stats::sampled_rest(s)) {
            *a += b;
        }
        assert_eq!(
            sum,
            stats::sampled_histogram(s, block::SAMPLE_STEP),
            "n {n}"
        );
    }
}

/// Large blocks are first screened for noise on a coarse sample: noise is
/// raw, but a block just compressible enough to pay (uniform over 240
/// values, 7.91 bits/symbol: 1.1% under raw, over the 0.5% threshold) must
/// not be called noise.
#[test]
fn the_noise_screen_keeps_blocks_that_pay() {
    let n = 1 << 16;
    let mut next = random_u32s(0x2545_f491);
    let noise: Vec<u8> = (0..n).map(|_| next() as u8).collect();
    let near: Vec<u8> = (0..n).map(|_| (next() % 240) as u8).collect();
    let opts = Options::default();
    let mut scratch = block::EncodeScratch::default();
    let mut out = Vec::new();
    let mode = block::encode(&noise, None, None, &opts, &mut out, &mut scratch);
    // Raw: nothing appended, the caller keeps the symbols where they are.
    assert_eq!((mode, out.len()), (BlockMode::Raw, 0));
    out.clear();
    let mode = block::encode(&near, None, None, &opts, &mut out, &mut scratch);
    // (rANS with a gamma-coded table since format version 9: 7.91 bits a
    // symbol take rANS whenever it is the smaller.)
    assert!(
        matches!(mode, BlockMode::Huffman | BlockMode::RansGamma),
        "{mode:?}"
    );
    assert!(out.len() < n * 995 / 1000, "{} bytes", out.len());
}

#[test]
fn identical_base_gives_a_tiny_frame() {
    let a = f32_bytes(&gaussian_f32(300_000, 3, 0.02));
    let f = rt(&a, Some(&a), DType::F32, &Options::default());
    // every block of every stream is a constant run of zeros
    assert!(f.len() < 200, "{}", f.len());
    assert!(FrameInfo::parse(&f).unwrap().needs_base());
}

#[test]
fn unhelpful_base_is_not_used() {
    let a = f32_bytes(&gaussian_f32(50_000, 4, 0.02));
    let b = f32_bytes(&gaussian_f32(50_000, 5, 0.02));
    let f = encode(&a, Some(&b), DType::F32, &Options::default());
    assert!(!FrameInfo::parse(&f).unwrap().needs_base());
    assert_eq!(decode(&f, None).unwrap(), a);
}

#[test]
fn a_base_of_another_length_is_ignored() {
    let a = f32_bytes(&gaussian_f32(1000, 6, 0.02));
    let f = encode(&a, Some(&a[..40]), DType::F32, &Options::default());
    assert_eq!(decode(&f, None).unwrap(), a);
}

#[test]
fn decoding_a_delta_without_or_with_a_wrong_base_is_an_error() {
    let a = f32_bytes(&gaussian_f32(1000, 7, 0.02));
    let b: Vec<u8> = a.iter().map(|x| x ^ 1).collect();
    let f = encode(&b, Some(&a), DType::F32, &Options::default());
    assert_eq!(decode(&f, None), Err(DecodeError::BaseRequired));
    assert!(matches!(
        decode(&f, Some(&a[..8])),
        Err(DecodeError::BaseLength { .. })
    ));
}

/// Known answers: these bytes are the format. A change here is a format
/// change and needs a version bump and a CHANGELOG entry.
#[test]
fn known_answer_frames() {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    // Without the element map (its known answers are below), as these
    // frames were before version 4, and without a palette (below too),
    // which these few values would take.
    let never = Options {
        element_map: ElementMap::Never,
        small_zstd_max: 0,
        palette: Palette::Never,
        ..Options::default()
    };
    // bf16 [1.0, -2.0, 0.5] = 3f80 c000 3f00, rotated 7f00 8001 7e00:
    // stream 0 (mantissa|sign) 00 01 00 and stream 1 (exponent) 7f 80 7e,
    // both raw blocks (three symbols do not pay for a table).
    let raw = bf16_bytes(&[1.0, -2.0, 0.5]);
    let f = encode(&raw, None, DType::BF16, &never);
    assert_eq!(hex(&f), "434b070108040600030000000300000001007f807e");
    // 5 bytes of u8 all equal: one constant block, no tail.
    let f = encode(&[9u8; 5], None, DType::U8, &never);
    assert_eq!(hex(&f), "434b07010100050101000009");
    // f32 [0.25, 0.5] and a 3-byte tail; no base. Streams 0-2 are constant
    // zero, stream 3 (exponents 7d 7e) is raw; the tail follows the header.
    let mut raw = f32_bytes(&[0.25, 0.5]);
    raw.extend_from_slice(&[1, 2, 3]);
    let f = encode(&raw, Some(&raw), DType::F32, &never);
    assert_eq!(
        hex(&f),
        "434b07010b040b010203010100000101000001010000000200000000007d7e"
    );
    // 64 f32 against an identical base: per-stream delta (kind 1, rotated),
    // four stream ops, every stream one constant block of zeros.
    let raw = f32_bytes(&(0..64).map(|i| i as f32 * 0.1).collect::<Vec<_>>());
    let f = encode(&raw, Some(&raw), DType::F32, &never);
    assert_eq!(
        hex(&f),
        "434b07010b058002010101010101000001010000010100000101000000000000"
    );
    // 16 u8 of 10, 12, 14, 16 (the least plus 2 bits shifted by 1): one
    // packed block (mode 5), `lo 0a | bits 02 | shift 01` and 2 bits a
    // symbol, four a byte: 0,1,2,3 -> e4.
    let raw: Vec<u8> = (0..16).map(|i| 10 + 2 * (i % 4) as u8).collect();
    let f = encode(&raw, None, DType::U8, &never);
    assert_eq!(hex(&f), "434b0701010010050700000a0201e4e4e4e4");
}

/// Frames written by format versions 1 to 5 (the known answers above
/// before version 2, 3, 4, 5 and 6: the same bytes but the version, and
/// before 6 a 16-byte header with the raw length as a u64) still
/// decode, and still say their version; a packed block (version 3) in a
/// version 2 frame is an error, so is an element map (version 4) in a
/// version 3 frame, and a zstd block (version 5) in a version 4 frame.
#[test]
fn version_1_to_5_frames_still_decode() {
    for v in ["01", "02", "03", "04", "05"] {
        let f = unhex(&format!(
            "434b{v}0108041000060000000000000000030000000300000001007f807e"
        ));
        assert_eq!(FrameInfo::parse(&f).unwrap().version.to_string(), v[1..]);
        assert_eq!(decode(&f, None).unwrap(), bf16_bytes(&[1.0, -2.0, 0.5]));
        let f = unhex(&format!("434b{v}010100100005000000000000000101000009"));
        assert_eq!(decode(&f, None).unwrap(), [9u8; 5]);
        let mut raw = f32_bytes(&[0.25, 0.5]);
        raw.extend_from_slice(&[1, 2, 3]);
        let f = unhex(&format!(
            "434b{v}010b0410000b00000000000000010203010100000101000001010000000200000000007d7e"
        ));
        assert_eq!(decode(&f, Some(&raw)).unwrap(), raw);
    }
    // Version 5's known answers: the frame against an identical base, the
    // packed block and the element maps (runs, bitmap).
    let raw = f32_bytes(&(0..64).map(|i| i as f32 * 0.1).collect::<Vec<_>>());
    let f =
        unhex("434b05010b0510000001000000000000010101010101000001010000010100000101000000000000");
    assert_eq!(decode(&f, Some(&raw)).unwrap(), raw);
    let f = unhex("434b0501010010001000000000000000050700000a0201e4e4e4e4");
    let want: Vec<u8> = (0..16).map(|i| 10 + 2 * (i % 4) as u8).collect();
    assert_eq!(decode(&f, None).unwrap(), want);
    let f = unhex(
        "434b05010b0c100020000000000000000201000000cf010100000101000001010000000200000000007f80",
    );
    let want = f32_bytes(&[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0]);
    assert_eq!(decode(&f, None).unwrap(), want);
    let f = unhex(
        "434b05010b0c100000010000000000000103000000002818010100000101000001010000010100000000007f",
    );
    let mut want = vec![0.0f32; 40];
    want.extend([1.0f32; 24]);
    assert_eq!(decode(&f, None).unwrap(), f32_bytes(&want));
    let packed = unhex("434b0201010010001000000000000000050700000a0201e4e4e4e4");
    assert!(matches!(
        decode(&packed, None),
        Err(DecodeError::Corrupt { reason, .. }) if reason.contains("before format version 3")
    ));
    let mapped = unhex("434b03010b0c10002000000000000000020100000000cf0100000001000000010000000002000000000000007f80");
    assert!(matches!(
        decode(&mapped, None),
        Err(DecodeError::Corrupt { reason, .. }) if reason.contains("reserved transform bits")
    ));
    // The version 5 zstd known answer below, as a version 4 frame.
    let mut zstd = unhex(ZSTD_KAT);
    zstd[2] = 4;
    assert!(matches!(
        decode(&zstd, None),
        Err(DecodeError::Corrupt { reason, .. }) if reason.contains("before format version 5")
    ));
}

/// 4096 u8 of 16 distinct values (4 bits each, order-0) in a pattern of
/// 256 repeated: one zstd block (mode 6, 162 bytes), whose payload is a
/// zstd frame (magic 28b52ffd) without checksum or content size, as zstd
/// 1.5 level 1 writes it.
const ZSTD_KAT: &str = "434b050101001000001000000000000006a20000\
    28b52ffd0010cd04000690230610287d814f0d210020002000cdbc1167aa3846239df7041559c642\
    b795652d97da61ba4e8a26947648b0625806db41b1c70633947e43baba024660e881a80fdc33f081\
    864d7ecf8a881efd716126c161fa2b123fdbe222fd184f7928251ab8b61b64b8078072e11d09e774\
    158172599ac5f7295e363c2c5e45c84f5924024915192c488db1660182b6b3f26b2b010000fd1ef0\
    d714";

/// The input of [`ZSTD_KAT`]: 256 symbols of 0..16, repeated 16 times.
fn zstd_kat_input() -> Vec<u8> {
    let mut next = random_u32s(5);
    let row: Vec<u8> = (0..256).map(|_| (next() % 16) as u8).collect();
    row.repeat(16)
}

/// Known answer of a zstd block (version 5): the bytes of a block whose
/// strings repeat, as this encoder writes and every decoder must read
/// them.
#[test]
fn zstd_block_known_answer() {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let raw = zstd_kat_input();
    let f = unhex(ZSTD_KAT);
    assert_eq!(decode(&f, None).unwrap(), raw);
    // This encoder writes it so (another zstd release may pick other
    // matches: then only the frame's header and mode are pinned here).
    // Versions 6 and 7 write the same block after their shorter header
    // (raw length 4096 as LEB128: 80 20), when the chunk is not one zstd
    // frame whole.
    let blocks = Options {
        small_zstd_max: 0,
        regroup: false,
        ..Options::default()
    };
    let ours = encode(&raw, None, DType::U8, &blocks);
    let short = format!("434b0701010080 20{}", &ZSTD_KAT[32..]).replace(' ', "");
    assert_eq!(hex(&ours[..11]), short[..22]);
    assert_eq!(decode(&ours, None).unwrap(), raw);
    assert_eq!(hex(&ours), short);
    // A zstd block that decodes to fewer or more symbols than the block
    // has, or is not a zstd frame, is corrupt, never a panic.
    let mut short = f.clone();
    short[8] = 0xff; // raw length 4095: the block holds one symbol less
    let mut long = f.clone();
    long[9] = 0x20; // raw length 8192, one block of 8192 symbols
    let mut magic = f.clone();
    magic[20] ^= 0xff;
    // An empty zstd frame after the block's (the table's length grown to
    // cover it): zstd alone would decode both, to the same 4096 symbols.
    let mut two = f.clone();
    let empty = zstd::bulk::compress(&[], 1).unwrap();
    two.extend_from_slice(&empty);
    let len = (0xa2 + empty.len() as u32) << 8 | 6;
    two[16..20].copy_from_slice(&len.to_le_bytes());
    let mut flipped = f.clone();
    let l = flipped.len();
    flipped[l - 3] ^= 0x55;
    for bad in [short, long, magic, two] {
        assert!(matches!(
            decode(&bad, None),
            Err(DecodeError::Corrupt { reason, .. }) if reason.contains("zstd block")
        ));
    }
    assert!(decode(&flipped, None).map_or(true, |d| d != raw));
}

/// Rows of f32 whose exponents repeat from row to row (a row scale times a
/// column scale, as in Adam's second moment) while every mantissa is
/// noise: the exponent stream is a zstd block, smaller than without it,
/// and the frame round trips, FULL, with the element map, and with a zstd
/// level of 0 (no zstd block) too.
#[test]
fn zstd_blocks_catch_repeated_exponent_rows() {
    let raw = repeated_exponent_rows();
    let blocks = Options {
        small_zstd_max: 0,
        ..Options::default()
    };
    let f = rt(&raw, None, DType::F32, &blocks);
    let off = Options {
        zstd_level: 0,
        ..Options::default()
    };
    let without = rt(&raw, None, DType::F32, &off);
    assert!(
        f.len() * 10 < without.len() * 9,
        "{} vs {}",
        f.len(),
        without.len()
    );
    // Stream 3 (exponents) is one block after the table of 4: mode byte 6.
    let h = FrameInfo::parse(&f).unwrap().header_len;
    assert_eq!(f[h + 12], BlockMode::Zstd as u8);
    for opts in all_options() {
        rt(&raw, None, DType::F32, &opts);
    }
}

/// Rows copied whole pay with zstd however few values the exponent stream
/// takes: below `ZSTD_LOW_BITS` a block is still tried when the probe
/// finds most of it repeated (here four exponents at 1/2, 1/4, 1/8, 1/8:
/// 1.75 bits a symbol, which bit packing does not reach).
#[test]
fn zstd_blocks_catch_rows_repeated_in_a_low_entropy_stream() {
    let mut next = random_u32s(12);
    let cols: Vec<f32> = (0..256)
        .map(|_| 2f32.powi(-[0, 0, 0, 0, 1, 1, 2, 3][(next() % 8) as usize]))
        .collect();
    let v: Vec<f32> = (0..64 * 256)
        .map(|i| cols[i % 256] * (1.0 + (next() % 1000) as f32 / 1001.0))
        .collect();
    let raw = f32_bytes(&v);
    let blocks = Options {
        small_zstd_max: 0,
        ..Options::default()
    };
    let f = rt(&raw, None, DType::F32, &blocks);
    let h = FrameInfo::parse(&f).unwrap().header_len;
    assert_eq!(f[h + 12], BlockMode::Zstd as u8);
}

/// Known answers of the element map (version 4): the skipped elements are
/// zero without a base, the base's with one; the map is stored as runs or
/// as a bitmap, whichever is shorter.
#[test]
fn element_map_known_answers() {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let always = Options {
        element_map: ElementMap::Always,
        small_zstd_max: 0,
        palette: Palette::Never,
        ..Options::default()
    };
    // f32 [0, 0, 0, 0, 1.0, 2.0, 0, 0]: transform 0c (rotated, element
    // map); map kind 2 (bitmap), 1 byte: elements 0-3, 6, 7 skipped = cf.
    // The two kept elements 3f800000 4000000 rotate to 7f000000 80000000:
    // streams 0-2 constant zero, stream 3 raw 7f 80.
    let raw = f32_bytes(&[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0]);
    let f = encode(&raw, None, DType::F32, &always);
    assert_eq!(
        hex(&f),
        "434b07010b0c200201000000cf010100000101000001010000000200000000007f80"
    );
    assert_eq!(decode(&f, None).unwrap(), raw);
    // 64 f32: 40 zeros, then 24 of 1.0; runs 0 kept, 40 skipped, 24 kept
    // (map kind 1, 3 bytes: 00 28 18), shorter than the 8-byte bitmap.
    // The 24 kept elements: streams 0-2 constant 00, stream 3 constant 7f.
    let mut v = vec![0.0f32; 40];
    v.extend([1.0f32; 24]);
    let raw = f32_bytes(&v);
    let f = encode(&raw, None, DType::F32, &always);
    assert_eq!(
        hex(&f),
        "434b07010b0c80020103000000002818010100000101000001010000010100000000007f"
    );
    assert_eq!(decode(&f, None).unwrap(), raw);
    // Against a base, elements equal to the base's are skipped: here all
    // but element 1 of 4 (runs 0, 1, 1, 2: 00 01 01 02, a 1-byte bitmap
    // wins: 0b1101 = 0d); the frame needs the base (per-stream, ops keep).
    let base = f32_bytes(&[0.5, 0.25, -1.0, 3.0]);
    let new = f32_bytes(&[0.5, 0.75, -1.0, 3.0]);
    let f = encode(&new, Some(&base), DType::F32, &always);
    let info = FrameInfo::parse(&f).unwrap();
    assert!(info.element_map && info.needs_base());
    assert_eq!(decode(&f, Some(&base)).unwrap(), new);
    let h = info.header_len;
    assert_eq!(hex(&f[h..h + 10]), hex(&[0, 0, 0, 0, 2, 1, 0, 0, 0, 0x0d]));
}

/// A delta where a scattered share of the elements is unchanged (an early
/// bf16 run's weights, where most updates round away) has an element map
/// the decoder gathers and expands by skip bits: the AVX2 moves (2- and
/// 4-byte elements) and the element loops give the same chunk, for every
/// width, at shares from a few to most skipped, with long runs between.
#[test]
fn scattered_element_maps_decode_alike_with_and_without_the_avx2_moves() {
    let mut next = random_u32s(77);
    for dtype in [DType::U8, DType::BF16, DType::F32, DType::F64] {
        let w = dtype.width();
        for share in [1u32, 2, 3] {
            let n = 5000 + share as usize * 7;
            let base: Vec<u8> = (0..n * w).map(|_| next() as u8).collect();
            let mut raw = base.clone();
            for i in 0..n {
                // Elements 1000..1300 all changed, 2000..2400 all kept:
                // whole words of one kind between the scattered ones.
                let changed = match i {
                    1000..1300 => true,
                    2000..2400 => false,
                    _ => next() % 4 >= share,
                };
                if changed {
                    raw[i * w] ^= 0x5a;
                }
            }
            let opts = Options {
                element_map: ElementMap::Always,
                ..Options::default()
            };
            let f = encode(&raw, Some(&base), dtype, &opts);
            assert!(FrameInfo::parse(&f).unwrap().element_map);
            for simd in [true, false] {
                elements::set_simd_moves(simd);
                let back = decode(&f, Some(&base));
                elements::set_simd_moves(true);
                assert_eq!(back.unwrap(), raw, "{dtype} share {share} simd {simd}");
            }
        }
    }
}

#[test]
fn the_element_map_is_chosen_for_zero_rows_and_not_for_scattered_zeros() {
    // Adam's first moment of an embedding whose unused rows stay zero:
    // 64 rows of 128, every third row nonzero.
    let mut v = Vec::new();
    for r in 0..64 {
        let g = gaussian_f32(128, r + 1, 1e-3);
        v.extend(if r % 3 == 0 { g } else { vec![0.0; 128] });
    }
    let raw = f32_bytes(&v);
    let f = rt(&raw, None, DType::F32, &Options::default());
    assert!(FrameInfo::parse(&f).unwrap().element_map);
    let never = Options {
        element_map: ElementMap::Never,
        ..Options::default()
    };
    assert!(f.len() < encode(&raw, None, DType::F32, &never).len());
    // One element in three zero, none next to another: the bitmap (a bit
    // an element) still costs less than the zeros in four streams.
    let v: Vec<f32> = gaussian_f32(8192, 7, 1e-3)
        .into_iter()
        .enumerate()
        .map(|(i, x)| if i % 3 == 0 { 0.0 } else { x })
        .collect();
    let raw = f32_bytes(&v);
    let f = rt(&raw, None, DType::F32, &Options::default());
    assert!(FrameInfo::parse(&f).unwrap().element_map);
    assert!(f.len() < encode(&raw, None, DType::F32, &never).len());
    // No zeros: no map.
    let f = rt(
        &f32_bytes(&gaussian_f32(8192, 9, 1e-3)),
        None,
        DType::F32,
        &Options::default(),
    );
    assert!(!FrameInfo::parse(&f).unwrap().element_map);
    // An identical base: every element skipped, a frame of a header, the
    // stream ops and a bitmap.
    let raw = f32_bytes(&gaussian_f32(64, 3, 1.0));
    let f = rt(&raw, Some(&raw), DType::F32, &Options::default());
    assert!(f.len() <= 16 + 4 + 5 + 8, "{}", f.len());
}

#[test]
fn every_truncation_of_a_frame_is_an_error() {
    let a = f32_bytes(&gaussian_f32(70_000, 8, 0.02));
    let b: Vec<f32> = gaussian_f32(70_000, 8, 0.02)
        .iter()
        .map(|x| x * 1.001)
        .collect();
    let b = f32_bytes(&b);
    for opts in all_options() {
        for base in [None, Some(a.as_slice())] {
            let f = encode(&b, base, DType::F32, &opts);
            let step = (f.len() / 300).max(1);
            for cut in (0..f.len()).step_by(step) {
                assert!(
                    decode(&f[..cut], base).is_err(),
                    "cut at {cut} of {}",
                    f.len()
                );
            }
        }
    }
}

#[test]
fn declared_sizes_are_bounded() {
    // Version 6: the raw length is LEB128 at byte 6 (here 1 byte, 04).
    let f = encode(&[1u8, 2, 3, 4], None, DType::U8, &Options::default());
    assert_eq!(f[6], 4);
    let mut f = [&f[..6], &[0x81, 0x80, 0x80, 0x80, 0x04], &f[7..]].concat();
    assert!(matches!(
        decode(&f, None),
        Err(DecodeError::TooLarge { .. })
    ));
    // Version 5: a u64 at byte 8.
    f = unhex("434b05010100100005000000000000000101000009");
    f[8..16].copy_from_slice(&(HARD_MAX_RAW_LEN + 1).to_le_bytes());
    assert!(matches!(
        decode(&f, None),
        Err(DecodeError::TooLarge { .. })
    ));
    let mut out = Vec::new();
    let mut s = Scratch::default();
    let f = encode(&[0u8; 4096], None, DType::U8, &Options::default());
    assert!(matches!(
        decode_into(&f, None, 100, &mut out, &mut s),
        Err(DecodeError::TooLarge { .. })
    ));
}

#[test]
fn header_fields_are_validated() {
    // A plain frame (rotated): bit 7 (palette) with rotation is corrupt.
    let plain = Options {
        palette: Palette::Never,
        ..Options::default()
    };
    let good = encode(&[1u8, 2, 3, 4, 5, 6, 7, 8], None, DType::F32, &plain);
    let mut f = good.clone();
    f[0] = b'X';
    assert_eq!(decode(&f, None), Err(DecodeError::BadMagic));
    let mut f = good.clone();
    f[2] = FORMAT_VERSION + 1;
    assert!(matches!(
        decode(&f, None),
        Err(DecodeError::VersionTooNew { found, .. }) if found == FORMAT_VERSION + 1
    ));
    let mut f = good.clone();
    f[3] = 2;
    assert_eq!(decode(&f, None), Err(DecodeError::UnknownCodec(2)));
    let mut f = good.clone();
    f[4] = 99;
    assert_eq!(decode(&f, None), Err(DecodeError::UnknownDType(99)));
    let mut f = good.clone();
    f[5] |= 0x80;
    assert!(decode(&f, None).is_err());
    let mut f = good;
    f.push(0);
    assert!(decode(&f, None).is_err(), "trailing bytes");
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    (0u8..15).prop_map(|c| DType::from_code(c).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_bytes_round_trip(raw in proptest::collection::vec(any::<u8>(), 0..3000),
                               dtype in dtype_strategy(), with_base: bool, lmc: bool) {
        let opts = if lmc { Options::lmc() } else { Options::default() };
        let base: Vec<u8> = raw.iter().rev().copied().collect();
        rt(&raw, with_base.then_some(base.as_slice()), dtype, &opts);
    }

    #[test]
    fn low_entropy_bytes_round_trip(raw in proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), any::<u8>()], 0..5000),
                                    dtype in dtype_strategy()) {
        rt(&raw, None, dtype, &Options::default());
        let base: Vec<u8> = raw.iter().map(|&b| if b > 200 { b ^ 3 } else { b }).collect();
        rt(&raw, Some(&base), dtype, &Options::default());
    }

    #[test]
    fn corrupt_frames_never_panic(seed in any::<u64>(), flips in 1usize..8) {
        let a = f32_bytes(&gaussian_f32(20_000, (seed % 1000) as u32, 0.02));
        let b: Vec<u8> = a.iter().enumerate().map(|(i, &x)| if i % 4 == 0 { x ^ 0x11 } else { x }).collect();
        let mut f = encode(&b, Some(&a), DType::F32, &Options::default());
        let mut s = seed;
        for _ in 0..flips {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let i = (s >> 33) as usize % f.len();
            f[i] ^= 1 << ((s >> 20) % 8);
        }
        // Either an error or some bytes; blake3 at the store catches the rest.
        let _ = decode(&f, Some(&a));
    }
}

/// `torch.get_rng_state()` as a checkpoint stores it: a u8 tensor of
/// 5056 bytes, 624 random 32-bit words of the Mersenne Twister in 64-bit
/// slots after a 16-byte head, zeros after. Grouped by 8-byte words
/// (version 6) the high halves are 4 streams of zeros; the frame is one
/// zstd frame of the streams, smaller than zstd -19 on the bytes.
#[test]
fn rng_states_group_by_words_and_beat_zstd() {
    let mut next = random_u32s(17);
    let rng = |next: &mut dyn FnMut() -> u32| {
        let mut raw = vec![0u8; 5056];
        raw[8] = 47;
        raw[12] = 1;
        raw[16..18].copy_from_slice(&[0x66, 0x02]);
        for i in 0..624 {
            raw[24 + 8 * i..28 + 8 * i].copy_from_slice(&next().to_le_bytes());
        }
        raw
    };
    let old = rng(&mut next);
    let raw = rng(&mut next);
    for base in [None, Some(old.as_slice())] {
        let f = rt(&raw, base, DType::U8, &Options::default());
        let info = FrameInfo::parse(&f).unwrap();
        assert_eq!(info.group_width, 8);
        assert!(info.whole_zstd);
        let peer = zstd::bulk::compress(&raw, 19).unwrap().len();
        assert!(f.len() < peer, "{} vs zstd -19 {peer}", f.len());
        for opts in all_options() {
            rt(&raw, base, DType::U8, &opts);
        }
    }
    // Bytes without such structure keep the dtype's width.
    let noise: Vec<u8> = (0..1264).flat_map(|_| next().to_le_bytes()).collect();
    let f = rt(&noise, None, DType::U8, &Options::default());
    assert_eq!(FrameInfo::parse(&f).unwrap().group_width, 1);
}

/// A whole-zstd frame of random words stores zstd's literals as they
/// are (no Huffman table): the frame is the one zstd gives with literal
/// compression off, in a delta frame (the search's histograms known) and
/// a full one alike; bytes of few values keep theirs coded.
#[test]
fn random_words_leave_zstd_literals_uncoded() {
    let mut next = random_u32s(29);
    let words = |next: &mut dyn FnMut() -> u32, mask: u32| -> Vec<u8> {
        (0..632)
            .flat_map(|_| (u64::from(next() & mask)).to_le_bytes())
            .collect()
    };
    let zstd_of = |streams: &[u8], literals: bool| {
        let mut scratch = block::EncodeScratch::default();
        let z = block::zstd_compress(streams, SMALL_ZSTD_LEVEL, literals, &mut scratch).unwrap();
        scratch.zstd_out[..z].to_vec()
    };
    for (mask, coded) in [(u32::MAX, false), (0x0f0f_0f0f, true)] {
        let (old, raw) = (words(&mut next, mask), words(&mut next, mask));
        for base in [Some(old.as_slice()), None] {
            let f = rt(&raw, base, DType::U8, &Options::default());
            let info = FrameInfo::parse(&f).unwrap();
            assert!(info.whole_zstd && info.group_width == 8 && !info.needs_base());
            let streams = grouped_streams(&raw, None, DType::U64).concat();
            let z = &f[info.header_len..];
            // Without the delta search's histograms (a full frame) the
            // literals are coded as before.
            let expect_coded = coded || base.is_none();
            assert_eq!(
                z,
                zstd_of(&streams, expect_coded),
                "mask {mask:x} base {}",
                base.is_some()
            );
        }
    }
}

/// A delta whose streams are mostly one byte, scattered rather than in
/// runs (a 632-word i64 chunk of which 80% of the bytes did not change),
/// keeps zstd's literals coded: that byte is most of zstd's literals, not
/// its matches. Taken out of the count as if it came in runs, it made
/// zstd's frame 2279 bytes, not the 1925 it gives coding them.
#[test]
fn a_scattered_majority_byte_keeps_zstd_literals_coded() {
    let mut next = random_u32s(59);
    let old: Vec<u8> = (0..632 * 8).map(|_| next() as u8).collect();
    let raw: Vec<u8> = old
        .iter()
        .map(|&b| match next() % 5 {
            0 => b ^ (next() as u8).max(1),
            _ => b,
        })
        .collect();
    let f = rt(&raw, Some(&old), DType::I64, &Options::default());
    let info = FrameInfo::parse(&f).unwrap();
    assert!(info.whole_zstd && info.group_width == 8 && info.needs_base());
    // The zstd frame ends the frame (after the delta ops, element map).
    let at = (info.header_len..f.len())
        .find(|&p| zstd::zstd_safe::find_frame_compressed_size(&f[p..]) == Ok(f.len() - p))
        .unwrap();
    let z = &f[at..];
    let streams = zstd::bulk::decompress(z, raw.len()).unwrap();
    let mut scratch = block::EncodeScratch::default();
    let coded = block::zstd_compress(&streams, SMALL_ZSTD_LEVEL, true, &mut scratch).unwrap();
    assert_eq!(
        z,
        &scratch.zstd_out[..coded],
        "{} bytes, coded {coded}",
        z.len()
    );
}

/// `literals_pay`: a table pays for literals of few values, not for
/// uniform bytes of one 632-word chunk, nor where no stream holds
/// literals (runs of one byte).
#[test]
fn literals_pay_only_for_a_table_worth_its_cost() {
    let mut next = random_u32s(31);
    // The streams, one after another, and their histograms.
    let pay = |streams: &[&[u8]]| {
        let n = streams.first().map_or(632, |s| s.len());
        let hists: Vec<_> = streams.iter().map(|s| histogram(s)).collect();
        literals_pay(&streams.concat(), n, &hists)
    };
    let noise: Vec<u8> = (0..632).map(|_| next() as u8).collect();
    let few: Vec<u8> = (0..632).map(|_| (next() % 16) as u8).collect();
    let zeros = vec![0u8; 632];
    let mut sparse = zeros.clone();
    sparse[5] = 9;
    assert!(!pay(&[&noise, &noise, &zeros, &sparse]));
    assert!(pay(&[&few, &zeros]));
    assert!(!pay(&[&zeros, &sparse]));
    // Mostly zeros, the rest of few values: the rest pays.
    let mostly_zero: Vec<u8> = few.iter().map(|&b| if b < 10 { 0 } else { b }).collect();
    assert!(pay(&[&mostly_zero, &zeros]));
    assert!(!pay(&[]));
    // 64 Ki bytes of a skewed alphabet of all 256 values pay.
    let skewed: Vec<u8> = (0..65536)
        .map(|_| (next() % 256).min(next() % 256) as u8)
        .collect();
    assert!(pay(&[&skewed]));
}

proptest! {
    /// `run_repeats` (32 bytes at a time where they are all the byte)
    /// counts what a byte-by-byte walk counts: the repeats in runs of
    /// `LITERAL_RUN` or more.
    #[test]
    fn run_repeats_counts_as_a_byte_walk(
        runs in proptest::collection::vec((0u8..3, 1usize..80), 0..40),
    ) {
        let s: Vec<u8> = runs.iter().flat_map(|&(b, n)| std::iter::repeat_n(b, n)).collect();
        for d in 0u8..3 {
            let (mut want, mut run) = (0u32, 0usize);
            for &b in s.iter().chain([&u8::MAX]) {
                if b == d {
                    run += 1;
                } else {
                    if run >= LITERAL_RUN {
                        want += run as u32 - 1;
                    }
                    run = 0;
                }
            }
            prop_assert_eq!(run_repeats(&s, d), want);
        }
    }
}

/// A reused zstd context that switches its literal coding off and on
/// gives the frames fresh contexts give.
#[test]
fn zstd_context_switches_literal_coding_as_a_fresh_one() {
    let mut next = random_u32s(37);
    let data: Vec<u8> = (0..4096).map(|_| (next() % 40) as u8).collect();
    let fresh = |literals: bool| {
        let mut s = block::EncodeScratch::default();
        let z = block::zstd_compress(&data, 3, literals, &mut s).unwrap();
        s.zstd_out[..z].to_vec()
    };
    let (on, off) = (fresh(true), fresh(false));
    assert_ne!(on, off);
    let mut s = block::EncodeScratch::default();
    for (literals, level, want) in [
        (true, 3, &on),
        (false, 3, &off),
        (true, 1, &fresh(true)),
        (false, 3, &off),
        (true, 3, &on),
    ] {
        if level != 3 {
            let z = block::zstd_compress(&data, level, literals, &mut s).unwrap();
            assert_eq!(
                zstd::bulk::decompress(&s.zstd_out[..z], 4096).unwrap(),
                data
            );
            continue;
        }
        let z = block::zstd_compress(&data, level, literals, &mut s).unwrap();
        assert_eq!(&s.zstd_out[..z], want.as_slice(), "literals {literals}");
    }
}

/// `group_width`'s counts, merged from the 8-byte words' streams, are
/// the histograms and entropies of the chosen width's streams.
#[test]
fn group_width_counts_are_the_chosen_streams() {
    let mut next = random_u32s(41);
    let mut cases: Vec<(DType, Vec<u8>)> = Vec::new();
    for mask in [u32::MAX, 0xffff, 0x00ff_00ff, 0x0300_0003] {
        let b: Vec<u8> = (0..700)
            .flat_map(|_| (next() & mask).to_le_bytes())
            .collect();
        cases.extend([
            (DType::U8, b.clone()),
            (DType::I16, b.clone()),
            (DType::I32, b),
        ]);
    }
    let mut widths = std::collections::BTreeSet::new();
    for (dtype, raw) in cases {
        let (w, counted) = group_width(&raw, dtype, true);
        let counted = counted.expect("every byte counted");
        widths.insert(w);
        let as_words = match w {
            1 => DType::U8,
            2 => DType::U16,
            4 => DType::I32,
            _ => DType::I64,
        };
        let streams = grouped_streams(&raw, None, as_words);
        assert_eq!(counted.len(), w);
        for (c, s) in counted.iter().zip(&streams) {
            assert_eq!(c.hist, histogram(s));
            assert!((c.bits - entropy_bits(&c.hist)).abs() < 1e-9);
        }
    }
    assert!(widths.len() >= 3, "widths chosen: {widths:?}");
}

/// Integers that moved by little since the base (counters, indices of a
/// data loader, as `i64` and as the `u8` bytes of 64-bit words) take the
/// whole element's difference: its estimate is skipped only where the
/// streams' own deltas do not pay, and here they do (every low byte is a
/// small difference, the next a borrow the element's difference has not).
#[test]
fn integers_that_moved_by_little_take_the_element_difference() {
    let mut next = random_u32s(21);
    let base: Vec<u64> = (0..2000)
        .map(|_| (next() as u64) << 20 | next() as u64 >> 12)
        .collect();
    let new: Vec<u64> = base
        .iter()
        .map(|&b| b.wrapping_add_signed(next() as i64 % 101))
        .collect();
    let bytes = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (raw, base) = (bytes(&new), bytes(&base));
    for dtype in [DType::I64, DType::U8] {
        let f = rt(&raw, Some(&base), dtype, &Options::default());
        let info = FrameInfo::parse(&f).unwrap();
        assert_eq!((info.delta, info.group_width), (Delta::Ulp, 8), "{dtype}");
        // About a byte an element: the low byte of the difference.
        assert!(f.len() < raw.len() / 7, "{dtype}: {} bytes", f.len());
    }
}

/// The delta search counts the streams it estimates over the whole of a
/// chunk shorter than its sample; the counts of the streams it chose stand
/// in for the blocks' own (the early whole-zstd exit of a small chunk), so
/// they must be the frame's streams exactly, whatever it chose.
#[test]
fn the_delta_searchs_histograms_are_the_frames_streams() {
    let a = gaussian_f32(2000, 31, 0.02);
    let floats = f32_bytes(&a);
    let moved = f32_bytes(&a.iter().map(|x| x * 1.0001).collect::<Vec<_>>());
    let unrelated = f32_bytes(&gaussian_f32(2000, 32, 0.02));
    let xored: Vec<u8> = floats
        .iter()
        .enumerate()
        .map(|(i, &x)| if i % 4 == 0 { x ^ 0x11 } else { x })
        .collect();
    let mut next = random_u32s(33);
    let counters: Vec<u64> = (0..1500)
        .map(|_| (next() as u64) << 12 | (next() as u64 >> 24))
        .collect();
    let words = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let counted = words(
        &counters
            .iter()
            .map(|c| c.wrapping_add_signed(next() as i64 % 101))
            .collect::<Vec<_>>(),
    );
    let noise: Vec<u8> = (0..1000).flat_map(|_| next().to_le_bytes()).collect();
    let halves = bf16_bytes(&a);
    let halves_moved = bf16_bytes(&a.iter().map(|x| x * 1.01).collect::<Vec<_>>());
    // 64-bit words: a random low half, a byte that counts up by one, zeros.
    let counting = |next: &mut dyn FnMut() -> u32| -> (Vec<u8>, Vec<u8>) {
        (0..1500)
            .map(|_| (next() as u64, next() as u64 & 0xff, next() as u64))
            .map(|(lo, b, new_lo)| (lo | b << 32, new_lo | ((b + 1) % 256) << 32))
            .fold((Vec::new(), Vec::new()), |(mut o, mut n), (a, b)| {
                o.extend_from_slice(&a.to_le_bytes());
                n.extend_from_slice(&b.to_le_bytes());
                (o, n)
            })
    };
    let (count_base, count_new) = counting(&mut next);
    let block = gaussian_f32(block::RANS_CTX_MIN_SYMBOLS, 34, 0.02);
    // bf16: a sample of 4 Ki 4-byte floats would not be the whole chunk.
    let block_bytes = bf16_bytes(&block);
    let block_moved = bf16_bytes(&block.iter().map(|x| x * 1.01).collect::<Vec<_>>());
    let cases = [
        (DType::F32, &moved, &floats),
        (DType::F32, &unrelated, &floats),
        (DType::F32, &xored, &floats),
        (DType::BF16, &halves_moved, &halves),
        (DType::I64, &counted, &words(&counters)),
        (DType::U8, &counted, &words(&counters)),
        (DType::U8, &noise, &noise.iter().rev().copied().collect()),
        (DType::U8, &count_new, &count_base),
        (DType::BF16, &block_moved, &block_bytes),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (dtype, raw, base) in cases {
        let (w, counted) = group_width(raw, dtype, true);
        let n = raw.len() / w;
        let (body, base) = (&raw[..n * w], &base[..n * w]);
        let float = dtype.is_float();
        let ctx_ok = n >= block::RANS_CTX_MIN_SYMBOLS;
        let (choice, hists) = choose_delta(
            body,
            base,
            w,
            float,
            float,
            ctx_ok,
            counted.as_deref(),
            true,
        );
        let (delta, ops) = match choice {
            Choice::Ulp => (Delta::Ulp, vec![StreamOp::Keep; w]),
            Choice::PerStream(ops) => (Delta::PerStream, ops),
        };
        let kind = match delta {
            Delta::Ulp => "ulp",
            _ if ops.iter().all(|&o| o == StreamOp::Keep) => "keep",
            _ => "per stream",
        };
        seen.insert((kind, counted.is_some(), ctx_ok));
        let mut region = vec![MaybeUninit::new(0u8); n * w];
        frame_streams_into(
            body,
            Some(base),
            delta,
            &ops,
            w,
            float,
            float,
            &mut Vec::new(),
            &mut region,
        );
        // SAFETY: every byte was initialised by `MaybeUninit::new`.
        let streams: Vec<u8> = region.iter().map(|b| unsafe { b.assume_init() }).collect();
        let hists = hists.expect("a chunk shorter than the sample is counted whole");
        assert_eq!(hists.len(), w);
        for (k, (s, h)) in streams.chunks(n).zip(&hists).enumerate() {
            assert!(
                histogram(s) == *h,
                "{dtype} stream {k} of {ops:?} {delta:?}"
            );
        }
    }
    // Every choice, each with the streams as they are counted here and by
    // group_width, and with the context model's estimates.
    for want in [
        ("keep", false, false),
        ("keep", true, false),
        ("per stream", false, false),
        ("per stream", true, false),
        ("ulp", false, false),
        ("ulp", true, false),
    ] {
        assert!(seen.contains(&want), "{want:?} is covered: {seen:?}");
    }
    assert!(
        seen.iter().any(|c| c.2),
        "a context-modelled case: {seen:?}"
    );
}

/// The delta search samples at most 8 KiB of a float chunk (a run of 512
/// fp32 or 256 f64 elements, four runs), 1024-element runs of bf16 and
/// of integers, whatever their width.
#[test]
fn the_delta_search_samples_at_most_8_kib_of_a_float_chunk() {
    assert_eq!(search_run(4, true), 512);
    assert_eq!(search_run(8, true), 256);
    assert_eq!(search_run(2, true), 1024);
    assert_eq!(search_run(1, true), 1024);
    assert_eq!(search_run(8, false), 1024);
    for w in [1, 2, 4, 8] {
        assert!(search_run(w, true) * w * SEARCH_RUNS <= 8 * 1024);
    }
}

/// Values in a narrow band (the high byte 3 or 4) moved by more than the
/// low byte spans: no stream's difference pays (the low byte's is noise,
/// the high byte's no cheaper than itself), but the element's saves the
/// high byte's bit of carries. The element difference's estimate was
/// once skipped for every integer chunk whose streams' deltas did not
/// pay, and these frames came out 14% larger.
#[test]
fn narrow_band_integers_moved_past_their_low_byte_take_the_element_difference() {
    let mut next = random_u32s(35);
    let base: Vec<i64> = (0..3000).map(|_| 1000 + (next() % 256) as i64).collect();
    let new: Vec<i64> = base
        .iter()
        .map(|b| b + (next() % 256) as i64 - 128)
        .collect();
    for dtype in [DType::I16, DType::I32] {
        let bytes = |v: &[i64]| -> Vec<u8> {
            v.iter()
                .flat_map(|&x| x.to_le_bytes()[..dtype.width()].to_vec())
                .collect()
        };
        let (raw, old) = (bytes(&new), bytes(&base));
        let f = rt(&raw, Some(&old), dtype, &Options::default());
        assert_eq!(FrameInfo::parse(&f).unwrap().delta, Delta::Ulp, "{dtype}");
        // A byte an element (the skip made it 3442 and 3460 bytes).
        assert!(f.len() < 3100, "{dtype}: {} bytes", f.len());
    }
}

/// Known answer of version 6's new fields: u8 grouped by 8-byte words
/// (transform bits 4-5 = 3) and the streams as one zstd frame (bit 6).
/// 16 u8 [5, 0 x 7, 6, 0 x 7]: streams 05 06 | 00 00 | ... (16 bytes) in
/// one zstd frame; the header is 434b 06 01 01 70 10.
#[test]
fn grouped_whole_zstd_known_answer() {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let raw = [5u8, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0];
    let streams = [5u8, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let mut f = unhex("434b060101701 0".replace(' ', "").as_str());
    f.extend(zstd::bulk::compress(&streams, 3).unwrap());
    assert_eq!(decode(&f, None).unwrap(), raw);
    let info = FrameInfo::parse(&f).unwrap();
    assert_eq!(
        (info.group_width, info.whole_zstd, info.header_len),
        (8, true, 7)
    );
    // A u8 frame grouped by 1 byte (not wider than the dtype), a float
    // grouped wider, and zstd streams of the wrong length are corrupt.
    let mut bad = f.clone();
    bad[4] = DType::F64.code();
    assert!(decode(&bad, None).is_err());
    let mut short = f.clone();
    short[6] = 15;
    assert!(decode(&short, None).is_err());
    let mut long = f.clone();
    long[6] = 24;
    assert!(decode(&long, None).is_err());
    // A raw length not in its shortest LEB128 form is corrupt.
    let long_form = [&f[..6], &[0x90, 0x00], &f[7..]].concat();
    assert!(decode(&long_form, None).is_err());
    let _ = hex;
}

/// Inputs of the fixture files `tests/fixtures/codec/*.v4.ckf` to `v7`.
fn fixture_inputs() -> [(u8, &'static str, DType, Vec<u8>); 4] {
    // Version 4: Adam's first moment of an embedding whose unused rows
    // stay zero (48 rows of 128, every third row nonzero): an element map.
    let mut v = Vec::new();
    for r in 0..48 {
        let g = gaussian_f32(128, r + 1, 1e-3);
        v.extend(if r % 3 == 0 { g } else { vec![0.0; 128] });
    }
    let mapped = f32_bytes(&v);
    // Version 5: rows whose exponents repeat (a row scale times a column
    // scale): a zstd block.
    let rows = repeated_exponent_rows();
    // Version 6: an RNG state (u8, 8-byte words, one zstd frame).
    let mut next = random_u32s(17);
    let mut rng = vec![0u8; 5056];
    rng[8] = 47;
    for i in 0..624 {
        rng[24 + 8 * i..28 + 8 * i].copy_from_slice(&next().to_le_bytes());
    }
    [
        (4, "f32_zero_rows", DType::F32, mapped),
        (5, "f32_repeated_exponent_rows", DType::F32, rows),
        (6, "u8_rng_state", DType::U8, rng),
        (7, "f32_rare_exponent_outliers", DType::F32, rare_outliers()),
    ]
}

/// Version 7's fixture: 8192 positive f32 on a grid of 2^-7 in [1, 2)
/// (one exponent, low mantissa bytes 0), one in ~97 scaled by 4 or 1/4:
/// its exponent stream is one symbol but at ~85 scattered places, a
/// sparse block.
fn rare_outliers() -> Vec<u8> {
    let mut next = random_u32s(23);
    let v: Vec<f32> = (0..8192)
        .map(|_| {
            let x = next();
            let m = 1.0 + (x % 128) as f32 / 128.0;
            match (x >> 8) % 97 {
                0 => m * 4.0,
                1 if x >> 31 == 0 => m * 0.25,
                _ => m,
            }
        })
        .collect();
    f32_bytes(&v)
}

/// The frame of a fixture in its version: version 7 as this build writes
/// it; version 6 as this build writes it without sparse blocks, and
/// versions 4 and 5 also without version 6's fields (no wider grouping,
/// no whole-chunk zstd), with the 16-byte header of those versions: the
/// bytes the encoder of that version wrote, which made the same choices.
fn fixture_frame(version: u8, dtype: DType, raw: &[u8]) -> Vec<u8> {
    // Before version 9: no gamma-coded rANS tables.
    let v7 = Options {
        gamma_tables: false,
        ..Options::default()
    };
    if version == PLAIN_VERSION {
        return encode(raw, None, dtype, &v7);
    }
    // Before version 7: no sparse blocks; version 6's header otherwise.
    let opts = Options {
        sparse: false,
        ..v7
    };
    if version == 6 {
        let mut f = encode(raw, None, dtype, &opts);
        f[2] = 6;
        return f;
    }
    let opts = Options {
        regroup: false,
        small_zstd_max: 0,
        ..opts
    };
    let f = encode(raw, None, dtype, &opts);
    let info = FrameInfo::parse(&f).unwrap();
    assert_eq!(f[5] >> 4, 0);
    let mut old = vec![b'C', b'K', version, f[3], f[4], f[5], BLOCK_LOG2, 0];
    old.extend_from_slice(&info.raw_len.to_le_bytes());
    old.extend_from_slice(&f[info.header_len..]);
    old
}

/// Writes the fixture files (run by hand, with
/// `CKVC_WRITE_CODEC_FIXTURES=1 cargo test --lib write_codec_fixtures -- --ignored`).
#[test]
#[ignore]
fn write_codec_fixtures() {
    if std::env::var_os("CKVC_WRITE_CODEC_FIXTURES").is_none() {
        return;
    }
    for (v, name, dtype, raw) in fixture_inputs() {
        let path = format!(
            "{}/tests/fixtures/codec/{name}.v{v}.ckf",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::write(path, fixture_frame(v, dtype, &raw)).unwrap();
    }
    let path = format!(
        "{}/tests/fixtures/codec/f32_16_levels_palette.v6.ckf",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::write(path, fixture_frame(6, DType::F32, &palette_fixture_input())).unwrap();
    let path = format!(
        "{}/tests/fixtures/codec/f32_alike_rows.v8.ckf",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::write(path, row_fixture_frame()).unwrap();
    let path = format!(
        "{}/tests/fixtures/codec/i8_quantised_rows.v9.ckf",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::write(path, gamma_fixture_frame()).unwrap();
    let path = format!(
        "{}/tests/fixtures/codec/f32_column_exponent_rows.v10.ckf",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::write(path, up_fixture_frame(&Options::default())).unwrap();
    let path = format!(
        "{}/tests/fixtures/codec/f32_adapter_step.v11.ckf",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::write(path, wide_fixture_frame()).unwrap();
}

/// Input of `tests/fixtures/codec/i8_quantised_rows.v9.ckf`: 64 rows of
/// 1024 Gaussian values quantised to int8 with each row's largest
/// magnitude at 6 (a narrow band, as 4-bit-like levels or per-tensor
/// scales with outliers give): one 64 KiB block of 13 values, skewed
/// enough for rANS over Huffman.
fn gamma_fixture_input() -> Vec<u8> {
    let mut v = Vec::with_capacity(1 << 16);
    for r in 0..64 {
        let g = gaussian_f32(1024, 100 + r, 1.0);
        let max = g.iter().fold(0f32, |m, x| m.max(x.abs()));
        v.extend(g.iter().map(|x| (x / max * 6.0).round() as i8 as u8));
    }
    v
}

fn gamma_fixture_frame() -> Vec<u8> {
    encode(&gamma_fixture_input(), None, DType::I8, &Options::default())
}

/// The version 9 fixture decodes, its block is rANS with a gamma-coded
/// table (mode 8), this build writes it byte for byte again, and the same
/// frame saying version 8 is an error (no such block before 9).
#[test]
fn fixture_frame_of_version_9_decodes() {
    let f = include_bytes!("../../tests/fixtures/codec/i8_quantised_rows.v9.ckf");
    let info = FrameInfo::parse(f).unwrap();
    assert_eq!((info.version, info.dtype), (GAMMA_VERSION, DType::I8));
    assert_eq!(f[info.header_len], BlockMode::RansGamma as u8);
    assert_eq!(decode(f, None).unwrap(), gamma_fixture_input());
    assert_eq!(gamma_fixture_frame(), f);
    // Smaller than the varint table's frame of version 7.
    let v7 = encode(
        &gamma_fixture_input(),
        None,
        DType::I8,
        &Options {
            gamma_tables: false,
            ..Options::default()
        },
    );
    assert_eq!(FrameInfo::parse(&v7).unwrap().version, PLAIN_VERSION);
    assert!(f.len() < v7.len(), "{} vs {}", f.len(), v7.len());
    let mut old = f.to_vec();
    old[2] = 8;
    assert!(matches!(
        decode(&old, None),
        Err(DecodeError::Corrupt { reason, .. }) if reason.contains("before format version 9")
    ));
}

/// Input of `tests/fixtures/codec/f32_column_exponent_rows.v10.ckf`: 128
/// rows of 128 positive f32 whose exponent is their column's (one of
/// seven) plus 0 to 2, at random, with noise mantissas: the exponent above
/// tells the column, which order-0 coding and zstd's matches do not see.
fn up_fixture_input() -> Vec<u8> {
    let mut next = random_u32s(23);
    let cols: Vec<i32> = (0..128).map(|_| -4 - (next() % 7) as i32).collect();
    (0..128 * 128)
        .flat_map(|i| {
            let e = cols[i % 128] + (next() % 3) as i32;
            let m = 1.0 + (next() % 1_000_000) as f32 / 1_000_001.0;
            (2f32.powi(e) * m).to_le_bytes()
        })
        .collect()
}

/// The version 10 fixture's rows, as a commit gives them.
const UP_FIXTURE_ROWS: Rows = Rows { len: 128, lead: 0 };

fn up_fixture_frame(opts: &Options) -> Vec<u8> {
    let mut out = Vec::new();
    let no_row_frames = Options {
        rows: RowFrames::Never,
        ..opts.clone()
    };
    encode_shaped_into(
        &up_fixture_input(),
        None,
        DType::F32,
        Some(UP_FIXTURE_ROWS),
        &no_row_frames,
        &mut out,
        &mut Scratch::default(),
    );
    out
}

const BLOCK: usize = 1 << BLOCK_LOG2;

/// Whether block mode `m` is one of the rANS family (modes 3, 4, 8, 9).
pub(super) fn is_rans(m: u8) -> bool {
    [
        BlockMode::Rans,
        BlockMode::RansCtx,
        BlockMode::RansGamma,
        BlockMode::RansUp,
    ]
    .iter()
    .any(|&r| r as u8 == m)
}

/// (mode, symbols) of every block of a codec id 1 frame (palette frames
/// included); empty for a whole-zstd frame.
pub(super) fn blocks_of(f: &[u8]) -> Vec<(u8, usize)> {
    let info = FrameInfo::parse(f).unwrap();
    assert!(!info.rows);
    let raw_len = info.raw_len as usize;
    let (w, n, pos) = if info.palette {
        let dw = info.dtype.width();
        let n = raw_len / dw;
        let mut pos = info.header_len + (raw_len - n * dw);
        let k = f[pos] as usize + 1;
        pos += 1 + k * dw;
        (1, n, pos)
    } else {
        let w = info.group_width;
        let all = raw_len / w;
        let mut pos = info.header_len;
        if info.delta == Delta::PerStream {
            pos += w;
        }
        pos += raw_len - all * w;
        let mut n = all;
        if info.element_map {
            let (mut runs, mut bits) = (Vec::new(), Vec::new());
            let m = elements::read(f, pos, all, &mut runs, &mut bits).unwrap();
            pos = m.end;
            n = m.kept;
        }
        (w, n, pos)
    };
    if info.whole_zstd {
        return Vec::new();
    }
    let nb = n.div_ceil(BLOCK);
    (0..w * nb)
        .map(|i| {
            let e = u32::from_le_bytes(f[pos + 4 * i..pos + 4 * i + 4].try_into().unwrap());
            let bi = i % nb;
            (e as u8, BLOCK.min(n - bi * BLOCK))
        })
        .collect()
}

/// The block modes of a frame of codec id 1 (not a row frame), in table
/// order.
fn block_modes(f: &[u8]) -> Vec<u8> {
    blocks_of(f).into_iter().map(|(m, _)| m).collect()
}

/// The version 10 fixture decodes, its exponent stream is coded against
/// the element a row up (mode 9), this build writes it byte for byte
/// again, it is smaller than the frame without row context, and the same
/// frame saying version 9 is an error (no such block before 10).
#[test]
fn fixture_frame_of_version_10_decodes() {
    let f = include_bytes!("../../tests/fixtures/codec/f32_column_exponent_rows.v10.ckf");
    let info = FrameInfo::parse(f).unwrap();
    assert_eq!((info.version, info.dtype), (UP_VERSION, DType::F32));
    assert_eq!(block_modes(f)[3], BlockMode::RansUp as u8);
    assert_eq!(decode(f, None).unwrap(), up_fixture_input());
    assert_eq!(up_fixture_frame(&Options::default()), f);
    let without = up_fixture_frame(&Options {
        row_context: false,
        ..Options::default()
    });
    assert!(FrameInfo::parse(&without).unwrap().version < UP_VERSION);
    assert!(f.len() < without.len(), "{} vs {}", f.len(), without.len());
    let mut old = f.to_vec();
    old[2] = 9;
    assert!(matches!(
        decode(&old, None),
        Err(DecodeError::Corrupt { reason, .. }) if reason.contains("before format version 10")
    ));
}

/// Input of `tests/fixtures/codec/f32_adapter_step.v11.ckf` and its base:
/// a 64 x 192 f32 matrix (12 Ki elements, a LoRA adapter's size) and the
/// same after a small step, each element moved by about 0.5% of its
/// magnitude: a delta frame whose blocks have 12 Ki symbols.
fn wide_fixture_input() -> (Vec<u8>, Vec<u8>) {
    let base = gaussian_f32(64 * 192, 41, 0.02);
    let step = gaussian_f32(64 * 192, 42, 1e-4);
    let new: Vec<f32> = base.iter().zip(&step).map(|(b, s)| b + s).collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    (bytes(&new), bytes(&base))
}

fn wide_fixture_frame() -> Vec<u8> {
    let (raw, base) = wide_fixture_input();
    encode(&raw, Some(&base), DType::F32, &Options::default())
}

/// The version 11 fixture decodes against its base, a rANS block of its
/// 12 Ki symbols has 32 states (version 11's rule: 8 before, which
/// decode the same payload wrongly or not at all), and this build writes
/// it byte for byte again.
#[test]
fn fixture_frame_of_version_11_decodes() {
    let f = include_bytes!("../../tests/fixtures/codec/f32_adapter_step.v11.ckf");
    let (raw, base) = wide_fixture_input();
    let info = FrameInfo::parse(f).unwrap();
    assert_eq!((info.version, info.dtype), (WIDE_VERSION, DType::F32));
    assert!(info.needs_base());
    let blocks = blocks_of(f);
    assert!(
        blocks
            .iter()
            .any(|&(m, n)| is_rans(m) && (8192..16384).contains(&n)),
        "blocks {blocks:?}"
    );
    assert_eq!(decode(f, Some(&base)).unwrap(), raw);
    assert_eq!(wide_fixture_frame(), f);
    let mut old = f.to_vec();
    old[2] = UP_VERSION;
    assert!(decode(&old, Some(&base)).map_or(true, |back| back != raw));
}

/// A row-context block whose distance is below its 32 states (a context
/// not yet decoded) or whose distance runs past the payload is corrupt,
/// not a panic or a wrong chunk.
#[test]
fn a_row_context_block_with_a_distance_below_its_states_is_corrupt() {
    let f = include_bytes!("../../tests/fixtures/codec/f32_column_exponent_rows.v10.ckf");
    let info = FrameInfo::parse(f).unwrap();
    // The exponent stream's payload follows the other three streams'.
    let e = |k: usize| {
        let at = info.header_len + 4 * k;
        u32::from_le_bytes(f[at..at + 4].try_into().unwrap())
    };
    let payload_at = info.header_len + 16 + (0..3).map(|k| (e(k) >> 8) as usize).sum::<usize>();
    // Distance 128 is two LEB128 bytes: 0x80 0x01.
    assert_eq!(&f[payload_at..payload_at + 2], &[0x80, 0x01]);
    for (bytes, says) in [
        ([31u8, 0x80], "below the block's state count"),
        ([0x80, 0x80], "distance"),
    ] {
        let mut bad = f.to_vec();
        bad[payload_at..payload_at + 2].copy_from_slice(&bytes);
        match decode(&bad, None) {
            Err(DecodeError::Corrupt { reason, .. }) => {
                assert!(reason.contains(says) || reason.contains("rans"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Any float matrix given with its rows round-trips, whichever blocks
    /// take a row context: rows of 1 to 80 elements (a distance of one
    /// row or several), exponents that follow the column or not.
    #[test]
    fn row_context_frames_round_trip(
        len in 1usize..80,
        lead in 0usize..80,
        seed in 1u32..1000,
        spread in 0u32..4,
        bf16 in any::<bool>(),
    ) {
        let lead = lead % len;
        let mut next = random_u32s(seed);
        let cols: Vec<i32> = (0..len).map(|_| -4 - (next() % 7) as i32).collect();
        let n = 20_000 + (next() % 50_000) as usize;
        let vals: Vec<f32> = (0..n)
            .map(|i| {
                let c = (i + len - lead) % len;
                let e = cols[c] + (next() % (spread + 1)) as i32;
                let m = 1.0 + (next() % 1000) as f32 / 1001.0;
                if next() % 2 == 0 { 2f32.powi(e) * m } else { -(2f32.powi(e) * m) }
            })
            .collect();
        let (raw, dtype): (Vec<u8>, _) = if bf16 {
            (vals.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect(), DType::BF16)
        } else {
            (vals.iter().flat_map(|v| v.to_le_bytes()).collect(), DType::F32)
        };
        let mut out = Vec::new();
        let opts = Options { rows: RowFrames::Never, ..Options::default() };
        encode_shaped_into(&raw, None, dtype, Some(Rows { len, lead }), &opts, &mut out, &mut Scratch::default());
        prop_assert_eq!(decode(&out, None).unwrap(), raw);
    }
}

/// A fixture file of every frame version from 4 on (1 to 3:
/// `tests/it/codec_corpus.rs`) decodes to its input, says its version,
/// and uses its version's new field: the element map (4), a zstd block
/// (5), grouping by a wider word and one zstd frame (6), a sparse block
/// (7).
#[test]
fn fixture_frames_of_versions_4_to_7_decode() {
    let files: [&[u8]; 4] = [
        include_bytes!("../../tests/fixtures/codec/f32_zero_rows.v4.ckf"),
        include_bytes!("../../tests/fixtures/codec/f32_repeated_exponent_rows.v5.ckf"),
        include_bytes!("../../tests/fixtures/codec/u8_rng_state.v6.ckf"),
        include_bytes!("../../tests/fixtures/codec/f32_rare_exponent_outliers.v7.ckf"),
    ];
    for ((v, name, dtype, raw), f) in fixture_inputs().into_iter().zip(files) {
        let info = FrameInfo::parse(f).unwrap();
        assert_eq!((info.version, info.dtype), (v, dtype), "{name}");
        assert_eq!(decode(f, None).unwrap(), raw, "{name}");
        let modes = |f: &[u8]| -> Vec<u8> {
            let table = &f[info.header_len..];
            table.chunks(4).take(4).map(|e| e[0]).collect()
        };
        match v {
            4 => assert!(info.element_map),
            5 => assert!(modes(f).contains(&(BlockMode::Zstd as u8))),
            6 => assert!(info.whole_zstd && info.group_width == 8),
            _ => assert_eq!(modes(f)[3], BlockMode::Sparse as u8, "{name}"),
        }
        // The same version's frame, written again (version 6 depends on
        // the zstd release for its payload: only its header is pinned).
        let again = fixture_frame(v, dtype, &raw);
        if v != 6 {
            assert_eq!(again, f, "{name}");
        } else {
            assert_eq!(again[..8], f[..8], "{name}");
        }
    }
}

/// A sparse block (mode 7, format version 7), byte by byte: 4096 u8, all
/// 0 but 1, 2, 3 at 5, 1000, 4095. Gaps 5, 994, 3094: buckets 3, 10, 12
/// (a raw sub-block: 00 03 | 03 0a 0c), symbols raw (00 03 | 01 02 03),
/// then the gaps' bits below their top one, LSB-first: 01 (2 bits),
/// 1e2 (9), 416 (11) = 0x20b789 in 3 bytes 89 b7 20. The payload is 15
/// bytes: table entry 07 0f 00 00.
#[test]
fn sparse_block_known_answer() {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut raw = vec![0u8; 4096];
    (raw[5], raw[1000], raw[4095]) = (1, 2, 3);
    // (An element map of the zero elements is smaller still, here.)
    let blocks = Options {
        element_map: ElementMap::Never,
        small_zstd_max: 0,
        regroup: false,
        ..Options::default()
    };
    let f = encode(&raw, None, DType::U8, &blocks);
    let want = "434b0701010080 20 070f0000 00 03 0003030a0c 0003010203 89b720";
    assert_eq!(hex(&f), want.replace(' ', ""));
    assert_eq!(decode(&f, None).unwrap(), raw);
    // The same frame said to be version 6 is corrupt (mode 7 came with
    // version 7), never misread.
    let reason = |f: &[u8]| match decode(f, None) {
        Err(DecodeError::Corrupt { reason, .. }) => reason,
        other => panic!("{other:?}"),
    };
    let mut v6 = f.clone();
    v6[2] = 6;
    assert_eq!(
        reason(&v6),
        "sparse block in a frame before format version 7"
    );
    // Gaps that run past the block, and a count of symbols above the
    // block's, are corrupt.
    let mut past = f.clone();
    *past.last_mut().unwrap() = 0x21; // the last gap 32 longer: 3126
    assert_eq!(reason(&past), "sparse gaps run past the block");
    let mut over = f.clone();
    over[13] = 4; // a count of 4, with a raw sub-block of 3 buckets
    assert_eq!(reason(&over), "sparse sub-block length");
    // Without sparse blocks the same chunk costs more.
    let no = encode(
        &raw,
        None,
        DType::U8,
        &Options {
            sparse: false,
            ..blocks
        },
    );
    assert!(no.len() > f.len(), "{} vs {}", no.len(), f.len());
}

/// Palette frames (version 6, transform bit 7), byte by byte: f32
/// [1.0, 0.0, 1.0, 1.0] and a 1-byte tail.
#[test]
fn palette_known_answer() {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let opts = Options {
        palette: Palette::Always,
        small_zstd_max: 0,
        ..Options::default()
    };
    let mut raw = f32_bytes(&[1.0, 0.0, 1.0, 1.0]);
    raw.push(7);
    let f = encode(&raw, None, DType::F32, &opts);
    // Header (transform 0x80: palette; raw length 17), the tail 07, the
    // palette of 2 values (count - 1 = 01) in increasing order 0.0, 1.0,
    // then the index stream 01 00 01 01 as a u8 frame's block table and
    // blocks: one raw block of 4 symbols.
    assert_eq!(
        hex(&f),
        "434b07010b80110701000000000000803f0004000001000101"
    );
    assert_eq!(decode(&f, None).unwrap(), raw);
    let info = FrameInfo::parse(&f).unwrap();
    assert!(info.palette && !info.whole_zstd && !info.needs_base());
    // The same palette frame, its index stream as one zstd frame.
    let z = [
        &unhex(
            "434b06010bc011070100000000000080 3f"
                .replace(' ', "")
                .as_str(),
        )[..],
        &zstd::bulk::compress(&[1, 0, 1, 1], 3).unwrap(),
    ]
    .concat();
    assert_eq!(decode(&z, None).unwrap(), raw);
    // An index past the palette, a palette out of order or repeated, a
    // palette with a delta kind, rotation, element map or wider group, a
    // palette of a 1-byte dtype, a short block: all corrupt, no panic.
    let mut bad = f.clone();
    bad[24] = 2;
    assert!(matches!(
        decode(&bad, None),
        Err(DecodeError::Corrupt { .. })
    ));
    let mut bad = f.clone();
    bad[9..13].copy_from_slice(&[0, 0, 0x80, 0x3f]);
    assert!(matches!(
        decode(&bad, None),
        Err(DecodeError::Corrupt { .. })
    ));
    for t in [0x81, 0x82, 0x84, 0x88, 0x90] {
        let mut bad = f.clone();
        bad[5] = t;
        assert!(decode(&bad, None).is_err(), "transform {t:02x}");
    }
    let mut bad = f.clone();
    bad[4] = DType::U8.code();
    assert!(decode(&bad, None).is_err());
    let mut bad = f.clone();
    bad[19] = 5;
    assert!(decode(&bad, None).is_err());
    for cut in 0..f.len() {
        assert!(decode(&f[..cut], None).is_err(), "cut {cut}");
    }
    let _ = hex;
}

/// Quantized, clustered and mask tensors generated here: the palette is
/// chosen, the frame round-trips, and it is smaller than zstd -19 of the
/// byte-grouped bytes (the palette bound says it should be: see
/// `examples/palette_bound.rs`).
#[test]
fn palettes_of_quantized_clustered_and_mask_data_beat_zstd_19() {
    let n = 1 << 16;
    let g = gaussian_f32(n, 21, 0.02);
    let mut cases: Vec<(String, DType, Vec<u8>)> = Vec::new();
    for levels in [16u32, 256] {
        let q = crate::testing::quantize(&g, levels);
        cases.push((format!("f32 {levels} levels"), DType::F32, f32_bytes(&q)));
        cases.push((format!("bf16 {levels} levels"), DType::BF16, bf16_bytes(&q)));
    }
    let mut next = random_u32s(23);
    let centroids: Vec<f32> = (0..16)
        .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 0.1)
        .collect();
    let c: Vec<f32> = (0..n).map(|_| centroids[(next() % 16) as usize]).collect();
    cases.push(("f32 16 centroids".into(), DType::F32, f32_bytes(&c)));
    cases.push(("bf16 16 centroids".into(), DType::BF16, bf16_bytes(&c)));
    let m: Vec<f32> = (0..n)
        .map(|_| if next() % 10 == 0 { 1.0 } else { 0.0 })
        .collect();
    cases.push(("f32 0/1 mask".into(), DType::F32, f32_bytes(&m)));
    cases.push(("bf16 0/1 mask".into(), DType::BF16, bf16_bytes(&m)));
    for (name, dtype, raw) in cases {
        let f = rt(&raw, None, dtype, &Options::default());
        assert!(FrameInfo::parse(&f).unwrap().palette, "{name}");
        let grouped = grouped_streams(&raw, None, dtype).concat();
        let z = zstd::bulk::compress(&grouped, 19).unwrap().len();
        assert!(f.len() < z, "{name}: {} vs zstd -19 {z}", f.len());
    }
    // 256 arbitrary values (every byte of them varies), each repeated: a
    // palette; the same plus a 257th value: not a palette.
    let vals: Vec<u32> = (0..256).map(|_| next()).collect();
    let v: Vec<u32> = (0..16384).map(|i| vals[i % 256]).collect();
    let mut raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let f = rt(&raw, None, DType::F32, &Options::default());
    assert!(FrameInfo::parse(&f).unwrap().palette);
    raw.extend_from_slice(&next().to_le_bytes());
    let f = rt(&raw, None, DType::F32, &Options::default());
    assert!(!FrameInfo::parse(&f).unwrap().palette);
}

/// Float weights (thousands of distinct values) never get a palette, and
/// a palette chunk against a base round-trips (the frame needs no base).
#[test]
fn palettes_only_where_they_pay() {
    let raw = f32_bytes(&gaussian_f32(1 << 14, 5, 0.02));
    let f = rt(&raw, None, DType::F32, &Options::default());
    assert!(!FrameInfo::parse(&f).unwrap().palette);
    let raw = bf16_bytes(&gaussian_f32(1 << 14, 5, 0.02));
    let f = rt(&raw, None, DType::BF16, &Options::default());
    assert!(!FrameInfo::parse(&f).unwrap().palette);
    let a: Vec<f32> = (0..1 << 14).map(|i| ((i * 7) % 13) as f32).collect();
    let b: Vec<f32> = (0..1 << 14).map(|i| ((i * 5) % 13) as f32).collect();
    let (a, b) = (f32_bytes(&a), f32_bytes(&b));
    for opts in all_options() {
        rt(&b, Some(&a), DType::F32, &opts);
    }
    let always = Options {
        palette: Palette::Always,
        ..Options::default()
    };
    for dtype in DType::ALL {
        for len in [0, 1, 7, 8, 9, 100, 1000] {
            let raw: Vec<u8> = (0..len).map(|i| (i % 3) as u8).collect();
            rt(&raw, None, dtype, &always);
            rt(&raw, Some(&raw), dtype, &always);
        }
    }
}

/// Input of `tests/fixtures/codec/f32_16_levels_palette.v6.ckf`: 4096 f32
/// values quantized to 16 levels, and a 2-byte tail.
fn palette_fixture_input() -> Vec<u8> {
    let q: Vec<f32> = gaussian_f32(4096, 31, 0.02)
        .iter()
        .map(|&x| (x / 0.0075).round().clamp(-8.0, 7.0) * 0.0075)
        .collect();
    let mut raw = f32_bytes(&q);
    raw.extend_from_slice(&[0xab, 0xcd]);
    raw
}

/// The palette fixture (version 6, transform bit 7) decodes to its input,
/// and this build writes the same header, tail and palette for it.
#[test]
fn palette_fixture_decodes() {
    let f = include_bytes!("../../tests/fixtures/codec/f32_16_levels_palette.v6.ckf");
    let raw = palette_fixture_input();
    let info = FrameInfo::parse(f).unwrap();
    assert!(info.palette && info.version == 6 && info.dtype == DType::F32);
    assert_eq!(decode(f, None).unwrap(), raw);
    let k = f[info.header_len + 2] as usize + 1;
    let end = info.header_len + 3 + 4 * k;
    let again = fixture_frame(6, DType::F32, &raw);
    assert_eq!(again[..end], f[..end]);
    assert!(f.len() * 5 < raw.len());
}

/// The decoder places each kept run of an element map straight into the
/// chunk, block by block, runs that start in one 64 Ki-element block and
/// end in the next included; a scattered map (runs of one or two
/// elements) is decoded back to back and moved into place. Both against a
/// base (per-stream ops, context coding, the ULP delta) and without one
/// (zero elements), fp32 and bf16, every option set.
#[test]
fn element_map_runs_across_blocks_decode_into_place() {
    let n = 3 * 65536 + 1000;
    let base = gaussian_f32(n, 5, 0.02);
    let moved = |i: usize, b: f32| f32::from_bits(b.to_bits() ^ (1 + i as u32 % 7));
    // Rows of 1000 elements, every third unchanged (or zero without a
    // base); or every third element.
    let rows = |i: usize| (i / 1000) % 3 != 0;
    let scattered = |i: usize| i % 3 != 0;
    let (mut mapped_delta, mut mapped_full) = (0, 0);
    for kept in [&rows as &dyn Fn(usize) -> bool, &scattered] {
        let new: Vec<f32> = base
            .iter()
            .enumerate()
            .map(|(i, &b)| if kept(i) { moved(i, b) } else { b })
            .collect();
        let zeros: Vec<f32> = new
            .iter()
            .enumerate()
            .map(|(i, &v)| if kept(i) { v } else { 0.0 })
            .collect();
        for (raw, b, dtype) in [
            (f32_bytes(&new), Some(f32_bytes(&base)), DType::F32),
            (bf16_bytes(&new), Some(bf16_bytes(&base)), DType::BF16),
            (f32_bytes(&zeros), None, DType::F32),
            (bf16_bytes(&zeros), None, DType::BF16),
        ] {
            for opts in all_options() {
                let f = rt(&raw, b.as_deref(), dtype, &opts);
                let info = FrameInfo::parse(&f).unwrap();
                if info.element_map && info.needs_base() {
                    mapped_delta += 1;
                } else if info.element_map {
                    mapped_full += 1;
                }
            }
        }
    }
    assert!(
        mapped_delta >= 4 && mapped_full >= 4,
        "{mapped_delta} {mapped_full}"
    );
}

proptest! {
    /// What the benchmarks' peers compress is `grouped_streams` joined
    /// (`group_streams_into`), and what they decompress to ends back at the
    /// chunk: `ungroup_streams_into` undoes it (then the trailing partial
    /// element), with a base of the same length, a shorter one or none.
    #[test]
    fn group_streams_into_and_its_inverse_match_grouped_streams(
        raw in proptest::collection::vec(any::<u8>(), 0..700),
        base in proptest::collection::vec(any::<u8>(), 0..700),
    ) {
        for dtype in [DType::U8, DType::BF16, DType::F32, DType::F64] {
            let w = dtype.width();
            for b in [None, Some(&base[..]), Some(&base[..base.len().min(raw.len())])] {
                let mut joined = grouped_streams(&raw, b, dtype).concat();
                joined.extend_from_slice(&raw[raw.len() / w * w..]);
                let mut fast = vec![9u8; 5];
                group_streams_into(&raw, b, dtype, &mut fast);
                prop_assert_eq!(&fast, &joined);
                let mut out = vec![7u8; 3];
                ungroup_streams_into(&joined, b, dtype, &mut out);
                prop_assert_eq!(&out, &raw);
            }
        }
    }
}

/// Rows alike up to scale, as Adam's moments of an output embedding:
/// `rows` rows of `len` f32, each a log-uniform scale (2^-7 to 2^-6)
/// times one direction, plus noise of 1e-4 of it.
fn alike_rows(rows: usize, len: usize, seed: u32) -> Vec<f32> {
    let dir = gaussian_f32(len, seed, 1.0);
    let mut next = random_u32s(seed + 1);
    let mut v = Vec::with_capacity(rows * len);
    for r in 0..rows {
        let scale = 2f32.powf(-7.0 + next() as f32 / u32::MAX as f32);
        let noise = gaussian_f32(len, seed + 2 + r as u32, 1e-4);
        v.extend(dir.iter().zip(&noise).map(|(d, e)| scale * (d + e)));
    }
    v
}

fn row_frames_always() -> Options {
    Options {
        rows: RowFrames::Always,
        ..Options::default()
    }
}

fn encode_rows(raw: &[u8], dtype: DType, rows: Rows, opts: &Options) -> Vec<u8> {
    let mut out = Vec::new();
    encode_shaped_into(
        raw,
        None,
        dtype,
        Some(rows),
        opts,
        &mut out,
        &mut Scratch::default(),
    );
    out
}

/// Every split of a chunk into lead, rows and trail (and a tail of a
/// partial element) round trips through a row frame, for each float
/// dtype a row frame takes; one row or none is a plain frame.
#[test]
fn row_frames_round_trip_every_geometry() {
    let v = alike_rows(40, 37, 3);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let all = match dtype {
            DType::F32 => f32_bytes(&v),
            DType::BF16 => bf16_bytes(&v),
            _ => v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
        };
        let w = dtype.width();
        for len in [1usize, 2, 5, 16, 37] {
            for lead in [0, len / 2, len - 1] {
                for n in [0, lead, lead + len, lead + 2 * len, 300, all.len() / w] {
                    for tail in [0, w - 1] {
                        let raw = &all[..(n * w + tail).min(all.len())];
                        let f = encode_rows(raw, dtype, Rows { len, lead }, &row_frames_always());
                        let info = FrameInfo::parse(&f).unwrap();
                        let rows = n.saturating_sub(lead) / len;
                        assert_eq!(
                            info.rows,
                            n >= lead && rows >= 2,
                            "{dtype} len {len} lead {lead} n {n}"
                        );
                        assert_eq!(
                            decode(&f, None).unwrap(),
                            raw,
                            "{dtype} len {len} lead {lead} n {n} tail {tail}"
                        );
                    }
                }
            }
        }
    }
}

/// The others' frame of a row frame `f` (the second inner frame).
fn others_frame(f: &[u8]) -> &[u8] {
    let info = FrameInfo::parse(f).unwrap();
    let n = info.raw_len as usize / info.dtype.width();
    let ([len, lead, r], pos) = rows::read_numbers(f, info.header_len).unwrap();
    let g = rows::Geometry::new(n, Rows { len, lead }).unwrap();
    let (_, pos) = rows::read_plan(f, pos, g.count, r).unwrap();
    let (a_len, pos) = leb::read(f, pos, f.len(), 5).unwrap();
    &f[pos + a_len as usize..]
}

/// A row frame whose others' frame is a plain delta is decoded straight
/// into the chunk, each row against its root; one whose others' frame
/// has an element map (rows equal to their roots in many elements, or
/// zero) through the gathered roots. Both give the chunk back, into an
/// output and scratch that held a longer chunk before.
#[test]
fn row_frames_decode_others_in_place_or_gathered() {
    let (rows, len) = (96, 64);
    let alike = alike_rows(rows, len, 11);
    // Every third element of each row the same as the first row's, and
    // some rows zero: the others' elements equal to their roots' then
    // make an element map.
    let mut mapped = alike.clone();
    for r in 1..rows {
        for c in (0..len).step_by(3) {
            mapped[r * len + c] = alike[c];
        }
    }
    for r in (5..rows).step_by(7) {
        mapped[r * len..(r + 1) * len].fill(0.0);
    }
    let mut out = Vec::new();
    let mut s = Scratch::default();
    for (v, want_map) in [(alike, false), (mapped, true)] {
        let raw = f32_bytes(&v);
        let f = encode_rows(
            &raw,
            DType::F32,
            Rows { len, lead: 0 },
            &row_frames_always(),
        );
        let d = FrameInfo::parse(others_frame(&f)).unwrap();
        assert!(d.needs_base(), "the others are a delta against the roots");
        assert_eq!(d.element_map, want_map);
        let longer = f32_bytes(&gaussian_f32(3 * rows * len, 4, 1.0));
        decode_into(
            &encode(&longer, None, DType::F32, &Options::default()),
            None,
            HARD_MAX_RAW_LEN,
            &mut out,
            &mut s,
        )
        .unwrap();
        decode_into(&f, None, HARD_MAX_RAW_LEN, &mut out, &mut s).unwrap();
        assert_eq!(out, raw, "element map {want_map}");
    }
}

/// The screen passes rows alike up to scale and the row frame is kept,
/// well smaller than the plain one; rows of noise (weights) are not
/// tried, and chunks without rows or of other dtypes never are.
#[test]
fn row_frames_are_chosen_for_alike_rows_only() {
    let rows = Rows { len: 128, lead: 0 };
    let alike = f32_bytes(&alike_rows(256, 128, 5));
    let opts = Options::default();
    let f = encode_rows(&alike, DType::F32, rows, &opts);
    let plain = encode(&alike, None, DType::F32, &opts);
    assert!(FrameInfo::parse(&f).unwrap().rows);
    assert!(
        f.len() * 10 < plain.len() * 9,
        "{} vs {}",
        f.len(),
        plain.len()
    );
    assert_eq!(decode(&f, None).unwrap(), alike);
    let noise = f32_bytes(&gaussian_f32(256 * 128, 9, 0.02));
    let f = encode_rows(&noise, DType::F32, rows, &opts);
    assert_eq!(f, encode(&noise, None, DType::F32, &opts));
    // Without rows, or with a base it uses, or as integers: plain.
    let mut out = Vec::new();
    let mut s = Scratch::default();
    encode_shaped_into(&alike, None, DType::F32, None, &opts, &mut out, &mut s);
    assert_eq!(out, plain);
    let moved: Vec<u8> = f32_bytes(
        &alike_rows(256, 128, 5)
            .iter()
            .map(|x| x * 1.0001)
            .collect::<Vec<_>>(),
    );
    encode_shaped_into(
        &moved,
        Some(&alike),
        DType::F32,
        Some(rows),
        &opts,
        &mut out,
        &mut s,
    );
    assert!(FrameInfo::parse(&out).unwrap().needs_base());
    encode_shaped_into(
        &alike,
        None,
        DType::I32,
        Some(rows),
        &row_frames_always(),
        &mut out,
        &mut s,
    );
    assert!(!FrameInfo::parse(&out).unwrap().rows);
}

/// A row frame byte by byte: f32 rows of 4 after a lead of 1 element,
/// rows all 1.0, 2.0 and 3.0, a trail of 2 elements and a tail byte.
/// Ordered by norm, the middle row (row 1) is the root: the root map is
/// `02`, one root needs no index bits. Then the frame of the lead, root,
/// trail and tail (29 bytes), its length first, and the frame of rows 0
/// and 2 against row 1 twice.
#[test]
fn row_frame_known_answer() {
    let mut v = vec![0.5f32];
    for x in [1.0f32, 2.0, 3.0] {
        v.extend([x; 4]);
    }
    v.extend([7.0, 8.0]);
    let mut raw = f32_bytes(&v);
    raw.push(0xee);
    let opts = row_frames_always();
    let f = encode_rows(&raw, DType::F32, Rows { len: 4, lead: 1 }, &opts);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let roots = [&raw[..4], &raw[20..36], &raw[52..]].concat();
    let others = [&raw[4..20], &raw[36..52]].concat();
    let base = [&raw[20..36], &raw[20..36]].concat();
    let a = encode(&roots, None, DType::F32, &opts);
    let d = encode(&others, Some(&base), DType::F32, &opts);
    assert_eq!(
        hex(&f[..12]),
        format!(
            "434b0802{:02x}003d04010102{:02x}",
            DType::F32.code(),
            a.len()
        )
    );
    assert_eq!(f[12..], [a, d].concat());
    assert_eq!(decode(&f, None).unwrap(), raw);
}

/// Version 8's fixture: alike rows as a row frame (written, with the
/// others, by `write_codec_fixtures`).
fn row_fixture_input() -> Vec<u8> {
    f32_bytes(&alike_rows(64, 64, 29))
}

fn row_fixture_frame() -> Vec<u8> {
    encode_rows(
        &row_fixture_input(),
        DType::F32,
        Rows { len: 64, lead: 0 },
        &Options::default(),
    )
}

/// The version 8 fixture decodes, is a row frame, and this build writes
/// it byte for byte again.
#[test]
fn fixture_frame_of_version_8_decodes() {
    let f = include_bytes!("../../tests/fixtures/codec/f32_alike_rows.v8.ckf");
    let info = FrameInfo::parse(f).unwrap();
    assert_eq!(
        (info.version, info.rows, info.needs_base()),
        (8, true, false)
    );
    assert_eq!(decode(f, None).unwrap(), row_fixture_input());
    assert_eq!(row_fixture_frame(), f);
}

/// Broken row frames are errors, never panics: every truncation, every
/// field out of its range, an inner frame of another dtype or length, a
/// row frame inside a row frame, codec id 2 before version 8.
#[test]
fn corrupt_row_frames_are_errors() {
    let f = row_fixture_frame();
    // Header 7 bytes (raw length 16384 is 3 LEB128 bytes: 80 80 01), then
    // row length 64 (1 byte), lead 0, root count 4, the root map (8
    // bytes), the indices (60 x 2 bits = 15 bytes), the roots' length.
    assert_eq!(f[6..9], [0x80, 0x80, 0x01]);
    assert_eq!(f[9..12], [64, 0, 4]);
    for cut in 0..f.len() {
        assert!(decode(&f[..cut], None).is_err(), "cut at {cut}");
    }
    let with = |at: usize, b: u8| {
        let mut g = f.clone();
        g[at] = b;
        decode(&g, None)
    };
    assert!(with(2, 7).is_err(), "codec 2 in version 7");
    assert!(with(4, DType::I32.code()).is_err(), "integer row frame");
    assert!(with(5, 4).is_err(), "transform bits");
    assert!(with(9, 0).is_err(), "row length 0");
    assert!(with(9, 127).is_err(), "rows do not fit");
    assert!(with(10, 64).is_err(), "lead not below the row length");
    assert!(with(11, 0).is_err(), "no roots");
    assert!(with(11, 64).is_err(), "every row a root");
    assert!(with(11, 5).is_err(), "root count not the map's");
    assert!(with(12, f[12] ^ 1).is_err(), "root map");
    // The roots' frame: its dtype, its length, a row frame in its place.
    let a_at = 12 + 8 + 15;
    let a_len = f[a_at] as usize | (f[a_at + 1] as usize & 0x7f) << 7;
    let a = a_at + 2;
    assert!(!FrameInfo::parse(&f[a..a + a_len]).unwrap().rows);
    assert!(with(a + 4, DType::F16.code()).is_err(), "inner dtype");
    assert!(with(a + 6, f[a + 6] ^ 4).is_err(), "inner length");
    let nested = [
        &f[..a_at],
        &{
            let mut l = Vec::new();
            leb::write(f.len() as u64, &mut l);
            l
        },
        &f[..],
        &f[a + a_len..],
    ]
    .concat();
    assert!(decode(&nested, None).is_err(), "row frame in a row frame");
    let mut trailing = f.clone();
    trailing.push(0);
    assert!(decode(&trailing, None).is_err(), "trailing bytes");
}
