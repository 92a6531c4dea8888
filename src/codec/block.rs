//! Per-block entropy coding: each 64 KiB block of a stream is stored as the
//! smallest of raw, constant run, Huffman, rANS, bit-packed, zstd and
//! sparse, and context rANS: against the base's byte in a delta frame, or
//! against the block's own symbol a row up when the frame gives a row
//! distance.
//!
//! Owns: the block mode byte ([`BlockMode`]), the choice of a block's mode
//! from size estimates (sampled for large blocks), and the dispatch of a
//! block's encode and decode to the coder of its mode. Must not: code
//! symbols itself (`huffman`, `rans`, `context`, `packed`, `sparse` and
//! the zstd library do) or compute statistics (`stats` does); it stands on those,
//! and none of them imports it.

use std::f64::consts::LN_2;

use super::context::{self, CtxModel};
use super::stats::{
    self, entropy_bits, entropy_bits_of, histogram, sampled_histogram, sampled_rest,
};
use super::{huffman, leb, packed, rans, sparse, DecodeError, Options};

/// How one block is stored. The discriminant is the on-disk mode byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BlockMode {
    Raw = 0,
    Const = 1,
    Huffman = 2,
    Rans = 3,
    /// rANS with one table per class of the context byte (the base's byte
    /// at the same place); only in delta frames.
    RansCtx = 4,
    /// Every symbol the block's least plus a field of 1-7 bits, shifted
    /// (from format version 3).
    Packed = 5,
    /// A zstd frame (RFC 8878) of the block's symbols (from format
    /// version 5): matches, which order-0 coding cannot see.
    Zstd = 6,
    /// One symbol everywhere but a few places, which are stored with
    /// their symbols (from format version 7).
    Sparse = 7,
    /// Plain rANS whose table is gamma-coded differences of neighbouring
    /// symbols' frequencies (from format version 9).
    RansGamma = 8,
    /// Context rANS whose context is the block's own symbol a distance
    /// back, a whole number of the tensor's rows (from format version
    /// 10): the element above, for matrices whose exponents follow their
    /// column (Adam's moments of LoRA adapters).
    RansUp = 9,
}

impl BlockMode {
    pub fn from_code(c: u8) -> Option<BlockMode> {
        match c {
            0 => Some(BlockMode::Raw),
            1 => Some(BlockMode::Const),
            2 => Some(BlockMode::Huffman),
            3 => Some(BlockMode::Rans),
            4 => Some(BlockMode::RansCtx),
            5 => Some(BlockMode::Packed),
            6 => Some(BlockMode::Zstd),
            7 => Some(BlockMode::Sparse),
            8 => Some(BlockMode::RansGamma),
            9 => Some(BlockMode::RansUp),
            _ => None,
        }
    }
}

/// Smallest block worth a rANS table.
const RANS_MIN_SYMBOLS: usize = 1024;
/// Smallest block worth context-modelled rANS (up to eight tables).
pub(super) const RANS_CTX_MIN_SYMBOLS: usize = 4096;

