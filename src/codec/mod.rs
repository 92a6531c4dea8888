//! The chunk codec: lossless compression of one chunk of one tensor.
//!
//! Owns: sign-bit rotation and byte grouping, the delta representations
//! against a base chunk, the element map of zero or unchanged elements
//! ([`ElementMap`]), and block-adaptive entropy coding (raw / constant /
//! Huffman / rANS / context rANS / bit-packed / zstd / sparse per 64 KiB
//! block of each stream, the context the base's byte or the symbol a row
//! up), framed as specified byte by byte in `docs/format/codec.md`;
//! and row frames (format version 8, [`RowFrames`]): a float matrix's
//! root rows and its other rows against them, as two such frames, for a
//! caller that says where the chunk's rows lie ([`Rows`]).
//!
//! This file holds the public API (encode / decode, [`Options`],
//! [`Scratch`], [`FrameInfo`], [`DecodeError`]) and the frame: header,
//! delta search, stream table. Beneath it, private modules, each importing
//! only those below it: `block` (a block's mode, chosen from estimates)
//! over the coders `huffman` (with `bits`), `context` (context modelling)
//! over `rans` (the interleaved coder), `packed`, and `sparse` (over
//! `huffman` and `packed`); `layout` (rotation, grouping, deltas) and
//! `elements` (the element map) for the frame; `rows` (row frames'
//! roots, screen and root sections); `stats` (histograms,
//! entropy, frequency normalisation), `leb` (LEB128 numbers) and `simd`
//! (every `#[target_feature]` kernel) at the bottom; `dtype` for element
//! types.
//!
//! Must not: do I/O, compute chunk ids, or know about files, stores or
//! commits. It is pure: bytes in, bytes out. Parallelism across chunks
//! belongs to the caller (rayon); the codec itself is single-threaded.
//!
//! ```
//! use ckvc::codec::{decode, encode, DType, Options};
//! let old: Vec<u8> = (0..4096u32).flat_map(|i| ((i as f32).cos() * 0.1).to_le_bytes()).collect();
//! let new: Vec<u8> = (0..4096u32).flat_map(|i| ((i as f32).cos() * 0.1 + 1e-5).to_le_bytes()).collect();
//! let frame = encode(&new, Some(&old), DType::F32, &Options::default());
//! assert_eq!(decode(&frame, Some(&old)).unwrap(), new);
//! ```

// Declared first: the other modules use its `dispatch!` macro.
#[macro_use]
mod simd;

mod bits;
mod block;
mod context;
mod dtype;
mod elements;
mod huffman;
mod layout;
mod leb;
mod packed;
mod palette;
mod rans;
mod rows;
mod sparse;
mod stats;

use block::BlockMode;
pub use dtype::DType;
pub use elements::ElementMap;
use layout::StreamOp;
pub use palette::Palette;
pub use rows::{RowFrames, Rows};
use stats::entropy_bits_of;
pub use stats::{entropy_bits, histogram};
use std::borrow::Cow;
use std::mem::MaybeUninit;

/// Frame magic, "CK".
pub const MAGIC: [u8; 2] = *b"CK";
/// The newest frame format version: this build reads it and every earlier
/// one. It writes each frame as the oldest version that holds what it
/// uses, so a chunk encoded before a version existed, and not needing
/// it, encodes to the same bytes: [`PLAIN_VERSION`] for codec id 1,
/// [`GAMMA_VERSION`] when a block has a gamma-coded rANS table,
/// [`UP_VERSION`] when a block is coded against the element a row up,
/// [`WIDE_VERSION`] when a rANS block of 8-16 Ki symbols has 32 states,
/// [`ROWS_VERSION`] for row frames (or the newer of their inner frames').
pub const FORMAT_VERSION: u8 = 11;
/// The version of the frames this build writes with codec id 1 and no
/// gamma-coded rANS table.
pub const PLAIN_VERSION: u8 = 7;
/// The version of row frames (codec id 2).
pub const ROWS_VERSION: u8 = 8;
/// The version of a codec id 1 frame with a gamma-coded rANS table (block
/// mode 8).
pub const GAMMA_VERSION: u8 = 9;
/// The version of a codec id 1 frame with a block coded against the
/// element a row up (block mode 9).
pub const UP_VERSION: u8 = 10;
/// The version of a codec id 1 frame with a rANS block of
/// [`rans::WIDE_MIN_SYMBOLS_V11`] to [`rans::WIDE_MIN_SYMBOLS`] symbols,
/// which from this version has 32 states instead of 8.
pub const WIDE_VERSION: u8 = 11;
/// Codec id of the grouped-entropy codec.
pub const CODEC_GROUPED: u8 = 1;
/// Codec id of row frames (version 8): root rows and the other rows
/// against them, as two grouped-entropy frames.
pub const CODEC_ROWS: u8 = 2;
/// Block size of each stream: a fresh entropy code every 64 KiB.
pub const BLOCK_LOG2: u8 = 16;
/// No frame may declare more raw bytes than this, whatever the caller allows.
pub const HARD_MAX_RAW_LEN: u64 = 1 << 30;
/// Header length of frames before version 6 (raw length as a u64).
const HEADER_LEN: usize = 16;
/// Fixed part of a version 6 header; the raw length follows as LEB128.
const HEADER_V6_FIXED: usize = 6;

/// Why a frame could not be decoded. Every variant means "this frame is
/// not a valid encoding"; none of them is ever a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("frame truncated: need {need} bytes, have {have}")]
    Truncated { need: u64, have: u64 },
    #[error("not a ckvc chunk frame (bad magic)")]
    BadMagic,
    #[error("frame format version {found} is newer than this build supports ({supported})")]
    VersionTooNew { found: u8, supported: u8 },
    #[error("unknown codec id {0}")]
    UnknownCodec(u8),
    #[error("unknown dtype code {0}")]
    UnknownDType(u8),
    #[error("frame declares {declared} raw bytes, above the limit of {limit}")]
    TooLarge { declared: u64, limit: u64 },
    #[error("frame is a delta and needs its base chunk")]
    BaseRequired,
    #[error("base chunk is {found} bytes, the frame needs {expected}")]
    BaseLength { expected: u64, found: u64 },
    #[error("corrupt frame at byte {offset}: {reason}")]
    Corrupt { offset: u64, reason: &'static str },
}

/// Which delta representations the encoder may try when given a base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaSearch {
    /// XOR every stream with the base (the LMC design), always.
    Xor,
    /// Per stream the smallest of keep / XOR / byte difference, or the
    /// whole-element ULP difference, whichever the estimate favours; no
    /// delta at all when the base does not help.
    Best,
}

/// Encoder knobs. The decoder needs none of them: the frame says it all.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Rotate the sign bit of floats so one stream is exactly the exponent.
    pub rotate: bool,
    /// Allow the rANS coder for blocks where Huffman wastes space.
    pub rans: bool,
    /// Delta representations to consider when a base is given.
    pub delta: DeltaSearch,
    /// An entropy-coded block must save this fraction of its raw size, else
    /// it is stored raw (decoding raw is a copy).
    pub min_gain: f32,
    /// Context rANS must save this fraction of the best other coding to be
    /// chosen (Huffman decodes faster).
    pub rans_min_gain: f32,
    /// Plain rANS must save this fraction of the Huffman size. Higher than
    /// `rans_min_gain`: it mostly competes on exponent streams of whole
    /// checkpoints, where it saves 2-4% of a block but decodes slower than
    /// Huffman (0.71 vs 0.43 ns/symbol with 32 states, about 4x slower
    /// with 8); on the mostly-zero streams of deltas it saves 20% or more
    /// and is chosen anyway. Blocks of 5 bits a symbol or more (noise-like
    /// mantissa bytes, 1-byte quantised weights) need not save it: there
    /// rANS decodes as fast as Huffman.
    pub plain_rans_min_gain: f32,
    /// Allow gamma-coded rANS tables (block mode 8, format version 9): a
    /// plain rANS block's table as differences between neighbouring
    /// symbols' frequencies, where that is the shorter table.
    pub gamma_tables: bool,
    /// Allow bit-packed blocks (format version 3): each symbol the block's
    /// least plus a field of 1-7 bits shifted by a fixed amount, stored as
    /// that field, no table.
    pub packed: bool,
    /// Whether to store an element map (format version 4): whole elements
    /// that are zero, or equal to the base's in a delta frame, listed in
    /// runs or a bitmap and left out of the streams.
    pub element_map: ElementMap,
    /// zstd's compression level for zstd blocks (format version 5: a
    /// block's symbols as a zstd frame, for the repeated strings of
    /// symbols order-0 coding cannot see, such as rows of Adam's second
    /// moment with the same exponents); 0 never writes them. Tried only on
    /// skewed blocks (exponent streams of whole frames) where a cheap probe
    /// finds repeated 8-byte strings.
    pub zstd_level: i32,
    /// A zstd block must save this fraction of the best other coding to be
    /// chosen (it decodes slower than Huffman or bit-packing).
    pub zstd_min_gain: f32,
    /// Group the bytes of integer dtypes narrower than 8 bytes by a wider
    /// word (2, 4 or 8 bytes; format version 6) when the bytes at each
    /// position of that word are more alike (the measured entropy says
    /// so): the RNG state of `torch.get_rng_state()`, 32-bit words in
    /// 64-bit slots, stored as u8.
    pub regroup: bool,
    /// Chunks of an integer dtype of at most this many bytes may be stored
    /// as one zstd frame
    /// of all their streams instead of a block table and blocks (format
    /// version 6), when that is smaller; 0 never.
    pub small_zstd_max: usize,
    /// Store a chunk of at most 256 distinct whole-element values as
    /// those values once and one index byte per element (format version
    /// 6, transform bit 7), when that is smaller: quantized or clustered
    /// weights, masks.
    pub palette: Palette,
    /// Allow sparse blocks (format version 7): a block that is one symbol
    /// in all but a few places, stored as those places and their symbols.
    pub sparse: bool,
    /// Whether a whole (not delta) float chunk whose [`Rows`] the caller
    /// gives may be a row frame (format version 8): root rows whole, the
    /// other rows against them.
    pub rows: RowFrames,
    /// Whether a whole float chunk whose [`Rows`] the caller gives may
    /// code a block of a stream with the symbol a row up as context
    /// (block mode 9, format version 10), when that is smaller.
    pub row_context: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            rotate: true,
            rans: true,
            delta: DeltaSearch::Best,
            min_gain: 0.005,
            rans_min_gain: 0.02,
            plain_rans_min_gain: 0.03,
            gamma_tables: true,
            packed: true,
            element_map: ElementMap::Auto,
            zstd_level: 1,
            zstd_min_gain: 0.1,
            regroup: true,
            small_zstd_max: 64 << 10,
            palette: Palette::Auto,
            sparse: true,
            rows: RowFrames::Auto { min_gain: 0.02 },
            row_context: true,
        }
    }
}

