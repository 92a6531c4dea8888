//! Per-block entropy coding: each 64 KiB block of a stream is stored as the
//! smallest of raw, constant run, Huffman and rANS.

use super::{huffman, rans, DecodeError, Options};

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
}

impl BlockMode {
    pub fn from_code(c: u8) -> Option<BlockMode> {
        match c {
            0 => Some(BlockMode::Raw),
            1 => Some(BlockMode::Const),
            2 => Some(BlockMode::Huffman),
            3 => Some(BlockMode::Rans),
            4 => Some(BlockMode::RansCtx),
            _ => None,
        }
    }
}

/// Byte histogram. Eight interleaved tables break the store-to-load chains
/// that a run of one symbol (an exponent stream) would otherwise serialise;
/// a short input (the delta search's samples) takes one table, since
/// clearing and summing eight would cost more than counting.
pub fn histogram(s: &[u8]) -> [u32; 256] {
    if s.len() < SHORT_HISTOGRAM {
        let mut h = [0u32; 256];
        for &b in s {
            h[b as usize] += 1;
        }
        return h;
    }
    let mut h = [[0u32; 256]; 8];
    let mut it = s.chunks_exact(8);
    for c in &mut it {
        let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        for (k, t) in h.iter_mut().enumerate() {
            t[(v >> (8 * k)) as u8 as usize] += 1;
        }
    }
    for &b in it.remainder() {
        h[0][b as usize] += 1;
    }
    let mut out = [0u32; 256];
    for (i, o) in out.iter_mut().enumerate() {
        *o = h.iter().map(|t| t[i]).sum();
    }
    out
}

/// Inputs shorter than this get a one-table histogram.
const SHORT_HISTOGRAM: usize = 4096;

/// Histogram of every `step`-th byte: enough to see that a block of
/// noise (low mantissa bytes) is not worth entropy coding.
fn sampled_histogram(s: &[u8], step: usize) -> [u32; 256] {
    let mut h = [[0u32; 256]; 4];
    let mut it = s.chunks_exact(4 * step);
    for c in &mut it {
        for (k, t) in h.iter_mut().enumerate() {
            t[c[k * step] as usize] += 1;
        }
    }
    let mut out = [0u32; 256];
    for (i, o) in out.iter_mut().enumerate() {
        *o = h.iter().map(|t| t[i]).sum();
    }
    out
}

/// Order-0 entropy of a histogram, in bits (the whole block, not per symbol).
pub fn entropy_bits(h: &[u32; 256]) -> f64 {
    let n: u64 = h.iter().map(|&c| c as u64).sum();
    if n == 0 {
        return 0.0;
    }
    let ln = (n as f64).log2();
    let log2 = Log2::get();
    h.iter()
        .filter(|&&c| c > 0)
        .map(|&c| c as f64 * (ln - log2.of(c)))
        .sum()
}