/// Encode one block, appending its payload to `out`; returns its mode. A
/// raw block's payload is its symbols as they are, which the caller places
/// (the encoder groups them where they belong in the frame already): for
/// [`BlockMode::Raw`] nothing is appended.
/// `ctx`, when given, is the context model of the base's same block and
/// the class of each symbol's context: context-modelled rANS may then code
/// each symbol with the table of its class.
pub fn encode(
    syms: &[u8],
    ctx: Option<(&CtxModel, &[u8])>,
    up: Option<usize>,
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut EncodeScratch,
) -> BlockMode {
    let n = syms.len();
    let keep_raw_above = n as f64 * (1.0 - opts.min_gain as f64);
    // `h` counts the symbols of the block (`exact`), or of a quarter sample
    // of a large skewed one with every symbol between the block's least and
    // greatest counted at least once: a code built on it covers every
    // symbol present. Sizes estimated from it are scaled by `scale` to the
    // whole block. A delta block that may be context-coded counts its
    // symbols per class anyway: their sum is its exact histogram.
    let ctx = ctx.filter(|_| opts.rans && n >= RANS_CTX_MIN_SYMBOLS);
    let mut plan = None;
    // The packing shape is exact either way: from the block's least,
    // greatest and differing bits here, from its exact histogram below.
    let (h, scale, exact, shape) = if n >= SAMPLE_MIN_SYMBOLS {
        // Noise (low mantissa bytes, half or more of a checkpoint) is
        // recognised on a 1-in-16 sample first: its entropy, corrected for
        // the sample's size (Miller-Madow) and less a margin, plus the
        // least table over the sample's symbols if context coding is out,
        // must reach the raw threshold. Anything else takes the finer look
        // below.
        // (At least 1024 samples: the block has 16 Ki symbols or more.)
        let coarse = sampled_histogram(syms, COARSE_STEP);
        let m: u32 = coarse.iter().sum();
        let present = coarse.iter().filter(|&&c| c > 0).count();
        let corrected = entropy_bits(&coarse) + (present as f64 - 1.0) / (2.0 * LN_2);
        let est = (corrected / m as f64 - COARSE_MARGIN_BITS) / 8.0 * n as f64;
        let floor = match ctx {
            None => table_floor(hist_range(&coarse)),
            Some(_) => 0.0,
        };
        if est + floor >= keep_raw_above {
            return BlockMode::Raw;
        }
        let (lo, hi, diffs) = min_max(syms);
        if lo == hi {
            out.push(lo);
            return BlockMode::Const;
        }
        // Noise is stored raw on the sample's word alone. The sample's
        // entropy runs low by ~0.01 bit (small-sample bias), so it only
        // decides "raw" when even that estimate (plus the least a table
        // costs, if context coding is out) cannot pay.
        let mut sh = coarse;
        for (a, b) in sh.iter_mut().zip(sampled_rest(syms)) {
            *a += b;
        }
        let sampled: u32 = sh.iter().sum();
        let scale = n as f64 / sampled.max(1) as f64;
        let sample_bits = entropy_bits(&sh);
        let est = sample_bits / 8.0 * scale;
        if est >= keep_raw_above || (ctx.is_none() && est + table_floor((lo, hi)) >= keep_raw_above)
        {
            return BlockMode::Raw;
        }
        // A block that packs within `PACKED_SLACK` of the sample's entropy
        // (which no coding with a table comes under) is packed without
        // counting it whole: the shape follows from its least, greatest
        // and the bits in which its symbols differ.
        let shape = packed::Shape::of_bounds(lo, hi, diffs);
        if ctx.is_none() && opts.packed {
            if let Some(p) = shape {
                let bytes = p.payload_bytes(n) as f64;
                if bytes < keep_raw_above && bytes <= est * (1.0 + PACKED_SLACK) {
                    packed::encode(syms, p, out);
                    return BlockMode::Packed;
                }
            }
        }
        if let Some((model, classes)) = ctx {
            let p = context::ctx_plan(syms, model, classes);
            let h = p.hist;
            plan = Some(p);
            (h, 1.0, true, shape)
        } else if sample_bits > SAMPLE_MAX_BITS * sampled as f64 {
            // Near-flat: the sample's noise would move codes between
            // lengths; count the block (no repeated bins, so fast).
            (histogram(syms), 1.0, true, shape)
        } else {
            for c in &mut sh[lo as usize..=hi as usize] {
                *c = (*c).max(1);
            }
            (sh, scale, false, shape)
        }
    } else {
        let h = histogram(syms);
        if h.iter().filter(|&&c| c > 0).count() <= 1 {
            out.push(syms.first().copied().unwrap_or(0));
            return BlockMode::Const;
        }
        (h, 1.0, true, packed::Shape::of(&h))
    };
    let ideal = entropy_bits(&h) / 8.0 * scale;
    // Bit packing, where every symbol is the least plus a small field
    // shifted by a power of two (`packed::Shape`): its size is exact and
    // it has no table. Chosen unless a coding with a table saves
    // `PACKED_SLACK` over it, since it decodes several times faster.
    let packing = shape.filter(|_| opts.packed);
    let packed_bytes = packing.map_or(f64::MAX, |p| p.payload_bytes(n) as f64);
    if ideal >= keep_raw_above {
        return BlockMode::Raw;
    }
    // Without context coding, no coder with a table beats the entropy plus
    // that table, so the full comparison below is settled early when
    // packing pays and comes within `PACKED_SLACK` of the entropy, or when
    // no table can pay (packed if that pays, else raw).
    if ctx.is_none() {
        let floor = ideal + table_floor(hist_range(&h));
        let no_table = floor >= keep_raw_above;
        match packing {
            Some(p)
                if packed_bytes < keep_raw_above
                    && (no_table || packed_bytes <= ideal * (1.0 + PACKED_SLACK)) =>
            {
                packed::encode(syms, p, out);
                return BlockMode::Packed;
            }
            _ if no_table => return BlockMode::Raw,
            _ => {}
        }
    }
    let lens = huffman::code_lengths(&h, huffman::MAX_BITS);
    let huff = huffman_bytes(&h, &lens, scale);
    let mut best = (huff, BlockMode::Huffman);
    let mut freqs = None;
    // rANS tables cost 16 KiB of slots per class to build at decode time:
    // not worth it for small blocks. A block of `RANS_EQUAL_BITS` or more
    // a symbol takes rANS whenever it is the smaller, or (32 states)
    // unless Huffman is `WIDE_RANS_SLACK` smaller.
    let wide_bits = ideal * 8.0 >= RANS_EQUAL_BITS * n as f64;
    let plain_gain = if wide_bits {
        0.0
    } else {
        opts.plain_rans_min_gain as f64
    };
    if opts.rans && n >= RANS_MIN_SYMBOLS && huff - ideal > plain_gain * huff {
        let f = stats::normalize(&h);
        let t = rans::table_bytes(&f);
        let r = rans_bytes(&h, &f, t, n, scale);
        // Chosen over Huffman on the varint table's size, as before gamma
        // tables (on the gamma table's, noise-like delta blocks of fp32
        // weights left Huffman for rANS, 2% slower to decode, for 0.01%);
        // then the shorter table is written. A block of `RANS_EQUAL_BITS`
        // or more a symbol with 32 rANS states (8 Ki symbols, version 11)
        // decodes faster as rANS than as Huffman: it takes rANS unless
        // Huffman is `WIDE_RANS_SLACK` smaller.
        let slack = match wide_bits && n >= rans::WIDE_MIN_SYMBOLS_V11 {
            true => WIDE_RANS_SLACK,
            false => -plain_gain,
        };
        if r < huff * (1.0 + slack) {
            let chosen = match rans::table_bytes_gamma(&f) {
                g if opts.gamma_tables && g < t => (r - (t - g) as f64, BlockMode::RansGamma),
                _ => (r, BlockMode::Rans),
            };
            // The slack never makes raw a block Huffman codes under the
            // raw threshold.
            if chosen.0 < keep_raw_above || chosen.0 <= huff {
                best = chosen;
                freqs = Some(f);
            }
        }
    }
    // A block counted whole (shorter than `SAMPLE_MIN_SYMBOLS`) has its
    // plain codings' exact sizes by now: it is planned for context coding
    // (a count per class, the costliest estimate here) only where an
    // estimate from a quarter of its symbols, which runs low, says that
    // can win. The LoRA run's delta blocks of 12 Ki symbols lose to plain
    // coding mostly: its DELTA rows encode 1.03-1.05x as fast, 0.001% more
    // bytes; gpt-small and bert-ft frames unchanged. (Screening larger
    // blocks against their sample's plain estimate, counted before their
    // class counts, lost 0.01-0.07% on gpt-small and bert-ft.)
    let planned = ctx.filter(|&(model, classes)| {
        plan.is_some()
            || model.sampled_bytes(syms, classes, SAMPLE_STEP)
                < best.0 * (1.0 - opts.rans_min_gain as f64)
    });
    if let Some((model, classes)) = planned {
        let p = plan
            .take()
            .unwrap_or_else(|| context::ctx_plan(syms, model, classes));
        if p.bytes < best.0 * (1.0 - opts.rans_min_gain as f64) {
            best = (p.bytes, BlockMode::RansCtx);
            plan = Some(p);
        }
    }
    // The symbol a row up as context (mode 9, version 10), where a sample
    // finds the symbols repeating the one above more often than chance.
    let mut up_plan = None;
    if let Some(d) = up
        .filter(|&d| ctx.is_none() && opts.rans && n >= UP_MIN_SYMBOLS && d >= rans::WIDE && d < n)
    {
        if up_screen(syms, d, &h) {
            let EncodeScratch {
                up_ctx, up_classes, ..
            } = &mut *scratch;
            up_ctx.clear();
            up_ctx.resize(d, 0);
            up_ctx.extend_from_slice(&syms[..n - d]);
            let model = CtxModel::new(up_ctx);
            model.classes(up_ctx, up_classes);
            let p = context::ctx_plan(syms, &model, up_classes);
            let bytes = p.bytes + leb::len(d as u64) as f64;
            if bytes < best.0 * (1.0 - opts.rans_min_gain as f64) {
                best = (bytes, BlockMode::RansUp);
                up_plan = Some((d, model, p));
            }
        }
    }
    if packed_bytes <= best.0 * (1.0 + PACKED_SLACK) {
        best = (packed_bytes, BlockMode::Packed);
    }
    // Sparse (format version 7), where one symbol fills all but a few
    // places: chosen when no larger than the best (it decodes by the
    // places that are not that symbol, not symbol by symbol: faster than
    // any other coding of such a block; a slack of 5% bought nothing
    // more on either corpus), or than a rANS coding by the bytes its
    // decode time is worth (`sparse_allowance`).
    // The least size so far: what zstd must beat when sparse was taken
    // for its decode time, being larger.
    let smallest = best.0;
    if opts.sparse && n >= SPARSE_MIN_SYMBOLS {
        let (z, others) = sparse::dominant(&h);
        if others as f64 * scale * SPARSE_MAX_SHARE as f64 <= n as f64 {
            let max = 2 * n / SPARSE_MAX_SHARE;
            let limit = best.0 + sparse_allowance(best.1, n, others as f64 * scale);
            if let Some(b) = sparse::plan(syms, z, max, limit, &mut scratch.sparse) {
                if b as f64 <= limit {
                    best = (b as f64, BlockMode::Sparse);
                }
            }
        }
    }
    // zstd (format version 5), for the matches order-0 coding cannot see:
    // tried only where a quick probe finds repeated 8-byte strings, and
    // below `ZSTD_LOW_BITS` a symbol only where they are most of the block.
    let mut zbytes = false;
    if opts.zstd_level != 0
        && ctx.is_none()
        && n >= ZSTD_MIN_SYMBOLS
        && ideal <= ZSTD_MAX_BITS / 8.0 * n as f64
        && {
            let low = ideal < ZSTD_LOW_BITS / 8.0 * n as f64;
            let per = if low {
                ZSTD_LOW_MIN_REPEATS
            } else {
                ZSTD_MIN_REPEATS
            };
            repeats_reach(syms, &mut scratch.probe, per)
        }
    {
        if let Some(z) = zstd_compress(syms, opts.zstd_level, true, scratch) {
            if (z as f64) < best.0.min(smallest) * (1.0 - opts.zstd_min_gain as f64) {
                best = (z as f64, BlockMode::Zstd);
                zbytes = true;
            }
        }
    }
    if best.0 >= keep_raw_above {
        return BlockMode::Raw;
    }
    let start = out.len();
    match best.1 {
        BlockMode::Rans => rans::encode(syms, &freqs.expect("set with Rans"), out),
        BlockMode::RansGamma => rans::encode_gamma(syms, &freqs.expect("set with RansGamma"), out),
        BlockMode::RansCtx => {
            let (model, classes) = ctx.expect("set with RansCtx");
            context::ctx_encode(syms, model, classes, &plan.expect("set with RansCtx"), out)
        }
        BlockMode::RansUp => {
            let (d, model, plan) = up_plan.expect("set with RansUp");
            leb::write(d as u64, out);
            context::ctx_encode(syms, &model, &scratch.up_classes, &plan, out)
        }
        BlockMode::Packed => packed::encode(syms, packing.expect("set with Packed"), out),
        BlockMode::Zstd if zbytes => out.extend_from_slice(&scratch.zstd_out),
        BlockMode::Sparse => out.extend_from_slice(&scratch.sparse.payload),
        _ => huffman::encode(syms, &lens, out, &mut scratch.huffman),
    }
    // Sizes from a sample are estimates: a block that did not pay is raw.
    if !exact && (out.len() - start) as f64 >= keep_raw_above {
        out.truncate(start);
        return BlockMode::Raw;
    }
    best.1
}