impl Options {
    /// Plain LMC, the baseline the benchmark shows: byte grouping, XOR
    /// delta, Huffman + constant runs + raw; no rotation, no rANS.
    pub fn lmc() -> Self {
        Options {
            rotate: false,
            rans: false,
            delta: DeltaSearch::Xor,
            min_gain: 0.0,
            rans_min_gain: 0.0,
            plain_rans_min_gain: 0.0,
            gamma_tables: false,
            packed: false,
            element_map: ElementMap::Never,
            zstd_level: 0,
            zstd_min_gain: 0.0,
            regroup: false,
            small_zstd_max: 0,
            palette: Palette::Never,
            sparse: false,
            rows: RowFrames::Never,
            row_context: false,
        }
    }
}

/// The delta representation recorded in a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delta {
    None,
    /// Each grouped stream combined with the base's stream by its op.
    PerStream,
    /// Zigzagged ordered-integer difference per element.
    Ulp,
}

/// What a frame header says, without decoding the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameInfo {
    pub version: u8,
    pub dtype: DType,
    pub raw_len: u64,
    pub delta: Delta,
    pub rotated: bool,
    /// The frame has an element map (version 4 and later): some whole
    /// elements are zero, or the base's, and are not in the streams.
    pub element_map: bool,
    /// Bytes per element as the frame groups them: the dtype's width, or
    /// a wider word for an integer dtype (version 6 and later).
    pub group_width: usize,
    /// The streams are one zstd frame instead of a block table and blocks
    /// (version 6 and later).
    pub whole_zstd: bool,
    /// The frame is a palette and the index bytes of its elements
    /// (version 6, transform bit 7).
    pub palette: bool,
    /// Length of the header in bytes (16 before version 6; 7 to 11 from
    /// version 6, whose raw length is LEB128).
    pub header_len: usize,
    /// The frame is a row frame (version 8, codec id 2): root rows and
    /// the other rows against them, as two inner frames.
    pub rows: bool,
}

impl FrameInfo {
    /// True when decoding needs the base chunk.
    pub fn needs_base(&self) -> bool {
        self.delta != Delta::None
    }