/// `log2` of small integers from a table: the entropy estimates take one
/// per histogram bin, and `f64::log2` costs tens of instructions. The
/// table holds the very values `f64::log2` returns, so the estimates (and
/// the encoder's choices) do not change.
pub(super) struct Log2(&'static [f64]);

impl Log2 {
    const SIZE: usize = 4096;

    pub(super) fn get() -> Log2 {
        static TABLE: std::sync::OnceLock<Vec<f64>> = std::sync::OnceLock::new();
        Log2(TABLE.get_or_init(|| (0..Self::SIZE).map(|c| (c as f64).log2()).collect()))
    }

    #[inline(always)]
    pub(super) fn of(&self, c: u32) -> f64 {
        match self.0.get(c as usize) {
            Some(&v) => v,
            None => (c as f64).log2(),
        }
    }
}

/// Smallest block worth a rANS table.
const RANS_MIN_SYMBOLS: usize = 1024;
/// Smallest block worth context-modelled rANS (up to eight tables).
const RANS_CTX_MIN_SYMBOLS: usize = 4096;

/// Encode one block, appending its payload to `out`; returns its mode.
/// `ctx`, when given, is the context model of the base's same block and
/// the class of each symbol's context: context-modelled rANS may then code
/// each symbol with the table of its class.
pub fn encode(
    syms: &[u8],
    ctx: Option<(&rans::CtxModel, &[u8])>,
    opts: &Options,
    out: &mut Vec<u8>,
    scratch: &mut Vec<u32>,
) -> BlockMode {
    let n = syms.len();
    let keep_raw_above = n as f64 * (1.0 - opts.min_gain as f64);
    if n >= 16 * 1024 {
        // A quarter sample first: noise is stored raw without a full pass.
        // The sample's entropy runs low by ~0.01 bit (small-sample bias), so
        // it only decides "raw" when even that estimate cannot pay.
        const STEP: usize = 4;
        let sh = sampled_histogram(syms, STEP);
        let sampled: u32 = sh.iter().sum();
        let est = entropy_bits(&sh) / 8.0 * n as f64 / sampled.max(1) as f64;
        if sh.iter().filter(|&&c| c > 0).count() > 1 && est >= keep_raw_above {
            out.extend_from_slice(syms);
            return BlockMode::Raw;
        }
    }
    let h = histogram(syms);
    let distinct = h.iter().filter(|&&c| c > 0).count();
    if distinct <= 1 {
        out.push(syms.first().copied().unwrap_or(0));
        return BlockMode::Const;
    }
    let ideal = entropy_bits(&h) / 8.0;
    // Without context coding, no coder beats the entropy plus its own
    // table: Huffman's lengths take half a byte per symbol of the range
    // and 16 bytes of sizes, rANS at least a byte per symbol of the range
    // and 36 of states. A block that cannot pay even so is raw, as the
    // full comparison below would find, without building either code.
    let lo = h.iter().position(|&c| c > 0).unwrap_or(0);
    let hi = 255 - h.iter().rev().position(|&c| c > 0).unwrap_or(0);
    let range = hi + 1 - lo;
    let floor = ideal + (2 + range.div_ceil(2) + 16).min(2 + range + 36) as f64;
    let ctx_possible = ctx.is_some() && opts.rans && n >= RANS_CTX_MIN_SYMBOLS;
    if ideal >= keep_raw_above || (!ctx_possible && floor >= keep_raw_above) {
        out.extend_from_slice(syms);
        return BlockMode::Raw;
    }
    let lens = huffman::code_lengths(&h, huffman::MAX_BITS);
    let huff =
        (huffman::table_bytes(&lens) + 12 + 4) as f64 + huffman::coded_bits(&h, &lens) as f64 / 8.0;
    let mut best = (huff, BlockMode::Huffman);
    let mut freqs = None;
    // rANS tables cost 16 KiB of slots per class to build at decode time:
    // not worth it for small blocks.
    if opts.rans && n >= RANS_MIN_SYMBOLS && huff - ideal > opts.rans_min_gain as f64 * huff {
        let f = rans::normalize(&h);
        let r = (rans::header_bytes(&f) + 4) as f64 + rans::coded_bits(&h, &f) / 8.0;
        if r < huff * (1.0 - opts.rans_min_gain as f64) {
            best = (r, BlockMode::Rans);
            freqs = Some(f);
        }
    }
    let mut plan = None;
    if let (Some((model, classes)), true) = (ctx, opts.rans && n >= RANS_CTX_MIN_SYMBOLS) {
        let p = rans::ctx_plan(syms, model, classes);
        if p.bytes < best.0 * (1.0 - opts.rans_min_gain as f64) {
            best = (p.bytes, BlockMode::RansCtx);
            plan = Some(p);
        }
    }
    if best.0 >= keep_raw_above {
        out.extend_from_slice(syms);
        return BlockMode::Raw;
    }
    match best.1 {
        BlockMode::Rans => rans::encode(syms, &freqs.expect("set with Rans"), out),
        BlockMode::RansCtx => {
            let (model, classes) = ctx.expect("set with RansCtx");
            rans::ctx_encode(syms, model, classes, &plan.expect("set with RansCtx"), out)
        }
        _ => huffman::encode(syms, &lens, out, scratch),
    }
    best.1
}

/// Decoding tables kept between blocks (allocated once per thread).
#[derive(Default)]
pub struct Tables {
    pub huffman: huffman::DecodeTable,
    pub rans: Vec<u32>,
}

/// Decode one block whose payload is `frame[start..start+len]` into `out`;
/// `ctx` is the base's same block in a delta frame.
pub fn decode(
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
        BlockMode::Rans => rans::decode(payload, start as u64, out, &mut tables.rans)?,
        BlockMode::RansCtx => {
            let ctx = ctx.ok_or(corrupt("context-coded block outside a delta stream"))?;
            rans::ctx_decode(payload, start as u64, ctx, out, &mut tables.rans)?
        }
    }
    Ok(())
}