/// Estimated bytes of a Huffman block of histogram `h` (scaled by `scale`
/// from a sample) with code lengths `lens`: its table, three sizes and
/// the coded bits.
fn huffman_bytes(h: &[u32; 256], lens: &[u8; 256], scale: f64) -> f64 {
    (huffman::table_bytes(lens) + 12 + 4) as f64 + huffman::coded_bits(h, lens) as f64 / 8.0 * scale
}

/// Estimated bytes of a plain rANS block of `n` symbols of histogram `h`
/// (scaled by `scale` from a sample) with frequencies `f` and a table of
/// `table` bytes: the table, the states and the coded bits.
fn rans_bytes(h: &[u32; 256], f: &[u32; 256], table: usize, n: usize, scale: f64) -> f64 {
    (table + 4 * rans::lanes_written(n) + 4) as f64 + stats::coded_bits(h, f) / 8.0 * scale
}

/// The fewest payload bytes [`encode`] can code `syms` to when neither
/// context coding, zstd nor sparse coding is open to it (a block shorter
/// than their minimums): every other mode codes symbol by symbol, so none
/// comes under the order-0 entropy, and those with a table not under it
/// plus their header's fixed part (Huffman: the range, half a byte a
/// symbol of it and three sizes; rANS: the range, a bit a symbol with a
/// gamma-coded table, and a state). Raw counts its symbols, which a raw block's payload leaves in
/// place.
pub fn floor_bytes(syms: &[u8]) -> f64 {
    floor_bytes_of(&histogram(syms), syms.len())
}

/// [`floor_bytes`] of `n` symbols of histogram `h`.
pub fn floor_bytes_of(h: &[u32; 256], n: usize) -> f64 {
    let (lo, hi) = hist_range(h);
    // One symbol, or none.
    if lo == hi || h[lo as usize] == 0 {
        return n.min(1) as f64;
    }
    let packed = packed::Shape::of_range(h, lo, hi).map_or(f64::MAX, |p| p.payload_bytes(n) as f64);
    let range = (hi - lo) as usize + 1;
    // After `lo hi`: Huffman's half a byte a symbol and three sizes;
    // rANS's byte a symbol, or a bit with a gamma-coded table (format
    // version 9), and a state (its states hold some of the symbols' bits).
    let header = 2 + (range.div_ceil(2) + 12).min(range.div_ceil(8) + 4);
    let coded = entropy_bits_of(h, n as u64) / 8.0 + header as f64;
    (n as f64).min(packed).min(coded)
}

/// A packed block may be this much larger than the best other coding of it
/// and still be chosen: it decodes several times faster.
const PACKED_SLACK: f64 = 0.01;

/// Sparse coding is tried on blocks of at least this many symbols where at
/// most one in `SPARSE_MAX_SHARE` is not the most common. (Its gaps see
/// runs, which order-0 coding cannot: like context coding and zstd, it is
/// kept out of blocks shorter than [`floor_bytes`] speaks for.)
const SPARSE_MIN_SYMBOLS: usize = ZSTD_MIN_SYMBOLS;
const SPARSE_MAX_SHARE: usize = 8;