    /// Parse and validate the fixed header.
    pub fn parse(frame: &[u8]) -> Result<FrameInfo, DecodeError> {
        let need = if frame.get(2).is_some_and(|&v| v >= 6) {
            HEADER_V6_FIXED + 1
        } else {
            HEADER_LEN
        };
        if frame.len() < need {
            return Err(DecodeError::Truncated {
                need: need as u64,
                have: frame.len() as u64,
            });
        }
        if frame[0..2] != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = frame[2];
        if version > FORMAT_VERSION {
            return Err(DecodeError::VersionTooNew {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        if version == 0 {
            return Err(corrupt(2, "format version 0"));
        }
        let rows = match frame[3] {
            CODEC_GROUPED => false,
            CODEC_ROWS if version >= 8 => true,
            c => return Err(DecodeError::UnknownCodec(c)),
        };
        let dtype = DType::from_code(frame[4]).ok_or(DecodeError::UnknownDType(frame[4]))?;
        let t = frame[5];
        if rows {
            if !rows::float_rows(dtype) {
                return Err(corrupt(
                    4,
                    "row frame of a dtype other than f32, bf16 or f16",
                ));
            }
            if t != 0 {
                return Err(corrupt(5, "row frame with transform bits set"));
            }
        }
        let allowed: u8 = match version {
            1..=3 => 0b0111,
            4 | 5 => 0b1111,
            _ => 0b1111_1111,
        };
        if t & !allowed != 0 {
            return Err(corrupt(5, "reserved transform bits set"));
        }
        let delta = match t & 3 {
            0 => Delta::None,
            1 => Delta::PerStream,
            2 => Delta::Ulp,
            _ => return Err(corrupt(5, "unknown delta kind")),
        };
        let (raw_len, header_len) = if version < 6 {
            if frame[6] != BLOCK_LOG2 {
                return Err(corrupt(6, "unsupported block size"));
            }
            if frame[7] != 0 {
                return Err(corrupt(7, "reserved byte set"));
            }
            let raw_len = u64::from_le_bytes(frame[8..16].try_into().expect("8 bytes"));
            (raw_len, HEADER_LEN)
        } else {
            // The raw length: at most 5 bytes (below 2^35).
            leb::read(frame, HEADER_V6_FIXED, frame.len(), 5)?
        };
        let w = dtype.width();
        let group_width = match (t >> 4) & 3 {
            0 => w,
            g => {
                let g = 1usize << g;
                if dtype.is_float() || g <= w {
                    return Err(corrupt(5, "group width not wider than an integer dtype's"));
                }
                g
            }
        };
        if t & 0x80 != 0 && (t & 0b0011_1111 != 0 || w < 2) {
            return Err(corrupt(
                5,
                "palette frame with a delta, rotation, element map, group width or 1-byte dtype",
            ));
        }
        Ok(FrameInfo {
            version,
            dtype,
            raw_len,
            delta,
            rotated: t & 4 != 0,
            element_map: t & 8 != 0,
            group_width,
            whole_zstd: t & 0x40 != 0,
            palette: t & 0x80 != 0,
            header_len,
            rows,
        })
    }
}

fn corrupt(offset: usize, reason: &'static str) -> DecodeError {
    DecodeError::Corrupt {
        offset: offset as u64,
        reason,
    }
}

/// Reusable buffers for encoding and decoding; keep one per thread.
#[derive(Default)]
pub struct Scratch {
    streams: Vec<Vec<u8>>,
    ctx: Vec<u8>,
    classes: Vec<u8>,
    /// The block encoder's state: Huffman's pair tables and lane regions,
    /// zstd's context.
    blocks: block::EncodeScratch,
    tmp: Vec<u8>,
    /// A chunk's whole-element (ULP) differences before grouping: apart
    /// from `tmp`, which each block empties, so it is zero-filled only
    /// when it grows (see [`layout::grow`]), not for every chunk.
    ulp: Vec<u8>,
    /// A palette frame's index bytes, its index frame (encoding: a `u8`
    /// frame; decoding: the index stream behind a `u8` header) and, while
    /// encoding, the palette frame itself.
    palette_idx: Vec<u8>,
    palette_inner: Vec<u8>,
    palette_frame: Vec<u8>,
    tables: block::Tables,
    entries: Vec<(BlockMode, usize)>,
    /// The element map's runs, or its skip bits (a scattered map), and
    /// the kept elements of the chunk and of its base, compacted.
    runs: Vec<u32>,
    skip_bits: Vec<u64>,
    compact: Vec<u8>,
    compact_base: Vec<u8>,
    /// The decoder's kept runs of an element map, placed one by one.
    pieces: Vec<elements::Piece>,
    map_section: Vec<u8>,
    /// The chunk's streams as one zstd frame (version 6), kept apart from
    /// the block coder's zstd output, which the blocks overwrite.
    whole: Vec<u8>,
    /// A row frame's parts: the roots' raw bytes, the other rows', and
    /// their roots' gathered (the second part's base); and while
    /// encoding, the two inner frames and the row frame itself.
    row_parts: [Vec<u8>; 3],
    row_frames: [Vec<u8>; 3],
    /// While [`encode_shaped_into`] encodes a whole chunk of rows as a
    /// plain frame: the distance, in elements, of a block's row context
    /// (block mode 9), a whole number of rows of at least 32 elements.
    up: Option<usize>,
}

/// Encode one chunk. `base`, when given and of the same length, is the same
/// tensor's chunk in the parent checkpoint; the encoder uses it only when
/// that makes the frame smaller.
pub fn encode(raw: &[u8], base: Option<&[u8]>, dtype: DType, opts: &Options) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(raw, base, dtype, opts, &mut out, &mut Scratch::default());
    out
}

/// [`encode_into`] for a chunk whose rows are known: the tensor's row
/// length and where the chunk starts in a row ([`Rows::of_chunk`]). A
/// whole (not delta) float chunk whose rows a sample finds alike may then
/// be a row frame (version 8), as [`Options::rows`] says.
pub fn encode_shaped_into(
    raw: &[u8],
    base: Option<&[u8]>,
    dtype: DType,
    rows: Option<Rows>,
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    let w = dtype.width();
    let n = raw.len() / w;
    let geometry = rows
        .filter(|_| rows::float_rows(dtype) && opts.rows != RowFrames::Never)
        .and_then(|r| rows::Geometry::new(n, r))
        .filter(|g| g.count >= 2);
    // The row context's distance: the least whole number of rows of at
    // least 32 elements (the states a block of rANS interleaves).
    let up = rows
        .filter(|r| opts.row_context && r.len > 0 && rows::float_rows(dtype))
        .map(|r| r.len * rans::WIDE.div_ceil(r.len));
    let Some(g) = geometry else {
        return encode_into_up(raw, base, dtype, up, opts, out, scratch);
    };
    // A delta frame when the base helps; else the plain frame is built
    // only when the row frame might not be the smaller (below).
    let mut plain = false;
    if base.is_some_and(|b| b.len() == raw.len()) {
        encode_into_up(raw, base, dtype, up, opts, out, scratch);
        if FrameInfo::parse(out).map_or(true, |i| i.needs_base()) {
            return;
        }
        plain = true;
    }
    let body = &raw[..n * w];
    let Some((plan, min_gain)) = row_plan(body, &g, dtype, opts.rows) else {
        if !plain {
            encode_into_up(raw, None, dtype, up, opts, out, scratch);
        }
        return;
    };
    let [mut rf, mut fa, mut fd] = std::mem::take(&mut scratch.row_frames);
    encode_row_frame(
        raw,
        dtype,
        &g,
        &plan,
        opts,
        [&mut fa, &mut fd],
        &mut rf,
        scratch,
    );
    // The roots' frame codes a sample of the rows (one in 16, of every
    // norm) as the plain frame codes them all: a row frame `min_gain`
    // below that estimate keeps its place without the plain frame being
    // built. The estimate came out 0.998-1.066 of the plain frame (median
    // 1.004) on 64 KiB of roots or more of the optimizer states of
    // gpt-small, bert-ft and the generated runs, up to 1.13 on less.
    // Asking for 8% more than `min_gain` gave the same ratios and encoded
    // those rows 1.2-1.3x slower (637 -> 488, 864 -> 729 MiB/s,
    // codec-bench, FULL fp32 optimizer of the fp32 run and gpt-small).
    let roots_raw = raw.len() - (g.count - plan.roots.len()) * g.len * w;
    let estimate = fa.len() as f64 * raw.len() as f64 / roots_raw.max(1) as f64;
    let keep = if !plain && rf.len() as f64 <= estimate * (1.0 - min_gain) {
        true
    } else {
        if !plain {
            encode_into_up(raw, None, dtype, up, opts, out, scratch);
        }
        rf.len() as f64 <= out.len() as f64 * (1.0 - min_gain)
    };
    if keep {
        std::mem::swap(out, &mut rf);
    }
    scratch.row_frames = [rf, fa, fd];
}

/// The roots of a chunk's rows and the fraction a row frame must save,
/// or `None` when `mode` says not to try one: never, or (`Auto`) a chunk
/// too small or whose rows the screen or the bits they share with their
/// roots turn away.
fn row_plan(
    body: &[u8],
    g: &rows::Geometry,
    dtype: DType,
    mode: RowFrames,
) -> Option<(rows::Plan, f64)> {
    match mode {
        RowFrames::Never => None,
        RowFrames::Always => {
            let dir = rows::direction(body, g, dtype);
            Some((rows::plan(body, g, dtype, &dir), f64::NEG_INFINITY))
        }
        RowFrames::Auto { min_gain } => {
            if g.count < rows::MIN_ROWS || g.len < rows::MIN_ROW_LEN {
                return None;
            }
            let dir = rows::screen(body, g, dtype)?;
            let plan = rows::plan(body, g, dtype, &dir);
            let shared = rows::shared_bits(body, g, dtype, &plan);
            (shared >= rows::min_shared_bits(dtype.width())).then_some((plan, f64::from(min_gain)))
        }
    }
}

/// The row frame of `raw` by `plan`: header, row section, the frame of
/// the lead, roots, trail and tail (`inner[0]`), then the frame of the
/// other rows against their roots (`inner[1]`).
#[allow(clippy::too_many_arguments)]
fn encode_row_frame(
    raw: &[u8],
    dtype: DType,
    g: &rows::Geometry,
    plan: &rows::Plan,
    opts: &Options,
    inner: [&mut Vec<u8>; 2],
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    let w = dtype.width();
    let [mut a, mut d, mut b] = std::mem::take(&mut scratch.row_parts);
    let rest = (g.lead + g.count * g.len) * w;
    a.clear();
    a.extend_from_slice(&raw[..g.lead * w]);
    for &r in &plan.roots {
        a.extend_from_slice(&raw[g.row(r as usize, w)]);
    }
    a.extend_from_slice(&raw[rest..]);
    d.clear();
    b.clear();
    let others = (0..g.count).filter(|&i| !plan.is_root[i]);
    for (i, &x) in others.zip(&plan.of) {
        d.extend_from_slice(&raw[g.row(i, w)]);
        b.extend_from_slice(&raw[g.row(plan.roots[x as usize] as usize, w)]);
    }
    let [fa, fd] = inner;
    encode_into(&a, None, dtype, opts, fa, scratch);
    // The others' blocks are coded without rANS: Huffman, bit packing
    // and the rest decode them 1.2-1.3x as fast, for 0.1-2% of the row
    // frame (codec_speed, one core, FULL optimizer of the generated fp32
    // and bf16 runs, gpt-small and bert-ft: ratio 0.7780 -> 0.7819,
    // 0.5547 -> 0.5656, 0.8159 -> 0.8169, 0.4320 -> 0.4323; decode
    // 2494 -> 3085, 1373 -> 1786, 3512 -> 4129, 5324 -> 5892 MiB/s), which
    // puts them above zstd -3's speed in both directions and still below
    // every peer's ratio.
    let od = Options {
        rans: false,
        ..opts.clone()
    };
    encode_into(&d, Some(&b), dtype, &od, fd, scratch);
    scratch.row_parts = [a, d, b];
    out.clear();
    out.extend_from_slice(&MAGIC);
    let version = ROWS_VERSION.max(fa[2]).max(fd[2]);
    out.extend_from_slice(&[version, CODEC_ROWS, dtype.code(), 0]);
    leb::write(raw.len() as u64, out);
    for v in [g.len, g.lead, plan.roots.len()] {
        leb::write(v as u64, out);
    }
    rows::write_plan(plan, out);
    leb::write(fa.len() as u64, out);
    out.extend_from_slice(fa);
    out.extend_from_slice(fd);
}

/// [`encode_into`] with `up`, the distance of a row context
/// ([`Scratch::up`]), for the plain frame's blocks.
fn encode_into_up(
    raw: &[u8],
    base: Option<&[u8]>,
    dtype: DType,
    up: Option<usize>,
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    scratch.up = up;
    encode_into(raw, base, dtype, opts, out, scratch);
    scratch.up = None;
}

/// [`encode`] into `out` (cleared first), reusing `scratch`.
pub fn encode_into(
    raw: &[u8],
    base: Option<&[u8]>,
    dtype: DType,
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    // A palette, when a sample holds few distinct values whose entropy is
    // well below what byte grouping codes (none of the float weights or
    // optimizer state of either corpus do: a sample of 2048 elements
    // bails out at its 257th value or fails the entropy test), and then
    // only when the frame comes out smaller than the plain one.
    let w = dtype.width();
    let n = raw.len() / w;
    let body = &raw[..n * w];
    let try_palette = w >= 2
        && n > 0
        && match opts.palette {
            Palette::Never => false,
            Palette::Auto => palette::screen(body, w),
            Palette::Always => true,
        };
    if try_palette {
        let mut idx = std::mem::take(&mut scratch.palette_idx);
        if let Some(pal) = palette::scan(body, w, &mut idx) {
            let mut pf = std::mem::take(&mut scratch.palette_frame);
            encode_palette(raw, dtype, &pal, &idx, opts, &mut pf, scratch);
            let keep = opts.palette == Palette::Always || {
                encode_plain(raw, base, dtype, opts, out, scratch);
                pf.len() < out.len()
            };
            if keep {
                std::mem::swap(out, &mut pf);
            }
            scratch.palette_frame = pf;
            scratch.palette_idx = idx;
            return;
        }
        scratch.palette_idx = idx;
    }
    encode_plain(raw, base, dtype, opts, out, scratch);
}

/// The palette frame of `raw`: `pal` the sorted distinct values of its
/// whole elements, `idx` each element's index into it.
fn encode_palette(
    raw: &[u8],
    dtype: DType,
    pal: &[u64],
    idx: &[u8],
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    let w = dtype.width();
    let n = idx.len();
    let mut inner = std::mem::take(&mut scratch.palette_inner);
    encode_elements(
        n,
        idx,
        &[],
        None,
        DType::U8,
        1,
        opts,
        None,
        None,
        &mut inner,
        scratch,
    );
    // The index frame's header: the fixed part and `n` as LEB128.
    let h = HEADER_V6_FIXED + leb::len(n as u64);
    out.clear();
    out.extend_from_slice(&MAGIC);
    // The index frame's version (gamma-coded tables in its blocks).
    out.push(inner[2]);
    out.push(CODEC_GROUPED);
    out.push(dtype.code());
    out.push(0x80 | (inner[5] & 0x40));
    leb::write(raw.len() as u64, out);
    out.extend_from_slice(&raw[n * w..]);
    out.push((pal.len() - 1) as u8);
    for &k in pal {
        out.extend_from_slice(&k.to_le_bytes()[..w]);
    }
    out.extend_from_slice(&inner[h..]);
    scratch.palette_inner = inner;
}

/// The plain (not palette) frame of a chunk.
fn encode_plain(
    raw: &[u8],
    base: Option<&[u8]>,
    dtype: DType,
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    // Integer bytes may be grouped by a wider word (format version 6);
    // from here on that word is the element.
    let (w, counted) = if opts.regroup {
        // Counts for the delta search, when it will run on the chunk.
        let searched =
            opts.delta == DeltaSearch::Best && base.is_some_and(|b| b.len() == raw.len());
        group_width(raw, dtype, searched)
    } else {
        (dtype.width(), None)
    };
    let n = raw.len() / w;
    let (body, tail) = raw.split_at(n * w);
    let base = base.filter(|b| b.len() == raw.len()).map(|b| &b[..n * w]);
    // The element map: a sampled look first, so chunks without zero or
    // unchanged elements (every chunk of gpt-small) pay next to nothing.
    let mapped = match opts.element_map {
        ElementMap::Never => false,
        ElementMap::Always => {
            elements::scan(body, base, w, &mut scratch.runs);
            true
        }
        ElementMap::Auto => {
            elements::screen(body, base, w) && {
                let skipped = elements::scan(body, base, w, &mut scratch.runs);
                let (bytes, _) = elements::map_size(&scratch.runs, n);
                elements::worth_it(skipped, n, w, bytes)
            }
        }
    };
    if !mapped {
        return encode_elements(
            raw.len(),
            body,
            tail,
            base,
            dtype,
            w,
            opts,
            None,
            counted.as_deref(),
            out,
            scratch,
        );
    }
    let mut kept = std::mem::take(&mut scratch.compact);
    let mut kept_base = std::mem::take(&mut scratch.compact_base);
    let mut section = std::mem::take(&mut scratch.map_section);
    // A scattered map (as the decoder tells one) is compacted by its skip
    // bits, a map of long runs run by run.
    let runs = &scratch.runs;
    let kept_n: usize = runs.iter().step_by(2).map(|&r| r as usize).sum();
    let scattered = self::scattered(runs.len() / 2, kept_n);
    if scattered {
        elements::bits_of_runs(runs, n, &mut scratch.skip_bits);
        elements::compact_bits(body, &scratch.skip_bits, n, w, &mut kept);
        if let Some(b) = base {
            elements::compact_bits(b, &scratch.skip_bits, n, w, &mut kept_base);
        }
    } else {
        elements::compact(body, runs, w, &mut kept);
        if let Some(b) = base {
            elements::compact(b, runs, w, &mut kept_base);
        }
    }
    section.clear();
    let bits = scattered.then_some(scratch.skip_bits.as_slice());
    elements::write(&scratch.runs, n, bits, &mut section);
    encode_elements(
        raw.len(),
        &kept,
        tail,
        base.map(|_| kept_base.as_slice()),
        dtype,
        w,
        opts,
        Some(&section),
        None,
        out,
        scratch,
    );
    scratch.compact = kept;
    scratch.compact_base = kept_base;
    scratch.map_section = section;
}

/// The frame of `body` (whole elements: the chunk's, or its kept ones
/// when `map`, the element map section, is given) against `base` (the
/// same elements of the base), with the chunk's `raw_len` and `tail`.
/// `counted`, when given, are the histograms and entropies of the streams
/// of `body` as they are (see [`group_width`]).
#[allow(clippy::too_many_arguments)]
fn encode_elements(
    raw_len: usize,
    body: &[u8],
    tail: &[u8],
    base: Option<&[u8]>,
    dtype: DType,
    w: usize,
    opts: &Options,
    map: Option<&[u8]>,
    counted: Option<&[Counted]>,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) {
    let n = body.len() / w;
    let float = dtype.is_float();
    let rotate = opts.rotate && float;
    let Scratch {
        tmp,
        ulp,
        ctx,
        classes,
        blocks: huff,
        whole: whole_out,
        up,
        ..
    } = scratch;
    // Context coding takes blocks of `RANS_CTX_MIN_SYMBOLS` or more: a
    // shorter chunk neither estimates it nor builds its models.
    let ctx_ok = opts.rans && n >= block::RANS_CTX_MIN_SYMBOLS;
    let mut ops = vec![StreamOp::Keep; w];
    let mut delta = Delta::None;
    // A small chunk of integers may be smaller as one zstd frame of all
    // its streams (version 6), and then the delta search's histograms of
    // them are wanted. Not for floats: zstd rarely pays on float bytes,
    // and it would cost one more compression per small tensor (biases,
    // norms).
    let whole_zstd = opts.zstd_level != 0 && !float && raw_len <= opts.small_zstd_max && n > 0;
    // The histograms of the streams, when the delta search counted them.
    let mut hists = None;
    if let Some(base) = base {
        delta = Delta::PerStream;
        match opts.delta {
            DeltaSearch::Xor => ops.fill(StreamOp::Xor),
            DeltaSearch::Best => {
                let (choice, h) =
                    choose_delta(body, base, w, rotate, float, ctx_ok, counted, whole_zstd);
                hists = h;
                match choice {
                    Choice::PerStream(o) => {
                        ops = o;
                        if ops.iter().all(|&o| o == StreamOp::Keep) {
                            delta = Delta::None;
                        }
                    }
                    Choice::Ulp => delta = Delta::Ulp,
                }
            }
        }
        // Skipped elements of a frame with a base are the base's: the
        // frame must say it needs the base, even when no stream uses it.
        if map.is_some() && delta == Delta::None {
            delta = Delta::PerStream;
        }
    }
    let rotated = rotate && delta != Delta::Ulp;

    // Delta frames: the context model of each block (one for all streams)
    // and the class of each element's context.
    let mut models = Vec::new();
    if let (Some(base), true) = (base, delta != Delta::None && ctx_ok) {
        layout::context_bytes(base, w, float, ctx);
        let classes = layout::grow(classes, n);
        for (b, c) in ctx[..n]
            .chunks(1 << BLOCK_LOG2)
            .zip(classes.chunks_mut(1 << BLOCK_LOG2))
        {
            let m = context::CtxModel::new(b);
            m.classes_into(b, c);
            models.push(m);
        }
    }
    out.clear();
    // Room for the largest frame (every block raw), so a fresh `out` grows
    // once instead of doubling through the chunk.
    let block = 1usize << BLOCK_LOG2;
    let nblocks = n.div_ceil(block);
    let map_len = map.map_or(0, |m| m.len());
    out.reserve(HEADER_LEN + w + raw_len + map_len + 4 * w * nblocks);
    out.extend_from_slice(&MAGIC);
    out.push(PLAIN_VERSION);
    out.push(CODEC_GROUPED);
    out.push(dtype.code());
    let kind = match delta {
        Delta::None => 0,
        Delta::PerStream => 1,
        Delta::Ulp => 2,
    };
    // Group width: 0 the dtype's, else log2 of the wider word.
    let g = if w == dtype.width() {
        0
    } else {
        w.trailing_zeros() as u8
    };
    out.push(kind | if rotated { 4 } else { 0 } | if map.is_some() { 8 } else { 0 } | g << 4);
    leb::write(raw_len as u64, out);
    if delta == Delta::PerStream {
        out.extend(ops.iter().map(|&o| o as u8));
    }
    out.extend_from_slice(tail);
    if let Some(m) = map {
        out.extend_from_slice(m);
    }
    // Block table of fixed 4-byte entries (mode | length << 8), so payloads
    // can be written straight after it in one pass.
    let table_at = out.len();
    out.resize(table_at + 4 * w * nblocks, 0);

    // The streams are grouped straight into the frame, where they would be
    // if every block were raw: stream k at `at + k * n`. Blocks are then
    // coded in frame order to the write position `cur`, which never passes
    // the next block's symbols (no block is longer coded than raw). Raw
    // blocks, half a checkpoint's bytes, so stay where they are (or move
    // down once a block before them was coded); coded ones are written to
    // `tmp` first and copied down.
    // With per-stream ops, each element is expressed against the base's
    // as it is grouped (one pass; the base is never grouped on its own).
    let at = out.len();
    let region = &mut out.spare_capacity_mut()[..w * n];
    frame_streams_into(body, base, delta, &ops, w, rotate, float, ulp, region);
    // SAFETY: the grouping wrote all `w * n` bytes after `at`, within the
    // capacity reserved above.
    unsafe { out.set_len(at + w * n) };
    debug_assert!(
        hists.as_ref().is_none_or(|h| out[at..]
            .chunks(n.max(1))
            .zip(h)
            .all(|(s, h)| histogram(s) == *h)),
        "the delta search's histograms are the streams'"
    );
    // The whole zstd frame is tried before the blocks overwrite the
    // streams.
    let whole = whole_zstd
        .then(|| {
            let streams = &out[at..at + w * n];
            let literals = hists.as_deref().is_none_or(|h| literals_pay(streams, n, h));
            block::zstd_compress(streams, SMALL_ZSTD_LEVEL, literals, huff)
        })
        .flatten();
    if whole.is_some() {
        std::mem::swap(&mut huff.zstd_out, whole_out);
    }
    // Blocks shorter than zstd's, sparse and context coding's least
    // (sparse coding's is zstd's) come to no less than
    // `block::floor_bytes` each, plus a table entry: a whole
    // frame already below that is the one kept, without coding them (the
    // same frame, sooner: the 5 KiB RNG state of a checkpoint).
    if let Some(z) = whole.filter(|&z| {
        n < block::ZSTD_MIN_SYMBOLS.min(block::RANS_CTX_MIN_SYMBOLS)
            && (z as f64) + 1.0 < blocks_floor_bytes(&out[at..at + w * n], n, hists.as_deref())
    }) {
        return put_whole(out, table_at, &whole_out[..z]);
    }
    // A row context only where stream symbols are the chunk's elements in
    // order, coded on their own.
    let up = up.filter(|_| delta == Delta::None && map.is_none());
    let mut cur = at;
    let mut entry = table_at;
    let mut gamma = false;
    let mut wide = false;
    let mut rows_up = false;
    for k in 0..w {
        // Every stream of a delta frame may be coded with the base's
        // exponent (top) byte of each element as context.
        for bi in 0..nblocks {
            let p = at + k * n + bi * block;
            let len = block.min(n - bi * block);
            let c = models
                .get(bi)
                .map(|m| (m, &classes[bi * block..bi * block + len]));
            tmp.clear();
            let mut mode = block::encode(&out[p..p + len], c, up, opts, tmp, huff);
            // The block coder stores raw whatever does not pay; should a
            // coded block ever come out longer, raw keeps `cur` behind the
            // symbols still to code.
            if tmp.len() > len {
                mode = BlockMode::Raw;
            }
            let coded = match mode {
                BlockMode::Raw => {
                    if cur != p {
                        out.copy_within(p..p + len, cur);
                    }
                    len
                }
                _ => {
                    out[cur..cur + tmp.len()].copy_from_slice(tmp);
                    tmp.len()
                }
            };
            cur += coded;
            gamma |= mode == BlockMode::RansGamma;
            // A rANS block whose state count version 11 changed.
            wide |= matches!(
                mode,
                BlockMode::Rans | BlockMode::RansGamma | BlockMode::RansCtx | BlockMode::RansUp
            ) && rans::lanes(len, WIDE_VERSION) != rans::lanes(len, UP_VERSION);
            rows_up |= mode == BlockMode::RansUp;
            let e = mode as u32 | (coded as u32) << 8;
            out[entry..entry + 4].copy_from_slice(&e.to_le_bytes());
            entry += 4;
        }
    }
    out.truncate(cur);
    match whole.filter(|&z| table_at + z < cur) {
        Some(z) => put_whole(out, table_at, &whole_out[..z]),
        None if wide => out[2] = WIDE_VERSION,
        None if rows_up => out[2] = UP_VERSION,
        None if gamma => out[2] = GAMMA_VERSION,
        None => {}
    }
}

/// Group the `w`-byte elements of `body` into the frame's streams in
/// `region` (`w * n` bytes, stream `k` at `k * n`): as they are (rotated
/// when `rotate`), against `base` stream by stream (`ops`), or as their
/// differences from the base's (`Delta::Ulp`, computed in `ulp`).
#[allow(clippy::too_many_arguments)]
fn frame_streams_into(
    body: &[u8],
    base: Option<&[u8]>,
    delta: Delta,
    ops: &[StreamOp],
    w: usize,
    rotate: bool,
    float: bool,
    ulp: &mut Vec<u8>,
    region: &mut [MaybeUninit<u8>],
) {
    match (delta, base, layout::Against::ops(ops)) {
        (Delta::Ulp, Some(base), _) => {
            layout::ulp_delta(body, base, w, float, ulp);
            layout::group_uninit(&ulp[..body.len()], w, false, region);
        }
        (Delta::PerStream, Some(base), layout::Against::Ops(masks)) if masks != [0, 0] => {
            layout::group_against_uninit(body, base, masks, w, rotate, region)
        }
        _ => layout::group_uninit(body, w, rotate, region),
    }
}

/// The streams of a frame as one zstd frame `z` in place of its block
/// table at `table_at` and the blocks after it (version 6, flag 0x40).
fn put_whole(out: &mut Vec<u8>, table_at: usize, z: &[u8]) {
    out.truncate(table_at);
    out.extend_from_slice(z);
    out[5] |= 0x40;
}

/// The fewest bytes the blocks and table entries of the streams of `n`
/// symbols in `streams` take, for `n` below a block's length; `hists`,
/// when given, are the streams' histograms.
fn blocks_floor_bytes(streams: &[u8], n: usize, hists: Option<&[[u32; 256]]>) -> f64 {
    let floor = |k: usize, s: &[u8]| match hists {
        Some(h) => block::floor_bytes_of(&h[k], s.len()),
        None => block::floor_bytes(s),
    };
    streams
        .chunks(n.max(1))
        .enumerate()
        .map(|(k, s)| floor(k, s) + 4.0)
        .sum()
}

/// Whether zstd's Huffman coding of the bytes it finds no match for
/// (its literals) could pay on `streams`, `n` bytes each, of these
/// histograms, by a two-part code's reckoning: order-0 coding saves at
/// most `8 N - H` bits of `N` literals of empirical entropy `H`, and must
/// state a table of `K` symbols, about `(K - 1) / 2 * log2 N` bits; zstd
/// codes no fewer than 64. Literals are the streams' bytes but those
/// repeating the byte before them in a run of [`LITERAL_RUN`] or more
/// (zstd's matches at offset 1); only a stream's byte that is more than
/// half of it is looked for in runs (the others are counted whole, which
/// can only say yes more often). Where it says no, zstd is told not to
/// try: random 32-bit words (a 5 KiB RNG state's low halves) made zstd
/// count them and build a table it then dropped, 6% of that state's
/// encode. On 33 distributions of 2.5-64 KiB of literals
/// (`examples/zstd_literals.rs`), zstd -3 coded its literals only where
/// this says yes. A byte that is most of its stream but scattered (a
/// sparse delta's zeros) is zstd's literals, not its matches: counted
/// out whole, as this once did, a 632-word i64 delta of 80% unchanged
/// bytes took a zstd frame of 2279 bytes, not 1925.
fn literals_pay(streams: &[u8], n: usize, hists: &[[u32; 256]]) -> bool {
    let mut merged = [0u32; 256];
    for (s, h) in streams.chunks(n.max(1)).zip(hists) {
        for (m, &c) in merged.iter_mut().zip(h) {
            *m += c;
        }
        // The stream's majority byte, less its runs' repeats.
        if let Some(d) = h.iter().position(|&c| 2 * c as usize > n) {
            merged[d] = merged[d].saturating_sub(run_repeats(s, d as u8));
        }
    }
    let n: u32 = merged.iter().sum();
    let k = merged.iter().filter(|&&c| c > 0).count();
    if n < 64 || k < 2 {
        return false;
    }
    let saved = 8.0 * n as f64 - entropy_bits_of(&merged, n.into());
    saved > (k - 1) as f64 / 2.0 * (n as f64).log2()
}

/// Runs of one byte at least this long are taken for zstd's matches.
const LITERAL_RUN: usize = 8;

/// The bytes `d` of `s` that repeat the one before them in a run of
/// [`LITERAL_RUN`] or more `d`s.
fn run_repeats(s: &[u8], d: u8) -> u32 {
    let mut repeats = 0;
    let mut run = 0usize;
    let mut byte = |b: u8, run: &mut usize| {
        if b == d {
            *run += 1;
        } else {
            if *run >= LITERAL_RUN {
                repeats += *run as u32 - 1;
            }
            *run = 0;
        }
    };
    // 32 bytes of `d` at a time (a form the compiler vectorises): the
    // constant-ish streams this looks at are mostly such stretches.
    let mut it = s.chunks_exact(32);
    for c in &mut it {
        if c.iter().fold(0u8, |a, &b| a | (b ^ d)) == 0 {
            run += 32;
        } else {
            c.iter().for_each(|&b| byte(b, &mut run));
        }
    }
    it.remainder().iter().for_each(|&b| byte(b, &mut run));
    byte(!d, &mut run);
    repeats
}

/// zstd's level for a small chunk stored as one zstd frame.
const SMALL_ZSTD_LEVEL: i32 = 3;

/// The width by which to group the bytes of `raw`: the dtype's, or for an
/// integer dtype narrower than 8 bytes the word of 2, 4 or 8 bytes whose
/// byte positions, each counted on its own, have the least order-0
/// entropy, if that saves 3% (counted on up to 8192 evenly spread 8-byte
/// words; a lane's table is reckoned at 64 bits). With it, if `counts`
/// and every byte of `raw` was counted, each stream's histogram and
/// entropy at that width: what the delta search would count again (a
/// sixth of a 5 KiB RNG state's encode).
fn group_width(raw: &[u8], dtype: DType, counts: bool) -> (usize, Option<Vec<Counted>>) {
    let w = dtype.width();
    let words = raw.len() / 8;
    if dtype.is_float() || w >= 8 || words < 8 {
        return (w, None);
    }
    let step = words.div_ceil(8192);
    // hs[j]: the histogram of stream j of 8-byte words (byte position j),
    // then hs[8 + j] of 4-byte words' stream j (positions j and j + 4),
    // hs[12 + j] of 2-byte words', hs[14] of single bytes: each merged
    // from two of the wider words' (a sixth of the additions of merging
    // every stream from the eight).
    let mut hs = [[0u32; 256]; 15];
    let mut counted_words = 0u64;
    for c in raw.chunks_exact(8).step_by(step) {
        counted_words += 1;
        for (j, &b) in c.iter().enumerate() {
            hs[j][b as usize] += 1;
        }
    }
    for (to, from) in [(8, 0), (12, 8), (14, 12)] {
        let g = (to - from) / 2;
        for l in 0..g {
            let (wide, narrow) = hs.split_at_mut(to);
            for ((m, a), b) in narrow[l]
                .iter_mut()
                .zip(&wide[from + l])
                .zip(&wide[from + l + g])
            {
                *m = a + b;
            }
        }
    }
    // Where stream `l` of `g`-byte words is in `hs`.
    let at = |g: usize, l: usize| match g {
        8 => l,
        4 => 8 + l,
        2 => 12 + l,
        _ => 14,
    };
    // Each stream's entropy at width `g`, each of `8 / g` symbols a word.
    let entropies = |g: usize| -> [f64; 8] {
        let mut e = [0.0; 8];
        let n = counted_words * (8 / g) as u64;
        for (l, e) in e.iter_mut().enumerate().take(g) {
            *e = entropy_bits_of(&hs[at(g, l)], n);
        }
        e
    };
    let bits = |g: usize, e: &[f64; 8]| -> f64 { e[..g].iter().map(|b| b + 64.0).sum() };
    let mut chosen = entropies(w);
    let mut best = (bits(w, &chosen) * 0.97, w);
    for g in [2, 4, 8].into_iter().filter(|&g| g > w) {
        let e = entropies(g);
        let b = bits(g, &e);
        if b < best.0 {
            best = (b, g);
            chosen = e;
        }
    }
    let g = best.1;
    let whole = counts && step == 1 && raw.len() == 8 * words;
    let counted = whole.then(|| {
        (0..g)
            .map(|l| Counted {
                hist: hs[at(g, l)],
                bits: chosen[l],
            })
            .collect()
    });
    (g, counted)
}

/// A stream's byte histogram and its order-0 entropy in bits.
struct Counted {
    hist: [u32; 256],
    bits: f64,
}

enum Choice {
    PerStream(Vec<StreamOp>),
    Ulp,
}

/// Byte histograms of a chunk's streams, one per stream.
type StreamHists = Vec<[u32; 256]>;

/// Pick the delta representation by the estimated coded size of a sample
/// (up to [`SEARCH_RUNS`] evenly spaced runs of [`search_run`] elements):
/// per stream the cheapest of keep / XOR / zigzag difference, or the
/// whole-element ULP difference, each coded plainly or (if `ctx_ok`) with
/// the base's exponent byte as context (of XOR and difference, only the
/// one plainly the cheaper is estimated with it); or no delta at all.
/// With the choice, if `want_hists` and the sample was the whole chunk,
/// the histograms of the streams it chose: those of the frame's blocks,
/// which a small chunk need not count again. `counted`, when given, are
/// the streams' histograms and entropies as they are.
#[allow(clippy::too_many_arguments)]
fn choose_delta(
    body: &[u8],
    base: &[u8],
    w: usize,
    rotate: bool,
    float: bool,
    ctx_ok: bool,
    counted: Option<&[Counted]>,
    want_hists: bool,
) -> (Choice, Option<StreamHists>) {
    let n = body.len() / w;
    let run = search_run(w, float);
    let ranges: Vec<(usize, usize)> = if n <= run * SEARCH_RUNS {
        vec![(0, n)]
    } else {
        let step = n / SEARCH_RUNS;
        (0..SEARCH_RUNS)
            .map(|i| (i * step, i * step + run))
            .collect()
    };
    // A chunk sampled whole is its own sample, not copied.
    let (sample, sample_base) = if ranges.len() == 1 {
        (Cow::Borrowed(body), Cow::Borrowed(base))
    } else {
        let (mut s, mut b) = (Vec::new(), Vec::new());
        for &(a, e) in &ranges {
            s.extend_from_slice(&body[a * w..e * w]);
            b.extend_from_slice(&base[a * w..e * w]);
        }
        (Cow::Owned(s), Cow::Owned(b))
    };
    let mut s = vec![Vec::new(); w];
    let mut bs = vec![Vec::new(); w];
    layout::group(&sample, w, rotate, &mut s);
    layout::group(&sample_base, w, rotate, &mut bs);
    let m = sample.len() / w;
    let s: Vec<&[u8]> = s.iter().map(|v| &v[..m]).collect();
    let bs: Vec<&[u8]> = bs.iter().map(|v| &v[..m]).collect();
    let ctx_model = ctx_ok.then(|| {
        let mut ctx = Vec::new();
        layout::context_bytes(&sample_base, w, float, &mut ctx);
        let model = context::CtxModel::new(&ctx);
        let mut classes = Vec::new();
        model.classes(&ctx, &mut classes);
        (model, classes)
    });
    // Context modelling only pays on streams with structure; near-noise
    // streams (>= 7.5 bits/symbol, low mantissa bytes) skip its estimate.
    let with_ctx = |t: &[u8], plain: f64| match &ctx_model {
        Some((model, classes)) if plain < 7.5 * t.len() as f64 => {
            plain.min(model.cost_bits(t, classes))
        }
        _ => plain,
    };
    let mut ops = Vec::with_capacity(w);
    let (mut per_stream_bits, mut no_delta_bits) = (0.0, 0.0);
    let mut t = [Vec::new(), Vec::new()];
    // When the sample is the whole chunk, the streams' histograms are
    // kept: as they are, counted whole already (an integer chunk's) or
    // here; and those of the deltas that won, by stream.
    let whole = m == n;
    let counted = counted.filter(|c| whole && !rotate && c.len() == w);
    let keep_hists = whole && want_hists;
    let mut own = Vec::with_capacity(if keep_hists { w } else { 0 });
    let mut won: Vec<Option<[u32; 256]>> = Vec::with_capacity(if keep_hists { w } else { 0 });
    // Whether some stream as it is is neither (nearly) constant nor noise.
    let mut structured = false;
    for k in 0..w {
        let plain = match counted {
            Some(c) => {
                debug_assert!(c[k].hist == histogram(s[k]), "stream {k} counted as it is");
                c[k].bits.max(CONSTANT_BLOCK_BITS)
            }
            None => {
                let h = histogram(s[k]);
                if keep_hists {
                    own.push(h);
                }
                block_cost(&h)
            }
        };
        no_delta_bits += plain;
        structured |= plain > CONSTANT_BLOCK_BITS.max(NEAR_CONSTANT_BITS * m as f64)
            && plain < NEAR_NOISE_BITS * m as f64;
        let mut best = (with_ctx(s[k], plain), StreamOp::Keep);
        let mut best_h = None;
        // A constant stream costs the floor already: nothing can beat it.
        let ops_worth_trying = if plain <= CONSTANT_BLOCK_BITS {
            &[][..]
        } else {
            &[StreamOp::Xor, StreamOp::Diff][..]
        };
        // XOR and difference counted, then the context estimate of the one
        // whose order-0 estimate is the smaller only: the two are deltas of
        // the same bytes under the same context, and the estimate is a
        // pass per class. On the LoRA run, gpt-small and bert-ft the other
        // one's estimate never changed a frame; the LoRA run's DELTA rows
        // encode 1.02x as fast (paired runs).
        let mut tried = [(f64::MAX, StreamOp::Keep, [0u32; 256]); 2];
        for ((&op, t), slot) in ops_worth_trying.iter().zip(&mut t).zip(&mut tried) {
            t.clear();
            t.extend_from_slice(s[k]);
            op.apply(t, bs[k]);
            let h = histogram(t);
            *slot = (block_cost(&h), op, h);
        }
        let lead = usize::from(tried[1].0 < tried[0].0);
        if !ops_worth_trying.is_empty() {
            tried[lead].0 = with_ctx(&t[lead], tried[lead].0);
        }
        for &(c, op, h) in &tried[..ops_worth_trying.len()] {
            // Prefer keeping the stream as is on a tie: decoding is cheaper.
            if c < best.0 * 0.995 {
                best = (c, op);
                best_h = keep_hists.then_some(h);
            }
        }
        if keep_hists {
            won.push(best_h);
        }
        per_stream_bits += best.0;
        ops.push(best.1);
    }
    let kept = |k: usize| -> [u32; 256] {
        match counted {
            Some(c) => c[k].hist,
            None => own[k],
        }
    };
    let keep = || {
        let hists = keep_hists.then(|| (0..w).map(kept).collect());
        (Choice::PerStream(vec![StreamOp::Keep; w]), hists)
    };
    // Integers whose every stream is constant or noise as it is (a 5 KiB
    // RNG state: random words, zero high halves), where per-stream deltas
    // do not pay, skip the element difference's estimate (a sixth of that
    // state's encode): where elements moved by little, the streams'
    // differences pay too (the low stream's are the element's small
    // differences), and a constant stream holds no carries for the
    // element's difference to save. A stream with some structure (the
    // high byte of values in a narrow band, moved by more than its low
    // byte spans) keeps the estimate: the element's difference saved 11%
    // there where per-stream deltas saved nothing. Not floats: skipping it
    // for them grew 20 of gpt-small's 256-byte bf16 frames from ~84 to
    // 150 bytes.
    if !float && !structured && per_stream_bits >= no_delta_bits * 0.995 {
        return keep();
    }
    let mut z = Vec::new();
    layout::ulp_delta(&sample, &sample_base, w, float, &mut z);
    let mut zs = vec![Vec::new(); w];
    layout::group(&z, w, false, &mut zs);
    let mut ulp_h = Vec::new();
    let mut ulp_bits = 0.0;
    for z in &zs {
        let h = histogram(&z[..m]);
        ulp_bits += with_ctx(&z[..m], block_cost(&h));
        if keep_hists {
            ulp_h.push(h);
        }
    }
    if ulp_bits < per_stream_bits.min(no_delta_bits) * 0.99 {
        (Choice::Ulp, keep_hists.then_some(ulp_h))
    } else if per_stream_bits < no_delta_bits * 0.995 {
        let chosen = |k: usize| won[k].unwrap_or_else(|| kept(k));
        let hists = keep_hists.then(|| (0..w).map(chosen).collect());
        (Choice::PerStream(ops), hists)
    } else {
        keep()
    }
}

/// Runs of elements the delta search samples from a chunk larger than
/// their sum.
const SEARCH_RUNS: usize = 4;

/// Elements a run of the delta search's sample: 1024, but for floats no
/// more than [`SEARCH_SAMPLE_BYTES`] in all, so floats of 4 bytes or more
/// sample fewer. The search counts every candidate of every sampled byte:
/// on the small delta chunks of a LoRA fine-tune (48-192 KiB of fp32) it
/// was a third of the encoder's time, and half the sample gave the same
/// choices but for 0.02% of their bytes. Integers keep 1024: a small
/// chunk of them sampled whole hands its histograms on (`want_hists`).
fn search_run(w: usize, float: bool) -> usize {
    match float {
        true => (SEARCH_SAMPLE_BYTES / SEARCH_RUNS / w.max(1)).clamp(1, 1024),
        false => 1024,
    }
}

/// Bytes of a float chunk's delta-search sample, at most (see
/// [`search_run`]).
const SEARCH_SAMPLE_BYTES: usize = 8 * 1024;

/// Estimated coded bits of a sample stream of histogram `h`: order-0
/// entropy, floored at what a constant block costs.
fn block_cost(h: &[u32; 256]) -> f64 {
    entropy_bits(h).max(CONSTANT_BLOCK_BITS)
}

/// What a constant block costs (its one byte), the floor of the estimates.
const CONSTANT_BLOCK_BITS: f64 = 8.0;

/// Bits a symbol under which a stream counts as (nearly) constant, and
/// over which as noise, for the delta search's skip of the element
/// difference (see [`choose_delta`]).
const NEAR_CONSTANT_BITS: f64 = 0.05;
const NEAR_NOISE_BITS: f64 = 7.0;

/// Decode a frame. `base` must be the chunk the frame was encoded against
/// when [`FrameInfo::needs_base`] says so.
pub fn decode(frame: &[u8], base: Option<&[u8]>) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    decode_into(
        frame,
        base,
        HARD_MAX_RAW_LEN,
        &mut out,
        &mut Scratch::default(),
    )?;
    Ok(out)
}

/// [`decode`] into `out` (resized to the raw length), reusing `scratch`.
/// `max_raw_len` bounds the allocation (at most [`HARD_MAX_RAW_LEN`]).
pub fn decode_into(
    frame: &[u8],
    base: Option<&[u8]>,
    max_raw_len: u64,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<(), DecodeError> {
    let info = FrameInfo::parse(frame)?;
    let limit = max_raw_len.min(HARD_MAX_RAW_LEN);
    if info.raw_len > limit {
        return Err(DecodeError::TooLarge {
            declared: info.raw_len,
            limit,
        });
    }
    let raw_len = info.raw_len as usize;
    let base = match (info.needs_base(), base) {
        (false, _) => None,
        (true, None) => return Err(DecodeError::BaseRequired),
        (true, Some(b)) if b.len() != raw_len => {
            return Err(DecodeError::BaseLength {
                expected: info.raw_len,
                found: b.len() as u64,
            })
        }
        (true, Some(b)) => Some(b),
    };
    if info.palette {
        return decode_palette(frame, &info, out, scratch);
    }
    if info.rows {
        return decode_rows(frame, &info, out, scratch);
    }
    out.clear();
    out.reserve(raw_len);
    decode_grouped(frame, &info, base, None, out, scratch)
}

/// Decode the elements of a grouped-entropy frame `info` of `frame` into
/// the spare capacity of `out`, then set its length: the frame's chunk.
/// With `rows`, the raw length of a row frame whose others this frame
/// holds ([`decode_rows`]; no element map, no tail), the pieces in
/// `scratch.pieces` say where each run of the frame's elements goes in
/// that chunk and which elements of `base` (the roots' part) it is
/// against, and the caller writes the rest and sets the length.
fn decode_grouped(
    frame: &[u8],
    info: &FrameInfo,
    base: Option<&[u8]>,
    rows: Option<usize>,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<(), DecodeError> {
    debug_assert!(
        rows.is_none()
            || !(info.element_map
                || info.whole_zstd
                || info.raw_len % info.group_width as u64 != 0),
        "a row frame's others in place: no element map, no whole zstd, no tail"
    );
    let raw_len = info.raw_len as usize;
    let w = info.group_width;
    let all = raw_len / w;
    let mut pos = info.header_len;
    let truncated = |need: usize| DecodeError::Truncated {
        need: need as u64,
        have: frame.len() as u64,
    };
    let mut ops = vec![StreamOp::Keep; w];
    if info.delta == Delta::PerStream {
        let b = frame.get(pos..pos + w).ok_or(truncated(pos + w))?;
        for (k, &c) in b.iter().enumerate() {
            ops[k] = StreamOp::from_code(c).ok_or(corrupt(pos + k, "unknown stream op"))?;
        }
        pos += w;
    }
    let tail_len = raw_len - all * w;
    let tail = frame
        .get(pos..pos + tail_len)
        .ok_or(truncated(pos + tail_len))?;
    pos += tail_len;
    let Scratch {
        streams,
        tables,
        entries,
        ctx,
        runs,
        skip_bits,
        pieces,
        compact_base,
        ..
    } = scratch;
    // `n` elements go through the streams: all of them, or the kept ones
    // of an element map, each against the base's same element. Each run of
    // kept elements is decoded into its place in the chunk (`pieces`);
    // short runs (a scattered map) are decoded back to back against the
    // base's kept elements gathered, then moved into place: per run, the
    // kernels' fixed costs would outweigh the copies.
    let mut n = all;
    let full_base = match rows {
        Some(_) => base,
        None => base.map(|b| &b[..all * w]),
    };
    let mut base = full_base;
    let mut scattered = false;
    if rows.is_none() {
        pieces.clear();
    }
    if info.element_map && rows.is_none() {
        let map = elements::read(frame, pos, all, runs, skip_bits)?;
        pos = map.end;
        n = map.kept;
        // A scattered map goes by its skip bits, a map of long runs by
        // its runs (a bitmap is read as bits, run lengths as runs).
        scattered = self::scattered(map.skipped_runs, n);
        if scattered {
            if skip_bits.is_empty() {
                elements::bits_of_runs(runs, all, skip_bits);
            }
            if let Some(b) = full_base {
                elements::compact_bits(b, skip_bits, all, w, compact_base);
                base = Some(&compact_base[..n * w]);
            }
        } else {
            if runs.is_empty() {
                elements::runs_of_bits(skip_bits, all, runs);
            }
            elements::kept_pieces(runs, pieces);
        }
    }
    if (!info.element_map || scattered) && n > 0 && rows.is_none() {
        pieces.push(elements::Piece {
            at: 0,
            to: 0,
            from: 0,
            len: n,
        });
    }

    if info.whole_zstd {
        decode_whole_zstd(frame, pos, n, w, tables)?;
        pos = frame.len();
    }
    let block = 1usize << BLOCK_LOG2;
    let nblocks = if info.whole_zstd {
        0
    } else {
        n.div_ceil(block)
    };
    let nentries = w * nblocks;
    let table_bytes = frame
        .get(pos..pos + 4 * nentries)
        .ok_or(truncated(pos + 4 * nentries))?;
    entries.clear();
    let mut total: u64 = 0;
    for (i, e) in table_bytes.chunks_exact(4).enumerate() {
        let e = u32::from_le_bytes(e.try_into().expect("4 bytes"));
        let mode =
            BlockMode::from_code(e as u8).ok_or(corrupt(pos + 4 * i, "unknown block mode"))?;
        let len = (e >> 8) as usize;
        total += len as u64;
        entries.push((mode, len));
    }
    pos += 4 * nentries;
    if total != (frame.len() - pos) as u64 {
        return Err(corrupt(pos, "block lengths do not add up to the frame"));
    }

    // The base's context bytes only when a block is coded with them.
    let ctx_coded = base.is_some() && entries.iter().any(|e| e.0 == BlockMode::RansCtx);
    let float = info.dtype.is_float();
    let rebuild = ElementOps {
        w,
        rotated: info.rotated,
        against: if info.delta == Delta::Ulp {
            Some(layout::Against::Ulp { float })
        } else if ops.iter().any(|&o| o != StreamOp::Keep) {
            Some(layout::Against::ops(&ops))
        } else {
            None
        },
    };
    // Where each stream's blocks start; a stream stored all raw is used in
    // place, straight from the frame (the base is combined in by the
    // ungrouping), and a whole-zstd frame's streams from its one buffer.
    let mut at = vec![pos; w];
    let mut in_frame = vec![info.whole_zstd; w];
    for (k, ents) in entries.chunks(nblocks.max(1)).enumerate().take(w) {
        at[k] = pos;
        let len: usize = ents.iter().map(|e| e.1).sum();
        if ents.iter().all(|e| e.0 == BlockMode::Raw) {
            if len != n {
                return Err(corrupt(
                    pos,
                    "raw block length differs from its symbol count",
                ));
            }
            in_frame[k] = true;
        }
        pos += len;
    }
    streams.resize_with(w, Vec::new);
    // The output is written once, into fresh capacity: no zero-filling
    // pass first (a reused `out` that was shorter, or a new one, would
    // otherwise be zeroed up to the raw length).
    let body = &mut out.spare_capacity_mut()[..rows.unwrap_or(all * w)];
    if info.element_map && !scattered {
        elements::fill_skipped(body, runs, full_base, w);
    }
    // Block by block (all of it at once for whole zstd): the context, each
    // stream's block, then the elements into their places, so the base,
    // the context and the streams of one block are read back from the
    // cache, not from memory. `first` is the first piece not yet placed
    // whole.
    let span = if info.whole_zstd { n.max(1) } else { block };
    let mut first = 0;
    for (bi, lo) in (0..n).step_by(span).enumerate() {
        let hi = (lo + span).min(n);
        // This block's part of each piece that overlaps it: (elements of
        // the block, of the chunk, and the first of the base).
        let parts = pieces[first..].iter().take_while(|p| p.at < hi).map(|p| {
            let (a, b) = (p.at.max(lo), (p.at + p.len).min(hi));
            (
                a - lo..b - lo,
                p.to + a - p.at..p.to + b - p.at,
                p.from + a - p.at,
            )
        });
        let c = match (base, ctx_coded) {
            (Some(base), true) => {
                let ctx = &mut layout::grow(ctx, hi - lo)[..hi - lo];
                for (i, _, f) in parts.clone() {
                    let raw = &base[f * w..(f + i.len()) * w];
                    layout::context_bytes_into(raw, w, float, &mut ctx[i]);
                }
                Some(&ctx[..])
            }
            _ => None,
        };
        for (k, s) in streams
            .iter_mut()
            .enumerate()
            .filter(|&(k, _)| !in_frame[k])
        {
            let (mode, len) = entries[k * nblocks + bi];
            let dst = &mut layout::grow(s, hi - lo)[..hi - lo];
            block::decode(info.version, mode, frame, at[k], len, c, dst, tables)?;
            at[k] += len;
        }
        // Stream `k`'s symbols of the block's elements `i`.
        let symbols = |i: std::ops::Range<usize>| -> [&[u8]; 8] {
            let mut refs: [&[u8]; 8] = [&[]; 8];
            for (k, r) in refs.iter_mut().enumerate().take(w) {
                let (a, b) = (lo + i.start, lo + i.end);
                *r = match (in_frame[k], info.whole_zstd) {
                    (true, true) => &tables.whole[k * n + a..k * n + b],
                    (true, false) => &frame[at[k] + a..at[k] + b],
                    (false, _) => &streams[k][i.clone()],
                };
            }
            refs
        };
        for (i, e, f) in parts {
            let b = base.map(|b| &b[f * w..(f + e.len()) * w]);
            rebuild.place(&symbols(i)[..w], b, &mut body[e.start * w..e.end * w]);
        }
        while pieces.get(first).is_some_and(|p| p.at + p.len <= hi) {
            first += 1;
        }
    }
    if rows.is_some() {
        // The caller places the rest and sets the length.
        return Ok(());
    }
    if scattered {
        // SAFETY: the one piece covered the `n` kept elements, back to
        // back: `n * w` bytes within the capacity reserved above.
        unsafe { out.set_len(n * w) };
        // The skipped elements' room, zeroed once (then the kept runs move
        // up into place, back to front).
        out.resize(all * w, 0);
        elements::expand_bits(out, n, skip_bits, full_base, w);
    } else {
        // SAFETY: the pieces cover every kept element and `fill_skipped`
        // every skipped one (without a map, one piece covers all of them);
        // each piece's elements were written whole by the ungrouping, each
        // block's part of it once: all of `body`, `all * w` bytes within
        // the capacity reserved above.
        unsafe { out.set_len(all * w) };
    }
    out.extend_from_slice(tail);
    Ok(())
}

/// An element map whose kept runs average fewer elements than this is
/// decoded back to back and then moved into place (a kernel call per run
/// costs more than the copies: 1 Mi fp32 elements of which every other
/// one is skipped decode at 170 MiB/s placed run by run, 550 moved).
const SCATTERED_BELOW: usize = 32;

/// Whether a map of `skipped_runs` runs of skipped elements around `kept`
/// kept ones is scattered ([`SCATTERED_BELOW`]): the decoder then moves
/// its elements by skip bits, and the encoder compacts them the same way.
fn scattered(skipped_runs: usize, kept: usize) -> bool {
    skipped_runs * SCATTERED_BELOW > kept
}

/// How a frame's elements come back from their streams: ungrouped, and
/// combined with the base's elements in the same pass when the frame has
/// a per-stream op or the whole-element ULP delta.
struct ElementOps {
    w: usize,
    rotated: bool,
    against: Option<layout::Against>,
}

impl ElementOps {
    /// Write the elements of the symbols `refs` (one slice per stream)
    /// into `dst`, every byte, given the same elements of the base.
    fn place(&self, refs: &[&[u8]], base: Option<&[u8]>, dst: &mut [MaybeUninit<u8>]) {
        match (base, self.against) {
            (Some(b), Some(how)) => {
                layout::ungroup_against_uninit(refs, how, b, self.w, self.rotated, dst)
            }
            _ => layout::ungroup_uninit(refs, self.w, self.rotated, dst),
        }
    }
}

/// A row frame (version 8): its two inner frames decoded, the second
/// against the roots its rows name, and the rows put back in place.
fn decode_rows(
    frame: &[u8],
    info: &FrameInfo,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<(), DecodeError> {
    let raw_len = info.raw_len as usize;
    let w = info.dtype.width();
    let n = raw_len / w;
    let at = info.header_len;
    let ([len, lead, r], pos) = rows::read_numbers(frame, at)?;
    let g = rows::Geometry::new(n, Rows { len, lead })
        .filter(|g| g.count >= 2)
        .ok_or(corrupt(
            at,
            "row length and lead do not fit two rows in the chunk",
        ))?;
    if r == 0 || r >= g.count {
        return Err(corrupt(at, "root count not between 1 and the rows"));
    }
    let (plan, pos) = rows::read_plan(frame, pos, g.count, r)?;
    let (a_len, pos) = leb::read(frame, pos, frame.len(), 5)?;
    let a_end = pos + a_len as usize;
    let fa = frame.get(pos..a_end).ok_or(DecodeError::Truncated {
        need: a_end as u64,
        have: frame.len() as u64,
    })?;
    let fd = &frame[a_end..];
    let [mut a, mut d, mut b] = std::mem::take(&mut scratch.row_parts);
    let a_want = raw_len - (g.count - r) * len * w;
    let d_want = (g.count - r) * len * w;
    let decoded = (|| {
        let ia = inner_info(fa, pos, info.dtype, a_want)?;
        if ia.needs_base() {
            return Err(corrupt(pos, "a row frame's roots need a base"));
        }
        decode_into(fa, None, a_want as u64, &mut a, scratch).map_err(|e| shifted(e, pos))?;
        let id = inner_info(fd, a_end, info.dtype, d_want)?;
        let root = |x: u32| (lead + x as usize * len) * w;
        let others = || plan.is_root.iter().enumerate().filter(|r| !r.1);
        // A delta frame without an element map is decoded straight into
        // the chunk, each row against its root in `a`. Anything else (an
        // element map, no delta) decodes the others back to back, against
        // their roots gathered, and they are moved into place below.
        let in_place = id.needs_base() && !id.element_map && !id.whole_zstd && id.group_width == w;
        if in_place {
            let pieces = &mut scratch.pieces;
            pieces.clear();
            for (k, ((i, _), &x)) in others().zip(&plan.of).enumerate() {
                pieces.push(elements::Piece {
                    at: k * len,
                    to: lead + i * len,
                    from: root(x) / w,
                    len,
                });
            }
            out.clear();
            out.reserve(raw_len);
            decode_grouped(fd, &id, Some(&a), Some(raw_len), out, scratch)
                .map_err(|e| shifted(e, a_end))?;
        } else {
            b.clear();
            if id.needs_base() {
                for &x in &plan.of {
                    b.extend_from_slice(&a[root(x)..][..len * w]);
                }
            }
            let base = id.needs_base().then_some(b.as_slice());
            decode_into(fd, base, d_want as u64, &mut d, scratch).map_err(|e| shifted(e, a_end))?;
            out.clear();
            out.reserve(raw_len);
        }
        // The lead, the roots, the trail and tail from `a`; the others
        // from `d` unless decoded in place.
        let body = &mut out.spare_capacity_mut()[..raw_len];
        let row = |i: usize| (lead + i * len) * w..(lead + i * len + len) * w;
        put(&mut body[..lead * w], &a[..lead * w]);
        let roots = plan.is_root.iter().enumerate().filter(|r| *r.1);
        for (x, (i, _)) in roots.enumerate() {
            put(&mut body[row(i)], &a[root(x as u32)..][..len * w]);
        }
        if !in_place {
            for (k, (i, _)) in others().enumerate() {
                put(&mut body[row(i)], &d[k * len * w..][..len * w]);
            }
        }
        let rest = (lead + g.count * len) * w;
        put(&mut body[rest..], &a[(lead + r * len) * w..]);
        // SAFETY: every other row was written (by the others' frame, its
        // pieces one row each, or from `d`), and the lines above wrote the
        // lead, the roots and the trail and tail: all `raw_len` bytes,
        // within the capacity reserved above.
        unsafe { out.set_len(raw_len) };
        Ok(())
    })();
    scratch.row_parts = [a, d, b];
    decoded
}

/// Copy `src` into `dst` (as long), uninitialised bytes of an output.
fn put(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "put copies equal lengths");
    // SAFETY: both are `src.len()` bytes (checked above), in different
    // buffers (`dst` is spare capacity, `src` an initialised slice).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast(), src.len()) }
}

/// The header of a row frame's inner frame at `at` in the row frame,
/// checked: a grouped-entropy frame of `dtype` and `raw_len` bytes.
fn inner_info(
    frame: &[u8],
    at: usize,
    dtype: DType,
    raw_len: usize,
) -> Result<FrameInfo, DecodeError> {
    let info = FrameInfo::parse(frame).map_err(|e| shifted(e, at))?;
    if info.rows {
        return Err(corrupt(at, "a row frame inside a row frame"));
    }
    if info.dtype != dtype || info.raw_len != raw_len as u64 {
        return Err(corrupt(
            at,
            "a row frame's inner frame has another dtype or length",
        ));
    }
    Ok(info)
}

/// An inner frame's error at `at` in its outer frame.
fn shifted(e: DecodeError, at: usize) -> DecodeError {
    let at = at as u64;
    match e {
        DecodeError::Corrupt { offset, reason } => DecodeError::Corrupt {
            offset: offset + at,
            reason,
        },
        DecodeError::Truncated { need, have } => DecodeError::Truncated {
            need: need + at,
            have: have + at,
        },
        e => e,
    }
}

/// Decode a palette frame (version 6, transform bit 7; its header checked
/// and its raw length within the caller's limit).
fn decode_palette(
    frame: &[u8],
    info: &FrameInfo,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> Result<(), DecodeError> {
    let raw_len = info.raw_len as usize;
    let w = info.dtype.width();
    let n = raw_len / w;
    let truncated = |need: usize| DecodeError::Truncated {
        need: need as u64,
        have: frame.len() as u64,
    };
    let mut pos = info.header_len;
    let tail_len = raw_len - n * w;
    let tail = frame
        .get(pos..pos + tail_len)
        .ok_or(truncated(pos + tail_len))?;
    pos += tail_len;
    let k = *frame.get(pos).ok_or(truncated(pos + 1))? as usize + 1;
    pos += 1;
    let pal = frame.get(pos..pos + k * w).ok_or(truncated(pos + k * w))?;
    if pal
        .chunks_exact(w)
        .zip(pal.chunks_exact(w).skip(1))
        .any(|(a, b)| palette::key(a) >= palette::key(b))
    {
        return Err(corrupt(pos, "palette values not strictly increasing"));
    }
    pos += k * w;
    // The index stream: the rest of the frame, decoded as a `u8` frame of
    // `n` elements with the same whole-zstd bit.
    let mut inner = std::mem::take(&mut scratch.palette_inner);
    let mut idx = std::mem::take(&mut scratch.palette_idx);
    inner.clear();
    inner.extend_from_slice(&MAGIC);
    // The palette frame's version is its index frame's (7 before gamma
    // tables, whatever version the palette frame said).
    let version = frame[2].max(PLAIN_VERSION);
    inner.extend_from_slice(&[version, CODEC_GROUPED, DType::U8.code()]);
    inner.push(frame[5] & 0x40);
    leb::write(n as u64, &mut inner);
    let h = inner.len();
    inner.extend_from_slice(&frame[pos..]);
    let r = decode_into(&inner, None, HARD_MAX_RAW_LEN, &mut idx, scratch);
    scratch.palette_inner = inner;
    // Offsets in the index frame, as offsets in this frame.
    let at = |o: u64| o.saturating_sub(h as u64) + pos as u64;
    let r = r.map_err(|e| match e {
        DecodeError::Truncated { need, .. } => truncated(at(need) as usize),
        DecodeError::Corrupt { offset, reason } => DecodeError::Corrupt {
            offset: at(offset),
            reason,
        },
        e => e,
    });
    if let Err(e) = r {
        scratch.palette_idx = idx;
        return Err(e);
    }
    let bad = idx.len() != n || idx.iter().fold(0u8, |m, &i| m.max(i)) as usize >= k;
    if bad {
        scratch.palette_idx = idx;
        return Err(corrupt(pos, "palette index out of range"));
    }
    out.clear();
    out.resize(n * w, 0);
    match w {
        2 => palette_expand::<2>(pal, &idx, out),
        4 => palette_expand::<4>(pal, &idx, out),
        8 => palette_expand::<8>(pal, &idx, out),
        _ => {
            for (o, &i) in out.chunks_exact_mut(w).zip(&idx) {
                o.copy_from_slice(&pal[i as usize * w..][..w]);
            }
        }
    }
    out.extend_from_slice(tail);
    scratch.palette_idx = idx;
    Ok(())
}

/// Each element of `out` (`W` bytes) the palette value its index names
/// (every index below the palette's length, checked).
fn palette_expand<const W: usize>(pal: &[u8], idx: &[u8], out: &mut [u8]) {
    let mut table = [[0u8; W]; palette::MAX];
    for (t, v) in table.iter_mut().zip(pal.chunks_exact(W)) {
        t.copy_from_slice(v);
    }
    for (o, &i) in out.chunks_exact_mut(W).zip(idx) {
        o.copy_from_slice(&table[i as usize]);
    }
}

/// The streams of a version 6 frame stored as one zstd frame at
/// `frame[pos..]`: `w` streams of `n` symbols, back to back, decompressed
/// into `tables.whole` (stream `k` at `k * n..(k + 1) * n`).
fn decode_whole_zstd(
    frame: &[u8],
    pos: usize,
    n: usize,
    w: usize,
    tables: &mut block::Tables,
) -> Result<(), DecodeError> {
    let payload = &frame[pos..];
    let bad = || corrupt(pos, "zstd streams do not decode to the elements");
    if zstd::zstd_safe::find_frame_compressed_size(payload) != Ok(payload.len()) {
        return Err(bad());
    }
    let all = n.checked_mul(w).ok_or_else(bad)?;
    let buf = layout::grow(&mut tables.whole, all);
    if tables.zstd.is_none() {
        tables.zstd = Some(zstd::bulk::Decompressor::new().map_err(|_| bad())?);
    }
    let d = tables.zstd.as_mut().ok_or_else(bad)?;
    match d.decompress_to_buffer(payload, &mut buf[..]) {
        Ok(m) if m == all => {}
        _ => return Err(bad()),
    }
    Ok(())
}

/// The byte-grouped streams of `raw`'s whole elements of `dtype` (byte
/// `k` of every element in stream `k`, no sign-bit rotation), each XORed
/// with the same stream of `base` when given: the representation plain
/// LMC entropy-codes. For benchmarks that measure general-purpose
/// compressors and the entropy bound on the bytes this codec starts from.
/// A trailing partial element of `raw` is left out; a `base` shorter than
/// `raw` is XORed over its own whole elements only.
pub fn grouped_streams(raw: &[u8], base: Option<&[u8]>, dtype: DType) -> Vec<Vec<u8>> {
    let w = dtype.width();
    let n = raw.len() / w;
    let mut s = vec![Vec::new(); w];
    layout::group(&raw[..n * w], w, false, &mut s);
    for t in &mut s {
        t.truncate(n);
    }
    if let Some(b) = base {
        let nb = n.min(b.len() / w);
        let mut bs = vec![Vec::new(); w];
        layout::group(&b[..nb * w], w, false, &mut bs);
        for (t, b) in s.iter_mut().zip(&bs) {
            StreamOp::Xor.apply(&mut t[..nb], &b[..nb]);
        }
    }
    s
}

/// [`grouped_streams`] back to back, then the bytes of `raw`'s trailing
/// partial element, into `out` (cleared first; `raw.len()` bytes): the
/// input a benchmark gives general-purpose compressors, made in as few
/// passes as the codec makes its own streams (grouped in place, XORed with
/// the grouped base; a shorter base over its own whole elements only, as
/// there).
pub fn group_streams_into(raw: &[u8], base: Option<&[u8]>, dtype: DType, out: &mut Vec<u8>) {
    let w = dtype.width();
    let n = raw.len() / w;
    out.clear();
    out.reserve(raw.len());
    layout::group_uninit(
        &raw[..n * w],
        w,
        false,
        &mut out.spare_capacity_mut()[..n * w],
    );
    // SAFETY: `group_uninit` wrote all `n * w` bytes, within the capacity
    // reserved above.
    unsafe { out.set_len(n * w) };
    let nb = base.map_or(0, |b| n.min(b.len() / w));
    if let Some(b) = base.filter(|_| nb > 0) {
        let mut bs = vec![Vec::new(); w];
        layout::group(&b[..nb * w], w, false, &mut bs);
        for (t, b) in out.chunks_mut(n).zip(&bs) {
            StreamOp::Xor.apply(&mut t[..nb], &b[..nb]);
        }
    }
    out.extend_from_slice(&raw[n * w..]);
}

/// The inverse of [`group_streams_into`] (and of [`grouped_streams`]
/// joined): `joined` is the streams back to back followed by the bytes of
/// `raw`'s trailing partial element (so `raw.len()` bytes in all), `base`
/// the same base; writes `raw` into `out` (cleared first). For benchmarks
/// that time general-purpose compressors on the grouped bytes: their
/// decompression ends here, as their compression starts there.
pub fn ungroup_streams_into(joined: &[u8], base: Option<&[u8]>, dtype: DType, out: &mut Vec<u8>) {
    let w = dtype.width();
    let n = joined.len() / w;
    let nb = base.map_or(0, |b| n.min(b.len() / w));
    let streams: Vec<&[u8]> = joined[..n * w].chunks(n.max(1)).take(w).collect();
    let slice = |a: usize, b: usize| -> Vec<&[u8]> { streams.iter().map(|s| &s[a..b]).collect() };
    out.clear();
    out.reserve(joined.len());
    let body = &mut out.spare_capacity_mut()[..n * w];
    if n > 0 {
        let (head, rest) = body.split_at_mut(nb * w);
        if let Some(b) = base.filter(|_| nb > 0) {
            let xor = layout::Against::ops(&vec![StreamOp::Xor; w]);
            layout::ungroup_against_uninit(&slice(0, nb), xor, &b[..nb * w], w, false, head);
        }
        layout::ungroup_uninit(&slice(nb, n), w, false, rest);
    }
    // SAFETY: the two ungroupings wrote every byte of `body`: `n * w`
    // bytes within the capacity reserved above.
    unsafe { out.set_len(n * w) };
    out.extend_from_slice(&joined[n * w..]);
}

/// Not part of the API: block-level entry points for the micro-benchmarks
/// `examples/huff_speed.rs` (Huffman and rANS on single blocks, byte
/// grouping) and `examples/sparse_speed.rs`. Anything here may change or vanish in any release.
#[doc(hidden)]
pub mod probe {
    pub use super::huffman::{DecodeTable, EncodeScratch};
    use super::{histogram, huffman, rans, sparse, DecodeError, FORMAT_VERSION};

    /// Byte grouping of 2-byte elements, rotated (`layout::group`).
    pub fn group2(raw: &[u8], streams: &mut [Vec<u8>; 2]) {
        super::layout::group(raw, 2, true, streams)
    }

    /// Ungrouping of two streams, rotated (`layout::ungroup`).
    pub fn ungroup2(streams: [&[u8]; 2], out: &mut [u8]) {
        super::layout::ungroup(&streams, 2, true, out)
    }

    /// A Huffman block payload of `block` (its code built from its
    /// histogram), appended to `out`.
    pub fn huffman_encode(block: &[u8], out: &mut Vec<u8>, scratch: &mut EncodeScratch) {
        let lens = huffman::code_lengths(&histogram(block), huffman::MAX_BITS);
        huffman::encode(block, &lens, out, scratch);
    }

    /// Decode a Huffman block payload into `out` (as long as the block).
    pub fn huffman_decode(
        payload: &[u8],
        out: &mut [u8],
        table: &mut DecodeTable,
    ) -> Result<(), DecodeError> {
        huffman::decode(payload, 0, payload.len(), out, table)
    }

    /// A plain rANS block payload of `block`, appended to `out`.
    pub fn rans_encode(block: &[u8], out: &mut Vec<u8>) {
        rans::encode(block, &super::stats::normalize(&histogram(block)), out);
    }

    /// A sparse block payload of `block` around its most common symbol
    /// (`None` where every symbol is that one).
    pub fn sparse_encode(block: &[u8]) -> Option<Vec<u8>> {
        let (z, _) = sparse::dominant(&histogram(block));
        let mut scratch = sparse::EncodeScratch::default();
        sparse::plan(block, z, block.len(), f64::MAX, &mut scratch)?;
        Some(scratch.payload)
    }

    /// Decode a sparse block payload into `out` (as long as the block).
    pub fn sparse_decode(
        payload: &[u8],
        out: &mut [u8],
        table: &mut DecodeTable,
        buf: &mut Vec<u8>,
    ) -> Result<(), DecodeError> {
        sparse::decode(payload, 0, payload.len(), out, table, buf)
    }

    /// Decode a plain rANS block payload into `out` (as long as the block).
    pub fn rans_decode(
        payload: &[u8],
        out: &mut [u8],
        slots: &mut Vec<u32>,
    ) -> Result<(), DecodeError> {
        rans::decode(payload, 0, out, slots, FORMAT_VERSION)
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_v11;