/// The bytes a sparse coding of a block may add over its best coding
/// `best`, for the decode time it saves: where that is rANS, which decodes
/// symbol by symbol (a gather per symbol), against sparse's cost per
/// symbol that is not the dominant one and per block. One byte for every
/// [`SPARSE_NS_PER_BYTE`] saved. Measured on single 64 Ki blocks
/// (`examples/sparse_speed.rs`): a rANS block decodes in ~40 us whatever
/// its entropy, a sparse one in ~0.7 us plus ~3.5 ns for each other
/// symbol. The large run's DELTA fp32 weights (ulp deltas whose top
/// bytes change where the base is small: ~0.2 bits a symbol with the base
/// as context, a little more sparse) decode 1.2x as fast for 0.15% more
/// bytes; gpt-small's and bert-ft's rows grew by at most 0.0004
/// (docs/performance.md, "The large run in codec-bench").
fn sparse_allowance(best: BlockMode, n: usize, others: f64) -> f64 {
    use BlockMode::{Rans, RansCtx, RansGamma, RansUp};
    if !matches!(best, Rans | RansCtx | RansGamma | RansUp) {
        return 0.0;
    }
    let saved_ns =
        n as f64 * RANS_NS_PER_SYMBOL - others * SPARSE_NS_PER_OTHER - SPARSE_NS_PER_BLOCK;
    (saved_ns / SPARSE_NS_PER_BYTE).max(0.0)
}

/// Decode time of a rANS block per symbol, and of a sparse block per
/// symbol that is not its dominant one and per block (see
/// [`sparse_allowance`]).
const RANS_NS_PER_SYMBOL: f64 = 0.6;
const SPARSE_NS_PER_OTHER: f64 = 3.5;
const SPARSE_NS_PER_BLOCK: f64 = 700.0;
/// Decode time saved for which a block may be one byte larger.
const SPARSE_NS_PER_BYTE: f64 = 40.0;

/// Encoder state kept between blocks (one per thread).
#[derive(Default)]
pub struct EncodeScratch {
    /// The Huffman encoder's pair tables and lane regions.
    pub huffman: huffman::EncodeScratch,
    /// The repeat probe's hash table (the strings seen).
    probe: Vec<u64>,
    /// A zstd compression context, its level and whether it codes
    /// literals (see [`zstd_compress`]), and its last output.
    zstd: Option<(i32, bool, zstd::bulk::Compressor<'static>)>,
    pub(super) zstd_out: Vec<u8>,
    /// The sparse coder's lists and its last payload.
    sparse: sparse::EncodeScratch,
    /// A row-context block's context (the block shifted a distance on)
    /// and the class of each symbol's.
    up_ctx: Vec<u8>,
    up_classes: Vec<u8>,
}

/// Row context is tried on blocks of at least this many symbols, as in
/// version 10: they have 32 rANS states in every version with mode 9, so
/// a distance of 32 or more is decodable.
const UP_MIN_SYMBOLS: usize = 16 * 1024;

/// Row context is tried when a 1-in-16 sample finds a symbol equal to the
/// one a distance back at least this many times as often as two symbols
/// drawn from the block's histogram are equal.
const UP_MIN_LIFT: f64 = 1.25;

/// Whether symbols of `syms` repeat the one `d` back more often than
/// chance (`h`, the block's histogram or a sample's, says how often
/// chance is): a look at every 16th symbol.
fn up_screen(syms: &[u8], d: usize, h: &[u32; 256]) -> bool {
    let (mut seen, mut equal) = (0usize, 0usize);
    let mut i = d;
    while i < syms.len() {
        equal += usize::from(syms[i] == syms[i - d]);
        seen += 1;
        i += 16;
    }
    let total: f64 = h.iter().map(|&c| c as f64).sum();
    let chance: f64 = h.iter().map(|&c| (c as f64 / total).powi(2)).sum();
    seen > 0 && equal as f64 >= UP_MIN_LIFT * chance * seen as f64
}

/// The zstd frame of `syms` at `level` in `scratch.zstd_out`; its length,
/// or None if zstd failed (then the block takes another mode). Without
/// `literals`, the bytes zstd finds no match for are stored as they are,
/// not Huffman-coded: the same frame for any zstd decoder, sooner where
/// coding them could not pay (see `literals_pay` in the codec).
pub(super) fn zstd_compress(
    syms: &[u8],
    level: i32,
    literals: bool,
    scratch: &mut EncodeScratch,
) -> Option<usize> {
    use zstd::zstd_safe::{CParameter, ParamSwitch};
    if let Some((l, lit, c)) = scratch
        .zstd
        .as_mut()
        .filter(|(l, lit, _)| (*l, *lit) != (level, literals))
    {
        let mode = if literals {
            ParamSwitch::Auto
        } else {
            ParamSwitch::Disable
        };
        if c.set_compression_level(level).is_ok()
            && c.set_parameter(CParameter::LiteralCompressionMode(mode))
                .is_ok()
        {
            (*l, *lit) = (level, literals);
        } else {
            // Settings half changed: a fresh context below, never one
            // whose key says otherwise.
            scratch.zstd = None;
        }
    }
    if scratch.zstd.is_none() {
        let mut c = zstd::bulk::Compressor::new(level).ok()?;
        // The decoder knows the block's length: no checksum, no size.
        c.include_checksum(false).ok()?;
        c.include_contentsize(false).ok()?;
        c.include_dictid(false).ok()?;
        if !literals {
            c.set_parameter(CParameter::LiteralCompressionMode(ParamSwitch::Disable))
                .ok()?;
        }
        scratch.zstd = Some((level, literals, c));
    }
    let (_, _, c) = scratch.zstd.as_mut()?;
    scratch.zstd_out.clear();
    scratch
        .zstd_out
        .reserve(zstd::zstd_safe::compress_bound(syms.len()));
    c.compress_to_buffer(syms, &mut scratch.zstd_out).ok()
}

/// Whether at least one in `per` of a block's bytes lie in 8-byte strings
/// (at 8-aligned positions) that occurred before at an 8-aligned position
/// the probe's hash table (4096 entries) still holds: a cheap lower bound
/// on what an LZ coder's matches could find. Every 8-aligned string goes
/// into the table, but only every other one is looked up (half the loads
/// and compares of a probe that was a tenth of a FULL encode's time),
/// each hit counting for both. A run of one byte does not count: it is
/// no news to the entropy coders. The probe stops as soon as its answer
/// is settled: at a quarter repeated, most blocks of a checkpoint (a few
/// percent repeated) are settled three quarters of the way through.
fn repeats_reach(syms: &[u8], table: &mut Vec<u64>, per: usize) -> bool {
    const PAIR: usize = 2 * PROBE_STEP;
    // Counted as `hits * PAIR` bytes: `hits * PAIR * per >= n`.
    let need = syms.len().div_ceil(PAIR * per);
    let mut left = syms.len() / PAIR;
    if need > left {
        return false;
    }
    // The table holds the strings themselves; a slot never written holds
    // 0, a run, which never counts.
    table.clear();
    table.resize(1 << PROBE_LOG2, 0);
    let slot = |v: u64| (v.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - PROBE_LOG2)) as usize;
    let string = |c: &[u8]| u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
    let mut hits = 0;
    for run in syms.chunks(64 * PAIR) {
        if hits >= need || hits + left < need {
            break;
        }
        for pair in run.chunks_exact(PAIR) {
            let (a, v) = (string(pair), string(&pair[PROBE_STEP..]));
            table[slot(a)] = a;
            let h = slot(v);
            hits += usize::from(table[h] == v && v != (v & 0xff) * 0x0101_0101_0101_0101);
            table[h] = v;
        }
        left -= run.len() / PAIR;
    }
    hits >= need
}

const PROBE_LOG2: u32 = 12;
/// The probe keeps the 8 bytes at every `PROBE_STEP`-th position, so it
/// sees matches whose distance is a multiple of 8 (a tensor's rows).
const PROBE_STEP: usize = 8;
/// zstd is tried on a block when the probe finds at least one repeated
/// symbol in `ZSTD_MIN_REPEATS`.
const ZSTD_MIN_REPEATS: usize = 4;
/// Below this many bits a symbol of order-0 entropy, zstd -1 matches of
/// the probe's kind buy nothing over the block coders: it came out at
/// about the entropy (2.4-2.6 bits a symbol, 0.99-1.32x the best coding,
/// never the 0.9x it must reach) on every such block of both corpora where
/// the probe found a quarter to two fifths repeated; every block zstd won
/// had 2.7 bits a symbol or more. Such a block is tried only when the probe finds
/// most of it repeated (`ZSTD_LOW_MIN_REPEATS`): long matches, such as
/// rows copied whole, pay at any entropy.
const ZSTD_LOW_BITS: f64 = 2.5;
/// Below [`ZSTD_LOW_BITS`], zstd is tried when the probe finds at least
/// one repeated symbol in `ZSTD_LOW_MIN_REPEATS`.
const ZSTD_LOW_MIN_REPEATS: usize = 2;
/// Smallest block zstd is tried on.
pub(super) const ZSTD_MIN_SYMBOLS: usize = 4096;

/// zstd is tried only on blocks whose order-0 entropy is at most this many
/// bits a symbol (exponent streams): matches in noise are rare.
const ZSTD_MAX_BITS: f64 = 6.0;

/// Least and greatest symbol a histogram counts ((0, 0) if none).
fn hist_range(h: &[u32; 256]) -> (u8, u8) {
    let lo = h.iter().position(|&c| c > 0).unwrap_or(0);
    let hi = 255 - h.iter().rev().position(|&c| c > 0).unwrap_or(0);
    (lo as u8, hi as u8)
}

/// The fewest bytes a Huffman or rANS table over the symbols `lo..=hi`
/// takes: Huffman's lengths take half a byte per symbol of the range and 16
/// bytes of sizes, rANS at least a byte per symbol and 36 of states, or a
/// bit per symbol with a gamma-coded table.
fn table_floor((lo, hi): (u8, u8)) -> f64 {
    let range = (hi - lo) as usize + 1;
    (2 + range.div_ceil(2) + 16).min(2 + range.div_ceil(8) + 36) as f64
}

/// Blocks at least this long are measured on a sample of their symbols.
const SAMPLE_MIN_SYMBOLS: usize = 16 * 1024;
/// The sample is every `SAMPLE_STEP`-th symbol (the screen's counts plus
/// [`sampled_rest`]'s).
pub(super) const SAMPLE_STEP: usize = 4;
const _: () = assert!(
    COARSE_STEP == 4 * SAMPLE_STEP,
    "sampled_rest fills in 3 of 4"
);
/// Blocks whose sample takes more bits per symbol than this are counted
/// whole after all.
const SAMPLE_MAX_BITS: f64 = 6.0;

/// From this many bits a symbol up (the block's entropy), plain rANS need
/// not save `Options::plain_rans_min_gain` over Huffman to be chosen: its
/// 32-state decoder is then as fast as Huffman's lookups or faster (they
/// take one or two symbols each there, not up to four). It pays on 1-byte
/// quantised weights. codec-bench, one core, FULL (ratio; compress /
/// decompress MiB/s), before -> after, zstd -3 beside, on runs made by
/// `scripts/quantize_run.py`:
///
/// | run | before | after | zstd -3 |
/// |---|---|---|---|
/// | bert-ft, fp8 e4m3 | 0.7868; 768 / 1219 | 0.7773; 559 / 1256 | 0.7765; 828 / 1239 |
/// | bert-ft, int8 per row | 0.9637; 503 / 1074 | 0.9630; 445 / 1203 | 0.9716 |
/// | GPT-2-shaped fp32 run, fp8 | 0.8212; 732 / 1153 | 0.8147; 528 / 1346 | 0.8165 |
/// | the same, int8 | 0.9339; 591 / 1069 | 0.9328; 529 / 1150 | 0.9324 |
///
/// gpt-small's and bert-ft's own rows keep their frames within 0.0001.
const RANS_EQUAL_BITS: f64 = 5.0;

/// How much larger (estimated, on the varint table) than Huffman a block
/// of `RANS_EQUAL_BITS` or more a symbol and 32 rANS states may be and
/// still take rANS: decode, paired `examples/codec_speed` runs (4 pairs,
/// CPU time), DELTA fp32 of the LoRA run's optimizer 1.033x, weights
/// 1.016x, gpt-small 1.059x, bert-ft 1.013x; frames as small or smaller
/// but the LoRA weights' (+0.003%), since the written (gamma) table is
/// often shorter than the estimate's. 2% gained more on the LoRA
/// optimizer (1.07x) for 0.09% more bytes. A block Huffman codes under
/// the raw threshold keeps Huffman when rANS would be over it.
const WIDE_RANS_SLACK: f64 = 0.01;

/// The first, coarse sample (for noise) is every `COARSE_STEP`-th symbol
/// ...
pub(super) const COARSE_STEP: usize = 16;
/// ... and calls a block raw only if its corrected entropy per symbol
/// exceeds the raw threshold by this much.
const COARSE_MARGIN_BITS: f64 = 0.01;

/// Least and greatest symbol of a block, and the bits in which any symbol
/// differs from the first (the OR of their XORs with it: its trailing
/// zeros are the largest power of two dividing every distance between
/// symbols). Vectorised by the compiler, with 32-byte registers where the
/// CPU has AVX2.
#[inline(always)]
fn min_max_body(s: &[u8]) -> (u8, u8, u8) {
    let Some(&first) = s.first() else {
        return (0, 0, 0);
    };
    let mut lo = [u8::MAX; 32];
    let mut hi = [0u8; 32];
    let mut diff = [0u8; 32];
    let mut it = s.chunks_exact(32);
    for c in &mut it {
        for i in 0..32 {
            lo[i] = lo[i].min(c[i]);
            hi[i] = hi[i].max(c[i]);
            diff[i] |= c[i] ^ first;
        }
    }
    let rest = it.remainder();
    let lo = rest.iter().chain(&lo).copied().fold(u8::MAX, u8::min);
    let hi = rest.iter().chain(&hi).copied().fold(0, u8::max);
    let diff = rest
        .iter()
        .map(|&b| b ^ first)
        .chain(diff)
        .fold(0, |a, b| a | b);
    (lo, hi, diff)
}

dispatch!(min_max, min_max_body, (s: &[u8]) -> (u8, u8, u8));

/// Decoding tables kept between blocks (allocated once per thread).
#[derive(Default)]
pub struct Tables {
    pub huffman: huffman::DecodeTable,
    pub rans: Vec<u32>,
    /// A zstd decompression context (format version 5).
    pub zstd: Option<zstd::bulk::Decompressor<'static>>,
    /// The streams of a frame stored as one zstd frame (version 6).
    pub whole: Vec<u8>,
    /// A sparse block's decoded gap buckets and symbols (version 7).
    pub sparse: Vec<u8>,
}

/// Decode one block whose payload is `frame[start..start+len]` into `out`;
/// `ctx` is the base's same block in a delta frame; `version` is the
/// frame's format version.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    version: u8,
    mode: BlockMode,
    frame: &[u8],
    start: usize,
    len: usize,
    ctx: Option<&[u8]>,
    out: &mut [u8],
    tables: &mut Tables,
) -> Result<(), DecodeError> {
    let payload = &frame[start..start + len];
    let corrupt = |reason| DecodeError::Corrupt {
        offset: start as u64,
        reason,
    };
    match mode {
        BlockMode::Raw => {
            if len != out.len() {
                return Err(corrupt("raw block length differs from its symbol count"));
            }
            out.copy_from_slice(payload);
        }
        BlockMode::Const => {
            if len != 1 {
                return Err(corrupt("constant block is not one byte"));
            }
            out.fill(payload[0]);
        }
        BlockMode::Huffman => huffman::decode(frame, start, len, out, &mut tables.huffman)?,
        BlockMode::Rans => rans::decode(payload, start as u64, out, &mut tables.rans, version)?,
        BlockMode::RansCtx => {
            let ctx = ctx.ok_or(corrupt("context-coded block outside a delta stream"))?;
            context::ctx_decode(payload, start as u64, ctx, out, &mut tables.rans, version)?
        }
        BlockMode::Packed if version < 3 => {
            return Err(corrupt("packed block in a frame before format version 3"))
        }
        BlockMode::Packed => packed::decode(payload, start as u64, out)?,
        BlockMode::Zstd if version < 5 => {
            return Err(corrupt("zstd block in a frame before format version 5"))
        }
        BlockMode::Sparse if version < 7 => {
            return Err(corrupt("sparse block in a frame before format version 7"))
        }
        BlockMode::RansUp if version < 10 => {
            return Err(corrupt(
                "row-context rans block in a frame before format version 10",
            ))
        }
        BlockMode::RansUp => {
            context::up_decode(payload, start as u64, out, &mut tables.rans, version)?
        }
        BlockMode::RansGamma if version < 9 => {
            return Err(corrupt(
                "gamma-table rans block in a frame before format version 9",
            ))
        }
        BlockMode::RansGamma => rans::decode_with(
            rans::read_freqs_gamma,
            payload,
            start as u64,
            out,
            &mut tables.rans,
            version,
        )?,
        BlockMode::Sparse => {
            let Tables {
                huffman, sparse, ..
            } = tables;
            sparse::decode(frame, start, len, out, huffman, sparse)?
        }
        BlockMode::Zstd => {
            let bad = || corrupt("zstd block does not decode to its symbol count");
            if tables.zstd.is_none() {
                tables.zstd = Some(zstd::bulk::Decompressor::new().map_err(|_| bad())?);
            }
            // Exactly one zstd frame, spanning the payload (zstd would
            // decode frames after it too).
            if zstd::zstd_safe::find_frame_compressed_size(payload) != Ok(len) {
                return Err(bad());
            }
            let d = tables.zstd.as_mut().ok_or_else(bad)?;
            match d.decompress_to_buffer(payload, out) {
                Ok(m) if m == out.len() => {}
                _ => return Err(bad()),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Distinct 8-byte strings (no runs), from a seed.
    fn strings(count: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::testing::Rng(seed | 1);
        (0..count)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    }

    /// The probe's count whole: every other 8-aligned string looked up,
    /// each hit counting for both (in bytes).
    fn repeats(syms: &[u8], table: &mut Vec<u64>) -> usize {
        table.clear();
        table.resize(1 << PROBE_LOG2, 0);
        let slot = |v: u64| (v.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - PROBE_LOG2)) as usize;
        let string = |c: &[u8]| u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
        let mut hits = 0;
        for pair in syms.chunks_exact(2 * PROBE_STEP) {
            let (a, v) = (string(pair), string(&pair[PROBE_STEP..]));
            table[slot(a)] = a;
            let h = slot(v);
            hits += usize::from(table[h] == v && v != (v & 0xff) * 0x0101_0101_0101_0101);
            table[h] = v;
        }
        hits * 2 * PROBE_STEP
    }

    proptest! {
        /// Stopping once settled gives the whole count's answer.
        #[test]
        fn the_repeat_probe_stops_with_the_whole_counts_answer(
            len in 0usize..70_000,
            period in 1usize..40,
            fresh_per_1024 in 0u64..1024,
            per in 1usize..6,
            seed in any::<u64>(),
        ) {
            // A cycle of `period` strings, some replaced by fresh ones.
            let unit = strings(period, seed);
            let noise = strings(len / 8 + 1, seed ^ 0x55);
            let mut rng = crate::testing::Rng(seed | 1);
            let block: Vec<u8> = (0..len / 8 + 1)
                .flat_map(|i| {
                    let fresh = rng.next_u64() % 1024 < fresh_per_1024;
                    let j = if fresh { i } else { i % period };
                    let src = if fresh { &noise } else { &unit };
                    src[j * 8..j * 8 + 8].to_vec()
                })
                .take(len)
                .collect();
            let mut table = Vec::new();
            let whole = repeats(&block, &mut table) * per >= block.len();
            prop_assert_eq!(repeats_reach(&block, &mut table, per), whole);
        }
    }

    /// Hits placed last, exactly as many as the answer needs or one fewer:
    /// stopping early never decides before the last one counts.
    #[test]
    fn the_repeat_probe_decides_at_its_threshold_exactly() {
        let mut table = Vec::new();
        for pairs in [1usize, 63, 64, 65, 300, 4096] {
            for per in 1..=5 {
                let n = pairs * 2 * PROBE_STEP;
                let need = n.div_ceil(2 * PROBE_STEP * per);
                for hits in [need.saturating_sub(1), need] {
                    // Pair i: a fresh string, then (for the last `hits`
                    // pairs) the same string again, else another fresh one.
                    let fresh = strings(2 * pairs, (pairs * 10 + per) as u64);
                    let block: Vec<u8> = (0..pairs)
                        .flat_map(|i| {
                            let a = &fresh[16 * i..16 * i + 8];
                            let b = if i >= pairs - hits {
                                a
                            } else {
                                &fresh[16 * i + 8..16 * i + 16]
                            };
                            [a, b].concat()
                        })
                        .collect();
                    assert_eq!(repeats(&block, &mut table), hits * 2 * PROBE_STEP);
                    assert_eq!(
                        repeats_reach(&block, &mut table, per),
                        hits >= need,
                        "pairs {pairs} per {per} hits {hits}"
                    );
                }
            }
        }
    }

    /// Zeros with `others` places set to 1-3, at random.
    fn zeros_with(others: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::testing::Rng(seed | 1);
        let mut syms = vec![0u8; 1 << 16];
        for _ in 0..others {
            let at = (rng.next_u64() % (1 << 16)) as usize;
            syms[at] = 1 + (rng.next_u64() % 3) as u8;
        }
        syms
    }

    #[test]
    fn sparse_is_chosen_over_a_smaller_rans_coding_for_the_decode_time_it_saves() {
        let (opts, mut scratch) = (Options::default(), EncodeScratch::default());
        // 7000 of 65536 symbols not 0: sparse codes them in a little more
        // than rANS does (and than the encoder's estimate of rANS from its
        // sample, which with 4000 put rANS above sparse: chosen without
        // the allowance), and decodes them in ~25 us against ~40 us.
        let syms = zeros_with(7000, 5);
        let rans = {
            let mut out = Vec::new();
            rans::encode(&syms, &stats::normalize(&histogram(&syms)), &mut out);
            out.len()
        };
        let mut sc = sparse::EncodeScratch::default();
        let sparse = sparse::plan(&syms, 0, syms.len(), f64::MAX, &mut sc).expect("planned");
        assert!(sparse > rans, "sparse {sparse} rANS {rans}");
        assert!(((sparse - rans) as f64) < sparse_allowance(BlockMode::Rans, syms.len(), 7000.0));
        let mut out = Vec::new();
        assert_eq!(
            encode(&syms, None, None, &opts, &mut out, &mut scratch),
            BlockMode::Sparse
        );
        // No allowance against codings that decode fast themselves, nor
        // where the exceptions cost as much time as rANS would.
        assert_eq!(sparse_allowance(BlockMode::Huffman, 1 << 16, 100.0), 0.0);
        assert_eq!(sparse_allowance(BlockMode::Packed, 1 << 16, 100.0), 0.0);
        assert_eq!(sparse_allowance(BlockMode::RansCtx, 1 << 16, 12_000.0), 0.0);
        assert!(sparse_allowance(BlockMode::RansCtx, 1 << 16, 2000.0) > 500.0);
    }

    #[test]
    fn the_repeat_probe_sees_repeats_at_every_multiple_of_8_bytes() {
        let mut table = Vec::new();
        // Fresh strings: nothing repeats.
        let fresh = strings(4096, 7);
        assert_eq!(repeats(&fresh, &mut table), 0);
        // A period of 3 strings (24 bytes, an odd multiple of 8) and of 2:
        // every string after the first period repeats.
        for period in [2, 3, 5] {
            let unit = strings(period, 11);
            let block: Vec<u8> = unit.iter().copied().cycle().take(32 * 1024).collect();
            let r = repeats(&block, &mut table);
            assert!(r >= 32 * 1024 - 16 * period, "period {period}: {r}");
        }
        // Each fresh string said twice (a distance of 8 bytes only): the
        // second of each pair repeats, and those are the strings looked
        // up, each counted for two (an estimate: here twice the truth).
        let pairs: Vec<u8> = fresh.chunks(8).flat_map(|c| [c, c].concat()).collect();
        assert_eq!(repeats(&pairs, &mut table), pairs.len());
        // Runs of one byte never count, repeated or not.
        assert_eq!(repeats(&[9u8; 32 * 1024], &mut table), 0);
    }

    /// Near-noise blocks (k symbols drawn evenly, the first k for which
    /// Huffman's estimate is the smaller, by less than the slack): one of
    /// 12 Ki symbols (32 rANS states) takes rANS, one of 4 Ki (8 states)
    /// Huffman. Both decode.
    #[test]
    fn a_near_noise_block_with_32_rans_states_takes_rans_within_the_slack() {
        let (opts, mut scratch) = (Options::default(), EncodeScratch::default());
        let mut rng = crate::testing::Rng(9);
        for (n, rans_family) in [(12 * 1024, true), (4 * 1024, false)] {
            let syms = (40..250u64)
                .map(|k| {
                    (0..n)
                        .map(|_| (rng.next_u64() % k) as u8)
                        .collect::<Vec<u8>>()
                })
                .find(|syms| {
                    let (huff, r) = huffman_and_rans_bytes(syms);
                    huff < r && r < huff * (1.0 + WIDE_RANS_SLACK)
                })
                .expect("an alphabet where Huffman is smaller within the slack");
            let mut out = Vec::new();
            let mode = encode(&syms, None, None, &opts, &mut out, &mut scratch);
            let want = match rans_family {
                true => [BlockMode::Rans, BlockMode::RansGamma].contains(&mode),
                false => mode == BlockMode::Huffman,
            };
            assert!(want, "{n} symbols: {mode:?}");
            let mut back = vec![0u8; n];
            decode(
                crate::codec::FORMAT_VERSION,
                mode,
                &out,
                0,
                out.len(),
                None,
                &mut back,
                &mut Tables::default(),
            )
            .unwrap();
            assert_eq!(back, syms);
        }
    }

    /// Huffman's and rANS's estimated sizes of `syms` (rANS with mode 3's
    /// varint table), as `encode` weighs them.
    fn huffman_and_rans_bytes(syms: &[u8]) -> (f64, f64) {
        let h = histogram(syms);
        let lens = huffman::code_lengths(&h, huffman::MAX_BITS);
        let f = stats::normalize(&h);
        let t = rans::table_bytes(&f);
        (
            huffman_bytes(&h, &lens, 1.0),
            rans_bytes(&h, &f, t, syms.len(), 1.0),
        )
    }

    /// A near-noise block that Huffman codes just under the raw threshold,
    /// where rANS (within the slack of Huffman) would not: it is coded
    /// Huffman, not stored raw (found by a review: the slack made such a
    /// block raw; here with mode 3's table only, and with the defaults
    /// in one block of gpt-small's FULL `wte.weight`, 108,920 bytes
    /// instead of 108,724).
    #[test]
    fn the_rans_slack_never_makes_raw_a_block_huffman_codes() {
        let opts = Options {
            gamma_tables: false,
            ..Options::default()
        };
        let mut scratch = EncodeScratch::default();
        let mut rng = crate::testing::Rng(3);
        let mut tried = 0;
        for k in 200..256u64 {
            for _ in 0..4 {
                let n = 16_000;
                let syms: Vec<u8> = (0..n).map(|_| (rng.next_u64() % k) as u8).collect();
                let (huff, r) = huffman_and_rans_bytes(&syms);
                let keep_raw_above = n as f64 * (1.0 - opts.min_gain as f64);
                if !(huff < keep_raw_above
                    && keep_raw_above <= r
                    && r < huff * (1.0 + WIDE_RANS_SLACK))
                {
                    continue;
                }
                tried += 1;
                let mut out = Vec::new();
                let mode = encode(&syms, None, None, &opts, &mut out, &mut scratch);
                assert_eq!(mode, BlockMode::Huffman, "k {k}: {huff} {r}");
            }
        }
        assert!(tried > 0, "no block between the thresholds");
    }

    /// Blocks under `RANS_EQUAL_BITS` a symbol get no slack, even when
    /// rANS needs no gain over Huffman (`plain_rans_min_gain: 0`): the
    /// smaller Huffman is kept (found by a review: the slack was keyed on
    /// the gain, not on the block's entropy).
    #[test]
    fn blocks_under_5_bits_a_symbol_get_no_rans_slack() {
        let opts = Options {
            plain_rans_min_gain: 0.0,
            gamma_tables: false,
            packed: false,
            sparse: false,
            zstd_level: 0,
            ..Options::default()
        };
        let mut scratch = EncodeScratch::default();
        let mut rng = crate::testing::Rng(1);
        let mut tried = 0;
        for k in 3..30u64 {
            for n in [8192, 12288] {
                // Skewed: the lesser of two draws.
                let syms: Vec<u8> = (0..n)
                    .map(|_| (rng.next_u64() % k).min(rng.next_u64() % k) as u8)
                    .collect();
                let (huff, r) = huffman_and_rans_bytes(&syms);
                if entropy_bits(&histogram(&syms)) >= RANS_EQUAL_BITS * n as f64 || huff >= r {
                    continue;
                }
                tried += 1;
                let mut out = Vec::new();
                let mode = encode(&syms, None, None, &opts, &mut out, &mut scratch);
                assert_eq!(mode, BlockMode::Huffman, "k {k}, {n} symbols: {huff} {r}");
            }
        }
        assert!(tried > 0, "no block where Huffman is the smaller");
    }

    /// A block counted whole (12 Ki symbols, under `SAMPLE_MIN_SYMBOLS`)
    /// whose symbols follow their context is still context-coded past the
    /// sampled screen; one whose context says nothing is coded plainly.
    /// Both decode.
    #[test]
    fn a_short_block_screened_for_context_coding_keeps_it_where_it_pays() {
        let n = 12 * 1024;
        assert!((RANS_CTX_MIN_SYMBOLS..SAMPLE_MIN_SYMBOLS).contains(&n));
        let mut rng = crate::testing::Rng(5);
        let ctx: Vec<u8> = (0..n).map(|_| 120 + (rng.next_u64() % 6) as u8).collect();
        let following: Vec<u8> = ctx
            .iter()
            .map(|&c| c.wrapping_mul(3).wrapping_add((rng.next_u64() % 4) as u8))
            .collect();
        let unrelated: Vec<u8> = (0..n).map(|_| (rng.next_u64() % 24) as u8).collect();
        let model = CtxModel::new(&ctx);
        let mut classes = Vec::new();
        model.classes(&ctx, &mut classes);
        let (opts, mut scratch) = (Options::default(), EncodeScratch::default());
        for (syms, want_ctx) in [(&following, true), (&unrelated, false)] {
            let mut out = Vec::new();
            let mode = encode(
                syms,
                Some((&model, &classes)),
                None,
                &opts,
                &mut out,
                &mut scratch,
            );
            assert_eq!(mode == BlockMode::RansCtx, want_ctx, "{mode:?}");
            let mut back = vec![0u8; n];
            let mut tables = Tables::default();
            let frame = out.clone();
            decode(
                crate::codec::FORMAT_VERSION,
                mode,
                &frame,
                0,
                frame.len(),
                Some(&ctx),
                &mut back,
                &mut tables,
            )
            .unwrap();
            assert_eq!(&back, syms);
        }
    }

    proptest! {
        #[test]
        fn min_max_matches_the_naive_fold(s in proptest::collection::vec(any::<u8>(), 0..200), lo in any::<u8>()) {
            // Also narrow blocks (every symbol in `lo .. lo + 8`), where the
            // differing bits are few.
            let narrow: Vec<u8> = s.iter().map(|&b| lo.saturating_add(b % 8)).collect();
            for s in [&s, &narrow] {
                let first = s.first().copied().unwrap_or(0);
                let naive = (
                    s.iter().copied().min().unwrap_or(0),
                    s.iter().copied().max().unwrap_or(0),
                    s.iter().fold(0, |a, &b| a | (b ^ first)),
                );
                prop_assert_eq!(min_max(s), naive);
            }
        }

        /// `floor_bytes` is a floor: no block shorter than zstd's and
        /// context coding's least comes out smaller, whatever mode it
        /// takes (noise, skewed, narrow, constant and tiny blocks).
        #[test]
        fn no_short_block_codes_below_its_floor(
            s in proptest::collection::vec(any::<u8>(), 1..3000),
            skew in 0u32..8,
            lo in any::<u8>(),
        ) {
            let shaped: Vec<u8> = s.iter().map(|&b| lo.wrapping_add(b >> skew)).collect();
            let sparse: Vec<u8> = s.iter().map(|&b| if b < 250 { lo } else { b }).collect();
            let (opts, mut scratch) = (Options::default(), EncodeScratch::default());
            for s in [&s, &shaped, &sparse] {
                let mut out = Vec::new();
                let bytes = match encode(s, None, None, &opts, &mut out, &mut scratch) {
                    BlockMode::Raw => s.len(),
                    _ => out.len(),
                };
                prop_assert!(bytes as f64 >= floor_bytes(s), "{} < {}", bytes, floor_bytes(s));
            }
        }
    }
}
