//! The interleaved rANS coder (8 or 32 32-bit states, 12-bit
//! probabilities, 16-bit renormalisation) for blocks where Huffman's floor
//! of one bit per symbol wastes space: the mostly-zero streams of
//! late-training deltas.
//!
//! Block payload (see docs/format/codec.md): `lo u8, hi u8, one LEB128
//! frequency per symbol lo..=hi (summing to 4096), the final states (u32
//! LE each), then the renormalisation words (u16 LE) in decoding order`.
//! With the state in `[2^16, 2^32)` a decode step needs at most one word,
//! so the decoder renormalises without a branch. Blocks of 16 Ki symbols
//! or more from format version 2, and of 8 Ki or more from version 11,
//! have 32 states: four AVX2 registers of eight, whose table lookups
//! (gathers) overlap.
//!
//! Owns: the frequency table encoding, the scalar encode and decode loops
//! (with one table per class when `context` supplies classes), and the
//! run-time choice of the AVX2 kernels in [`super::simd`] (one register
//! of eight states for a narrow block, four for a wide one). Must not:
//! model contexts (that is `context`'s) or estimate sizes beyond its own
//! header (statistics are `stats`'s).

use super::simd;
pub(crate) use super::stats::SCALE_BITS;
use super::DecodeError;

/// Interleaved states of a small block (and of every block of a version 1
/// frame): symbol `i` is coded by state `i % NARROW`.
pub const NARROW: usize = 8;
/// Interleaved states of a block of [`WIDE_MIN_SYMBOLS`] or more in a
/// version 2 to 10 frame, of [`WIDE_MIN_SYMBOLS_V11`] or more from
/// version 11 ([`lanes`]).
pub const WIDE: usize = 32;
const _: () = assert!(
    WIDE == simd::RANS_WIDE && ALL_SLOTS == simd::RANS_ALL_SLOTS,
    "the AVX2 kernels' shapes"
);
/// Blocks at least this long have [`WIDE`] states in format versions 2
/// to 10: the 96 more bytes of states are under 1% of such a block's
/// payload.
pub const WIDE_MIN_SYMBOLS: usize = 16 * 1024;
/// From format version 11, blocks at least this long have [`WIDE`] states:
/// eight states in one AVX2 register are one dependency chain, 32 are
/// four side by side. A LoRA run's delta tensors (48-192 KiB: streams of
/// 12-48 Ki symbols) decode 1.17-1.28x as fast (paired runs) for 0.05%
/// more bytes; at 4 Ki the states' 96 more bytes cost gpt-small's DELTA
/// bf16 row 0.2%, at 8 Ki nothing (it has no such rANS block).
pub const WIDE_MIN_SYMBOLS_V11: usize = 8 * 1024;

/// How many interleaved states a block of `n` symbols has in a frame of
/// format `version`.
pub fn lanes(n: usize, version: u8) -> usize {
    let wide_from = match version {
        0..=1 => usize::MAX,
        v if v < super::WIDE_VERSION => WIDE_MIN_SYMBOLS,
        _ => WIDE_MIN_SYMBOLS_V11,
    };
    if n >= wide_from {
        WIDE
    } else {
        NARROW
    }
}

/// States of a block this build writes.
pub(crate) fn lanes_written(n: usize) -> usize {
    lanes(n, super::WIDE_VERSION)
}
const M: u32 = 1 << SCALE_BITS;
const L: u32 = 1 << 16;

/// Bytes of the frequency table.
pub(crate) fn table_bytes(f: &[u32; 256]) -> usize {
    let (lo, hi) = present(f);
    2 + f[lo..=hi].iter().map(|&v| varint_len(v)).sum::<usize>()
}

fn varint_len(v: u32) -> usize {
    if v < 128 {
        1
    } else {
        2
    }
}

#[derive(Clone, Copy, Default)]
pub(crate) struct EncSym {
    x_max: u32,
    /// `4096 - freq`: the new state is `x + (x / freq) * cmpl + start`.
    cmpl: u32,
    start: u32,
    /// `ceil(2^44 / freq)`: `x / freq == (x * rcp) >> 44` for every state
    /// `x < x_max = 2^20 * freq` the encoder divides, since the product's
    /// excess over `x / freq` is below `x / 2^44 < freq / 2^24 < 1 / freq`
    /// (freq < 2^12). One 64 x 64 -> 128-bit multiply, no division.
    rcp: u64,
}

impl EncSym {
    fn new(start: u32, freq: u32) -> EncSym {
        EncSym {
            x_max: ((L >> SCALE_BITS) << 16) * freq,
            cmpl: M - freq,
            start,
            rcp: (1u64 << 44).div_ceil(freq as u64),
        }
    }

    /// `x / freq`, for `x < x_max`.
    #[inline(always)]
    fn quotient(&self, x: u32) -> u32 {
        ((x as u128 * self.rcp as u128) >> 44) as u32
    }

    /// `(x / freq) * 4096 + x % freq + start`.
    #[inline(always)]
    fn put(&self, x: u32) -> u32 {
        x + self.quotient(x) * self.cmpl + self.start
    }
}

/// The least and greatest symbol of `f` with a frequency (every table
/// written has two at least).
fn present(f: &[u32; 256]) -> (usize, usize) {
    let lo = f.iter().position(|&v| v > 0).unwrap_or(0);
    let hi = 255 - f.iter().rev().position(|&v| v > 0).unwrap_or(0);
    (lo, hi)
}

pub(crate) fn write_freqs(f: &[u32; 256], out: &mut Vec<u8>) {
    let (lo, hi) = present(f);
    out.push(lo as u8);
    out.push(hi as u8);
    for &v in &f[lo..=hi] {
        if v < 128 {
            out.push(v as u8);
        } else {
            out.push((v & 127) as u8 | 128);
            out.push((v >> 7) as u8);
        }
    }
}

pub(crate) fn enc_table(f: &[u32; 256]) -> [EncSym; 256] {
    let mut enc = [EncSym::default(); 256];
    let mut start = 0;
    for s in 0..256 {
        if f[s] > 0 {
            enc[s] = EncSym::new(start, f[s]);
        }
        start += f[s];
    }
    enc
}

/// Encode backwards with `LANES` states, `classes[i]` picking the table of
/// symbol `i` (the first table without classes), then write the final
/// states and the words in decoding order. Groups of `LANES` symbols go
/// lane by lane; renormalisation stores a word whether or not it is needed
/// and advances only if it is (no branch).
fn encode_core<const LANES: usize>(
    syms: &[u8],
    enc: &[[EncSym; 256]],
    classes: Option<&[u8]>,
    out: &mut Vec<u8>,
) {
    ENCODE_WORDS.with_borrow_mut(|words| {
        // At most one word per symbol (the AVX2 kernel checks that its
        // stores of eight stay inside). Reused: every word read below was
        // written by this block first.
        if words.len() < syms.len() {
            words.resize(syms.len(), 0);
        }
        encode_words::<LANES>(syms, enc, classes, words, out)
    })
}

thread_local! {
    /// The renormalisation words of the block [`encode_core`] codes,
    /// reused from block to block (a fresh zeroed buffer a block was 2
    /// bytes zeroed a symbol): as long as the longest block this thread
    /// coded, at most 128 KiB for a frame's 64 Ki-symbol blocks.
    static ENCODE_WORDS: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`encode_core`] with `words` (at least one per symbol) to collect the
/// renormalisation words in.
fn encode_words<const LANES: usize>(
    syms: &[u8],
    enc: &[[EncSym; 256]],
    classes: Option<&[u8]>,
    words: &mut [u16],
    out: &mut Vec<u8>,
) {
    let n = syms.len();
    let mut k = 0usize;
    let mut x = [L; LANES];
    macro_rules! step {
        ($j:expr, $e:expr) => {{
            let e: &EncSym = $e;
            let v = x[$j];
            let need = v >= e.x_max;
            words[k] = v as u16;
            k += need as usize;
            x[$j] = e.put(if need { v >> 16 } else { v });
        }};
    }
    let full = n / LANES * LANES;
    for i in (full..n).rev() {
        let c = classes.map_or(0, |c| c[i] as usize);
        step!(i % LANES, &enc[c][syms[i] as usize]);
    }
    // The AVX2 kernel takes every whole group, or none (then the scalar
    // loop below takes them).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut groups = full / LANES;
    #[cfg(target_arch = "x86_64")]
    if avx2_kernels() {
        let fs: Vec<u32> = enc
            .iter()
            .flat_map(|t| t.iter().map(|e| (e.x_max >> 20) | e.start << 16))
            .collect();
        let body = &syms[..full];
        // SAFETY: `avx2_kernels` found the CPU features the kernels were
        // compiled for.
        let done = unsafe {
            if LANES == WIDE {
                simd::rans_encode_avx2::<4>(&mut x, body, classes, &fs, words, k)
            } else {
                simd::rans_encode_avx2::<1>(&mut x, body, classes, &fs, words, k)
            }
        };
        if let Some(done) = done {
            k = done;
            groups = 0;
        }
    }
    for g in (0..groups).rev() {
        let at = g * LANES;
        let s: &[u8; LANES] = syms[at..at + LANES].try_into().expect("a group");
        let c: [u8; LANES] = match classes {
            Some(c) => c[at..at + LANES].try_into().expect("a group"),
            None => [0; LANES],
        };
        for j in (0..LANES).rev() {
            step!(j, &enc[c[j] as usize][s[j] as usize]);
        }
    }
    for st in x {
        out.extend_from_slice(&st.to_le_bytes());
    }
    let at = out.len();
    out.resize(at + 2 * k, 0);
    for (o, w) in out[at..].chunks_exact_mut(2).zip(words[..k].iter().rev()) {
        o.copy_from_slice(&w.to_le_bytes());
    }
}

/// Append the rANS payload of `syms` with normalised frequencies `f`.
pub fn encode(syms: &[u8], f: &[u32; 256], out: &mut Vec<u8>) {
    write_freqs(f, out);
    encode_lanes(syms, &[enc_table(f)], None, out);
}

/// [`encode_core`] with the states a block of this length has.
pub(crate) fn encode_lanes(
    syms: &[u8],
    enc: &[[EncSym; 256]],
    classes: Option<&[u8]>,
    out: &mut Vec<u8>,
) {
    if lanes_written(syms.len()) == WIDE {
        encode_core::<WIDE>(syms, enc, classes, out)
    } else {
        encode_core::<NARROW>(syms, enc, classes, out)
    }
}

/// Read a frequency table; returns the slot table entries
/// (`symbol | freq << 8 | start << 20` per 12-bit slot).
pub(crate) fn read_freqs(
    payload: &[u8],
    p: &mut usize,
    offset: u64,
    slots: &mut [u32],
) -> Result<(), DecodeError> {
    read_table(payload, p, offset, slots, |p, _| {
        let truncated = DecodeError::Corrupt {
            offset,
            reason: "rans table truncated",
        };
        let b0 = *payload.get(*p).ok_or(truncated.clone())? as u32;
        *p += 1;
        if b0 & 128 == 0 {
            return Ok(b0);
        }
        let b1 = *payload.get(*p).ok_or(truncated)? as u32;
        *p += 1;
        Ok((b0 & 127) | (b1 << 7))
    })
}

/// A table's `lo hi`, then each symbol's frequency from `next` (given
/// the cursor and the previous symbol's frequency), into the first 4096
/// `slots`: every frequency below 4096, their sum exactly 4096.
fn read_table(
    payload: &[u8],
    p: &mut usize,
    offset: u64,
    slots: &mut [u32],
    mut next: impl FnMut(&mut usize, u32) -> Result<u32, DecodeError>,
) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    let lo = *payload.get(*p).ok_or(corrupt("rans table truncated"))? as usize;
    let hi = *payload.get(*p + 1).ok_or(corrupt("rans table truncated"))? as usize;
    *p += 2;
    if lo > hi {
        return Err(corrupt("rans symbol range is empty"));
    }
    let (mut start, mut prev) = (0u32, 0u32);
    for s in lo..=hi {
        let v = next(p, prev)?;
        if v >= M || start + v > M {
            return Err(corrupt("rans frequencies exceed 4096"));
        }
        // Eight slots a store, the last store of a symbol running into
        // the next symbols' slots (which they overwrite) but not past the
        // table; thousands of tables are read a second.
        let e = s as u32 | (v << 8) | (start << 20);
        let (mut k, end) = (start as usize, (start + v) as usize);
        while k < end {
            match slots.get_mut(k..k + 8) {
                Some(eight) => eight.fill(e),
                None => {
                    slots[k..end].fill(e);
                    break;
                }
            }
            k += 8;
        }
        start += v;
        prev = v;
    }
    if start != M {
        return Err(corrupt("rans frequencies do not sum to 4096"));
    }
    Ok(())
}

/// Bytes of `f`'s gamma-coded table ([`write_freqs_gamma`]).
pub(crate) fn table_bytes_gamma(f: &[u32; 256]) -> usize {
    let (lo, hi) = present(f);
    let mut prev = 0u32;
    let mut bits = 0usize;
    for &v in &f[lo..=hi] {
        bits += gamma_bits(zigzag(v as i32 - prev as i32) + 1);
        prev = v;
    }
    2 + bits.div_ceil(8)
}

fn zigzag(d: i32) -> u32 {
    ((d << 1) ^ (d >> 31)) as u32
}

/// Bits of the Elias gamma code of `v` (>= 1).
fn gamma_bits(v: u32) -> usize {
    2 * (31 - v.leading_zeros() as usize) + 1
}

/// The longest gamma code a table may hold: `k` zeros for a value below
/// `2^(k+1)`; a frequency difference's zigzag plus one is below 2^13.
const GAMMA_MAX_ZEROS: u32 = 12;

/// The table of a [`super::block::BlockMode::RansGamma`] block: `lo u8 |
/// hi u8`, then for each symbol `lo..=hi` its frequency's difference from
/// the previous symbol's (0 before `lo`), zigzagged, plus one, as an Elias
/// gamma code (`k` zero bits, a one bit, then the `k` bits below the
/// value's top one), LSB-first, padded to a byte. Neighbouring symbols of
/// noise-like bytes have near frequencies: half the bytes of
/// [`write_freqs`]' table or less.
pub(crate) fn write_freqs_gamma(f: &[u32; 256], out: &mut Vec<u8>) {
    let (lo, hi) = present(f);
    out.push(lo as u8);
    out.push(hi as u8);
    let mut w = super::bits::BitWriter::default();
    let mut prev = 0u32;
    for &v in &f[lo..=hi] {
        let g = zigzag(v as i32 - prev as i32) + 1;
        prev = v;
        let k = 31 - g.leading_zeros();
        // k zeros, a one, then the k bits below the top one: at most 25.
        w.put(
            (1u64 | (u64::from(g) & ((1 << k) - 1)) << 1) << k,
            2 * k + 1,
            out,
        );
    }
    w.finish(out);
}

/// Read a gamma-coded table ([`write_freqs_gamma`]) at `payload[*p..]`
/// into the first 4096 `slots`, as [`read_freqs`] does, and move `*p`
/// past it.
pub(crate) fn read_freqs_gamma(
    payload: &[u8],
    p: &mut usize,
    offset: u64,
    slots: &mut [u32],
) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    let mut bits: Option<super::bits::BitReader> = None;
    read_table(payload, p, offset, slots, |p, prev| {
        let r = bits.get_or_insert_with(|| super::bits::BitReader::new(payload, *p, payload.len()));
        let k = (r.peek_safe(GAMMA_MAX_ZEROS + 1) | 1 << (GAMMA_MAX_ZEROS + 1)).trailing_zeros();
        if k > GAMMA_MAX_ZEROS {
            return Err(corrupt("rans table code too long"));
        }
        r.consume(k + 1);
        let low = r.peek_safe(k);
        r.consume(k);
        if r.overrun() {
            return Err(corrupt("rans table truncated"));
        }
        *p = r.position().div_ceil(8);
        let z = ((1u64 << k) | low) - 1;
        let d = (z >> 1) as i64 ^ -((z & 1) as i64);
        u32::try_from(i64::from(prev) + d).map_err(|_| corrupt("rans frequency below zero"))
    })
}

/// [`encode`] with a gamma-coded table.
pub fn encode_gamma(syms: &[u8], f: &[u32; 256], out: &mut Vec<u8>) {
    write_freqs_gamma(f, out);
    encode_lanes(syms, &[enc_table(f)], None, out);
}

/// A table reader: [`read_freqs`] or [`read_freqs_gamma`].
type ReadTable = fn(&[u8], &mut usize, u64, &mut [u32]) -> Result<(), DecodeError>;

/// [`decode`] with the table read by `read` ([`read_freqs_gamma`] for a
/// gamma-coded one).
pub(crate) fn decode_with(
    read: ReadTable,
    payload: &[u8],
    offset: u64,
    out: &mut [u8],
    slots: &mut Vec<u32>,
    version: u8,
) -> Result<(), DecodeError> {
    grow(slots, ALL_SLOTS);
    let mut p = 0;
    read(payload, &mut p, offset, &mut slots[..M as usize])?;
    decode_lanes(payload, p, offset, slots, None, out, version)
}

/// Slot tables of every class, back to back: `class << 12 | slot`.
pub(crate) const ALL_SLOTS: usize = MAX_CLASSES << SCALE_BITS;

/// The class of each context byte, as a decoder reads it from a block:
/// `lookup` for the AVX2 kernel (compares with the block's context
/// values), and `coff`, the same map as slot table offsets (class times
/// 4096) per byte value, for the scalar decoder.
pub(crate) struct ClassMap {
    pub lookup: simd::CtxClasses,
    pub coff: [u32; 256],
}

/// The `LANES` states at `payload[p..]` and the words after them.
fn states<const LANES: usize>(
    payload: &[u8],
    p: usize,
    offset: u64,
) -> Result<([u32; LANES], &[u8]), DecodeError> {
    let words = p + 4 * LANES;
    let Some(raw) = payload.get(p..words) else {
        return Err(DecodeError::Corrupt {
            offset,
            reason: "rans states truncated",
        });
    };
    let x = std::array::from_fn(|j| {
        u32::from_le_bytes(raw[4 * j..4 * j + 4].try_into().expect("4 bytes"))
    });
    Ok((x, &payload[words..]))
}

/// Decode with `LANES` states and the words at `payload[p..]`. Symbol `i`
/// uses the slot table of the class of `ctx[i]`, or the first one without
/// a context.
fn decode_core<const LANES: usize>(
    payload: &[u8],
    p: usize,
    offset: u64,
    slots: &[u32],
    ctx: Option<(&[u8], &ClassMap)>,
    out: &mut [u8],
) -> Result<(), DecodeError> {
    let (mut x, data) = states::<LANES>(payload, p, offset)?;
    let slots: &[u32; ALL_SLOTS] = slots[..ALL_SLOTS].try_into().expect("slots grown");
    // Whole groups while a group's words are surely there, then whole
    // groups over the stream's last words copied into a zero-padded
    // window (a sparse stream's last 2 * LANES bytes of words can hold
    // thousands of symbols), taking only groups that stay within them.
    let (mut i, mut r) = groups(&mut x, data, data.len(), slots, ctx, out);
    if i + LANES <= out.len() && r <= data.len() {
        let rem = data.len() - r;
        let mut pad = [0u8; 4 * WIDE];
        if rem + 2 * LANES <= pad.len() {
            pad[..rem].copy_from_slice(&data[r..]);
            let ctx = ctx.map(|(c, m)| (c.get(i..).unwrap_or_default(), m));
            let window = &pad[..rem + 2 * LANES];
            let (di, dr) = groups(&mut x, window, rem, slots, ctx, &mut out[i..]);
            (i, r) = (i + di, r + dr);
        }
    }
    let off_at = |_: &[u8], i: usize| ctx.map_or(0, |(c, m)| m.coff[c[i] as usize]);
    finish(x, data, r, slots, offset, off_at, out, i)
}

/// The last symbols of a block from `from` on, symbol by symbol with
/// every read checked (symbol `i`'s slot table at `off_of(out, i)`, given
/// what is decoded so far), from states `x` and the words at `data[r..]`;
/// then the check that the stream ends, all its words read, in the
/// initial states.
#[allow(clippy::too_many_arguments)]
fn finish<const LANES: usize>(
    mut x: [u32; LANES],
    data: &[u8],
    mut r: usize,
    slots: &[u32; ALL_SLOTS],
    offset: u64,
    off_of: impl Fn(&[u8], usize) -> u32,
    out: &mut [u8],
    from: usize,
) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    for i in from..out.len() {
        let off = off_of(out, i);
        let st = x[i % LANES];
        let slot = st & (M - 1);
        let e = slots[(off | slot) as usize & (ALL_SLOTS - 1)];
        out[i] = e as u8;
        let v = ((e >> 8) & 0xfff) * (st >> SCALE_BITS) + slot - (e >> 20);
        // At most one renormalisation word (x >= 16 after the update, L =
        // 2^16); a missing word is only an error if it is needed.
        x[i % LANES] = if v < L {
            let w = data
                .get(r..r + 2)
                .ok_or(corrupt("rans stream ends early"))?;
            r += 2;
            (v << 16) | u16::from_le_bytes([w[0], w[1]]) as u32
        } else {
            v
        };
    }
    if r != data.len() || x != [L; LANES] {
        return Err(corrupt("rans stream does not end in the initial state"));
    }
    Ok(())
}

/// One group of `LANES` symbols from states `x`, symbol `j` with the slot
/// table at `off[j]`, the renormalisation words from `win` (at least
/// `2 * LANES` bytes): the symbols, the new states and the words' bytes
/// taken. First every lane's symbol and new state (independent chains,
/// which the CPU overlaps), then the words in lane order (only this part
/// depends on the lanes before).
#[inline(always)]
fn group<const LANES: usize>(
    x: &[u32; LANES],
    off: &[u32; LANES],
    win: &[u8],
    slots: &[u32; ALL_SLOTS],
) -> ([u8; LANES], [u32; LANES], usize) {
    let mut v = [0u32; LANES];
    let mut syms = [0u8; LANES];
    for j in 0..LANES {
        let xj = x[j];
        let slot = xj & (M - 1);
        let e = slots[(off[j] | slot) as usize & (ALL_SLOTS - 1)];
        syms[j] = e as u8;
        v[j] = ((e >> 8) & 0xfff) * (xj >> SCALE_BITS) + slot - (e >> 20);
    }
    let mut k = 0usize;
    let mut nx = [0u32; LANES];
    for j in 0..LANES {
        // k is even and at most 2 * (LANES - 1): the mask is a no-op.
        let kk = k & (2 * LANES - 2);
        let w = u16::from_le_bytes([win[kk], win[kk + 1]]) as u32;
        let need = v[j] < L;
        nx[j] = if need { (v[j] << 16) | w } else { v[j] };
        k += 2 * need as usize;
    }
    (syms, nx, k)
}

/// Decode whole groups of `LANES` symbols into `out` (symbol `i` with the
/// class of `ctx[i]`) while a group's words, at most `2 * LANES` bytes,
/// lie inside `data`, taking only groups that leave the words read at most
/// `end`; a group that would not is left undone (states and symbols as
/// they were). Returns the symbols decoded and the words' bytes read.
fn groups<const LANES: usize>(
    x: &mut [u32; LANES],
    data: &[u8],
    end: usize,
    slots: &[u32; ALL_SLOTS],
    ctx: Option<(&[u8], &ClassMap)>,
    out: &mut [u8],
) -> (usize, usize) {
    let ctx_lookup = ctx.map(|(c, m)| (c, &m.lookup));
    let (mut i, mut r) = kernel_decode(x, data, slots, ctx_lookup, out, end);
    // The states are independent chains the CPU overlaps.
    for g in out[i..].chunks_exact_mut(LANES) {
        let Some(win) = data.get(r..r + 2 * LANES) else {
            break;
        };
        let off: [u32; LANES] = match ctx {
            Some((c, m)) => {
                std::array::from_fn(|j| c.get(i + j).map_or(0, |&c| m.coff[c as usize]))
            }
            None => [0; LANES],
        };
        let (syms, nx, k) = group(x, &off, win, slots);
        if r + k > end {
            break;
        }
        *x = nx;
        g.copy_from_slice(&syms);
        r += k;
        i += LANES;
    }
    (i, r)
}

/// The AVX2 kernel's whole groups of `LANES` symbols, as [`groups`]
/// takes them (from states `x`, the words of `data` up to `end`), where
/// the CPU has AVX2: the symbols decoded and the words' bytes read, none
/// elsewhere.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn kernel_decode<const LANES: usize>(
    x: &mut [u32; LANES],
    data: &[u8],
    slots: &[u32; ALL_SLOTS],
    ctx: Option<(&[u8], &simd::CtxClasses)>,
    out: &mut [u8],
    end: usize,
) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if avx2_kernels() {
        // SAFETY: `avx2_kernels` found the CPU features the kernels were
        // compiled for.
        return unsafe {
            if LANES == WIDE {
                simd::rans_decode_avx2::<4>(x, data, slots, ctx, out, end)
            } else {
                simd::rans_decode_avx2::<1>(x, data, slots, ctx, out, end)
            }
        };
    }
    (0, 0)
}

/// Decode `out.len()` symbols from `payload`.
/// `slots` is reusable scratch: grown as needed, never cleared (every slot a
/// decode can reach is written by the block's own tables first).
pub fn decode(
    payload: &[u8],
    offset: u64,
    out: &mut [u8],
    slots: &mut Vec<u32>,
    version: u8,
) -> Result<(), DecodeError> {
    decode_with(read_freqs, payload, offset, out, slots, version)
}

#[cfg(test)]
thread_local! {
    /// Whether blocks may take the AVX2 kernels; tests switch them off to
    /// compare the scalar loops with them on the same payloads.
    static SIMD: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Whether the AVX2 rANS kernels (8- and 32-state blocks) run here:
/// x86-64 with AVX2 and popcnt (and, in tests, not switched off).
fn avx2_kernels() -> bool {
    #[cfg(test)]
    if !SIMD.get() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("popcnt");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`decode_core`] with the states a block of this length has in a frame
/// of format `version`.
pub(crate) fn decode_lanes(
    payload: &[u8],
    p: usize,
    offset: u64,
    slots: &[u32],
    ctx: Option<(&[u8], &ClassMap)>,
    out: &mut [u8],
    version: u8,
) -> Result<(), DecodeError> {
    if lanes(out.len(), version) == WIDE {
        decode_core::<WIDE>(payload, p, offset, slots, ctx, out)
    } else {
        decode_core::<NARROW>(payload, p, offset, slots, ctx, out)
    }
}

/// [`decode_lanes`] of a block whose context is its own symbol `d`
/// places before (block mode 9; symbols before `d` have context 0): `d`
/// must be at least the block's state count, so every context is
/// decoded before the group that needs it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_up_lanes(
    payload: &[u8],
    p: usize,
    offset: u64,
    slots: &[u32],
    d: usize,
    map: &ClassMap,
    out: &mut [u8],
    version: u8,
) -> Result<(), DecodeError> {
    let lanes = lanes(out.len(), version);
    if d < lanes {
        return Err(DecodeError::Corrupt {
            offset,
            reason: "row-context distance below the block's state count",
        });
    }
    if lanes == WIDE {
        decode_up_core::<WIDE>(payload, p, offset, slots, d, map, out)
    } else {
        decode_up_core::<NARROW>(payload, p, offset, slots, d, map, out)
    }
}

/// The longest piece of a row-context block's first `d` symbols the AVX2
/// kernel decodes at once (their contexts, 0s and then decoded symbols,
/// are copied to the stack first; later pieces read theirs in place).
const UP_PIECE: usize = 4096;

/// [`decode_core`] with symbol `i`'s table the class of `out[i - d]` (of 0
/// for `i < d`), `d >= LANES`: whole groups while a group's words are
/// surely there, then symbol by symbol with every read checked.
fn decode_up_core<const LANES: usize>(
    payload: &[u8],
    p: usize,
    offset: u64,
    slots: &[u32],
    d: usize,
    map: &ClassMap,
    out: &mut [u8],
) -> Result<(), DecodeError> {
    let (mut x, data) = states::<LANES>(payload, p, offset)?;
    let slots: &[u32; ALL_SLOTS] = slots[..ALL_SLOTS].try_into().expect("slots grown");
    let n = out.len();
    let first = map.coff[0];
    let off_of = |out: &[u8], i: usize| {
        if i >= d {
            map.coff[out[i - d] as usize]
        } else {
            first
        }
    };
    let (mut i, mut r) = (0usize, 0usize);
    // With AVX2: the kernel of `decode_core`, on pieces of whole groups no
    // longer than `d`, each piece's contexts read where they were decoded
    // (copied into `cbuf` with the 0s before `d`).
    // (Narrow blocks only with rows of eight groups or more: a kernel call
    // per group costs more than the scalar loop.)
    if avx2_kernels() && (LANES == WIDE || d >= 8 * LANES) {
        let mut cbuf = [0u8; UP_PIECE];
        let piece = d / LANES * LANES;
        while i + LANES <= n {
            let (done, todo) = out.split_at_mut(i);
            // `len <= d`: a piece's contexts are all decoded already, read
            // in place once the piece starts at or past `d`.
            let (ctx, len) = if i >= d {
                let len = piece.min((n - i) / LANES * LANES);
                (&done[i - d..i - d + len], len)
            } else {
                let len = piece.min(UP_PIECE).min((n - i) / LANES * LANES);
                let z = (d - i).min(len);
                cbuf[..z].fill(0);
                if z < len {
                    cbuf[z..len].copy_from_slice(&done[i + z - d..i + len - d]);
                }
                (&cbuf[..len], len)
            };
            let rest = &data[r..];
            let (di, dr) = kernel_decode(
                &mut x,
                rest,
                slots,
                Some((ctx, &map.lookup)),
                &mut todo[..len],
                rest.len(),
            );
            (i, r) = (i + di, r + dr);
            if di < len {
                break;
            }
        }
    }
    while i + LANES <= n {
        let Some(win) = data.get(r..r + 2 * LANES) else {
            break;
        };
        // Every context of the group lies `d >= LANES` back: decoded.
        let off: [u32; LANES] = std::array::from_fn(|j| off_of(out, i + j));
        let (syms, nx, k) = group(&x, &off, win, slots);
        x = nx;
        out[i..i + LANES].copy_from_slice(&syms);
        r += k;
        i += LANES;
    }
    finish(x, data, r, slots, offset, off_of, out, i)
}

pub(crate) fn grow(v: &mut Vec<u32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    }
}

/// Context classes at most: seven context values of their own plus one
/// class for every other value.
pub const MAX_CLASSES: usize = 8;
#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::context::{ctx_decode, ctx_encode, ctx_plan, up_decode, CtxModel};
    use crate::codec::stats::normalize;
    use proptest::prelude::*;

    fn round_trip(syms: &[u8]) -> usize {
        let mut h = [0u32; 256];
        for &s in syms {
            h[s as usize] += 1;
        }
        let f = normalize(&h);
        assert_eq!(f.iter().sum::<u32>(), M);
        let mut out = Vec::new();
        encode(syms, &f, &mut out);
        let mut back = vec![0u8; syms.len()];
        decode(
            &out,
            0,
            &mut back,
            &mut Vec::new(),
            crate::codec::FORMAT_VERSION,
        )
        .unwrap();
        assert_eq!(back, syms);
        out.len()
    }

    #[test]
    fn very_skewed_block_costs_well_under_one_bit_per_symbol() {
        let syms: Vec<u8> = (0..65536u32)
            .map(|i| if i % 97 == 0 { 1 } else { 0 })
            .collect();
        let size = round_trip(&syms);
        // entropy ~0.08 bits/symbol -> ~700 bytes; Huffman would need 8 KiB
        assert!(size < 1200, "{size}");
    }

    /// The gamma-coded table byte by byte: two symbols of 2048. Their
    /// differences 2048 and 0, zigzagged and plus one, 4097 and 1: twelve
    /// zero bits, a one, 4097's twelve bits below its top one (1, then
    /// eleven zeros), then 1's code, a one bit: 26 bits, LSB-first.
    #[test]
    fn gamma_table_known_answer() {
        let mut f = [0u32; 256];
        f[0] = 2048;
        f[1] = 2048;
        let mut out = Vec::new();
        write_freqs_gamma(&f, &mut out);
        assert_eq!(out, [0x00, 0x01, 0x00, 0x30, 0x00, 0x02]);
        assert_eq!(table_bytes_gamma(&f), out.len());
        let mut slots = vec![0u32; M as usize];
        let mut p = 0;
        read_freqs_gamma(&out, &mut p, 0, &mut slots).unwrap();
        assert_eq!(p, out.len());
        assert_eq!(slots[0], 2048 << 8);
        assert_eq!(slots[4095], 1 | 2048 << 8 | 2048 << 20);
    }

    /// Broken gamma tables are errors: a code of more than twelve zeros,
    /// a table cut short, frequencies that pass 4096 or do not reach it, a
    /// difference below zero.
    #[test]
    fn broken_gamma_tables_are_errors() {
        let mut slots = vec![0u32; M as usize];
        let mut read = |t: &[u8]| read_freqs_gamma(t, &mut 0, 0, &mut slots);
        assert!(read(&[0, 0, 0, 0, 0]).is_err());
        assert!(read(&[0, 1, 0x00, 0x30]).is_err());
        assert!(read(&[0]).is_err());
        // one symbol of 4096: difference 4096, zigzag 8192 + 1, 13 zeros
        assert!(read(&[5, 5, 0x00, 0x00, 0x02, 0x00]).is_err());
        // 2048 then 2048 - 4096 (zigzag 8191 + 1 = 8192: 13 zeros)
        let mut f = [0u32; 256];
        f[0] = 2048;
        f[1] = 1024;
        let mut out = Vec::new();
        write_freqs_gamma(&f, &mut out);
        assert!(read(&out).is_err(), "sums to 3072");
    }

    /// Tables of any frequencies round trip through the gamma coding.
    #[test]
    fn gamma_tables_round_trip() {
        let mut r = crate::testing::Rng(7);
        for _ in 0..200 {
            let mut h = [0u32; 256];
            let lo = (r.next_u64() % 255) as usize;
            let hi = lo + 1 + (r.next_u64() % (255 - lo as u64)) as usize;
            for c in &mut h[lo..=hi] {
                *c = (r.next_u64() % 1000) as u32 * (r.next_u64() % 2) as u32;
            }
            // Two symbols at least, as every rANS block has (one is a
            // constant block).
            h[lo] += 1;
            h[hi] += 1 + (r.next_u64() % 2) as u32 * 100_000;
            let f = normalize(&h);
            let mut out = Vec::new();
            write_freqs_gamma(&f, &mut out);
            assert_eq!(table_bytes_gamma(&f), out.len());
            let mut slots = vec![0u32; M as usize];
            let mut p = 0;
            read_freqs_gamma(&out, &mut p, 0, &mut slots).unwrap();
            assert_eq!(p, out.len());
            let mut want = vec![0u32; M as usize];
            read_freqs(
                &{
                    let mut v = Vec::new();
                    write_freqs(&f, &mut v);
                    v
                },
                &mut 0,
                0,
                &mut want,
            )
            .unwrap();
            assert_eq!(slots, want);
        }
    }

    #[test]
    fn reciprocal_quotient_is_exact() {
        let mut r = 0x9E37_79B9u32;
        for freq in 1..M {
            // The encoder divides states below x_max only.
            let e = EncSym::new(0, freq);
            let top = e.x_max - 1;
            let last = top / freq * freq;
            let edge = [0, 1, freq - 1, freq, freq + 1, top, top - 1, last, last - 1];
            for x in edge.into_iter().chain((0..64).map(|_| {
                r ^= r << 13;
                r ^= r >> 17;
                r ^= r << 5;
                r % e.x_max
            })) {
                assert_eq!(e.quotient(x), x / freq, "x {x} freq {freq}");
            }
        }
    }

    #[test]
    fn corrupt_state_is_an_error() {
        let syms: Vec<u8> = (0..1000u32).map(|i| (i % 3) as u8).collect();
        let mut h = [0u32; 256];
        for &s in &syms {
            h[s as usize] += 1;
        }
        let mut out = Vec::new();
        encode(&syms, &normalize(&h), &mut out);
        let n = out.len();
        out[n - 1] ^= 0x55;
        let mut back = vec![0u8; syms.len()];
        assert!(decode(
            &out,
            0,
            &mut back,
            &mut Vec::new(),
            crate::codec::FORMAT_VERSION
        )
        .is_err());
    }

    /// A skewed block (mostly zeros, like a delta's high byte) whose
    /// distribution depends on a context byte, and that context.
    fn skewed_with_context(n: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
        let mut r = crate::testing::Rng(seed | 1);
        let mut next = move || r.next_u64();
        let ctx: Vec<u8> = (0..n).map(|_| 100 + (next() % 11) as u8).collect();
        let syms = ctx
            .iter()
            .map(|&c| {
                let v = next();
                if v % 16 < (c as u64 - 98) {
                    (v >> 8) as u8 % (c - 95)
                } else {
                    0
                }
            })
            .collect();
        (syms, ctx)
    }

    /// The context-coded payload of `syms` (classes from `ctx`).
    fn ctx_payload(syms: &[u8], ctx: &[u8]) -> Vec<u8> {
        let model = CtxModel::new(ctx);
        let mut classes = Vec::new();
        model.classes(ctx, &mut classes);
        let plan = ctx_plan(syms, &model, &classes);
        let mut out = Vec::new();
        ctx_encode(syms, &model, &classes, &plan, &mut out);
        out
    }

    /// `f()` with the AVX2 kernels allowed (where the CPU has them) or not.
    fn with_simd<T>(simd: bool, f: impl FnOnce() -> T) -> T {
        SIMD.set(simd);
        let t = f();
        SIMD.set(true);
        t
    }

    /// Decode a context-coded payload with the AVX2 kernel allowed or not:
    /// whether it decoded, and every output byte.
    fn ctx_decode_with(simd: bool, payload: &[u8], ctx: &[u8]) -> (bool, Vec<u8>) {
        with_simd(simd, || {
            let mut back = vec![0u8; ctx.len()];
            let r = ctx_decode(
                payload,
                0,
                ctx,
                &mut back,
                &mut Vec::new(),
                crate::codec::FORMAT_VERSION,
            );
            (r.is_ok(), back)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// A row-context payload (block mode 9) decodes to its symbols with
        /// the AVX2 kernel and without it, whatever the distance (one row
        /// or several, under or over a piece) and the length; a payload cut
        /// short is an error either way, never a panic.
        #[test]
        fn row_context_blocks_decode_alike_with_and_without_the_kernel(
            n in 1usize..70_000,
            d in 32usize..5_000,
            row in 1usize..40,
            seed in any::<u64>(),
            cut in 0usize..64,
        ) {
            // Symbols that follow a column of `row` (each the column's
            // value plus 0-2), so that the classes matter.
            let mut rng = crate::testing::Rng(seed | 1);
            let cols: Vec<u8> = (0..row).map(|_| 100 + (rng.next_u64() % 7) as u8).collect();
            let syms: Vec<u8> = (0..n).map(|i| cols[i % row] + (rng.next_u64() % 3) as u8).collect();
            let mut ctx = vec![0u8; d.min(n)];
            ctx.extend_from_slice(&syms[..n - d.min(n)]);
            let mut payload = Vec::new();
            crate::codec::leb::write(d as u64, &mut payload);
            payload.extend(ctx_payload(&syms, &ctx));
            for simd in [true, false] {
                let got = with_simd(simd, || {
                    let mut back = vec![0u8; n];
                    let v = crate::codec::FORMAT_VERSION;
                    up_decode(&payload, 0, &mut back, &mut Vec::new(), v).map(|_| back)
                });
                prop_assert_eq!(got.as_deref().ok(), Some(&syms[..]));
                let short = &payload[..payload.len() - cut.min(payload.len())];
                let cut_ok = with_simd(simd, || {
                    let mut back = vec![0u8; n];
                    let v = crate::codec::FORMAT_VERSION;
                    up_decode(short, 0, &mut back, &mut Vec::new(), v).is_ok()
                });
                prop_assert!(cut == 0 || !cut_ok);
            }
        }
    }

    #[test]
    fn large_blocks_have_32_states_from_version_2_and_8_ki_from_version_11() {
        assert_eq!(lanes(WIDE_MIN_SYMBOLS, 2), WIDE);
        assert_eq!(lanes(WIDE_MIN_SYMBOLS - 1, 2), NARROW);
        assert_eq!(lanes(1 << 16, 1), NARROW);
        assert_eq!(lanes(WIDE_MIN_SYMBOLS - 1, 10), NARROW);
        assert_eq!(lanes(8 * 1024, 11), WIDE);
        assert_eq!(lanes(8 * 1024 - 1, 11), NARROW);
        assert_eq!(lanes_written(8 * 1024), WIDE);
        // A version 1 block of 64 Ki symbols keeps eight states.
        let (syms, _) = skewed_with_context(1 << 16, 5);
        let f = normalize(&crate::codec::histogram(&syms));
        let mut out = Vec::new();
        write_freqs(&f, &mut out);
        encode_core::<NARROW>(&syms, &[enc_table(&f)], None, &mut out);
        let mut back = vec![0u8; syms.len()];
        decode(&out, 0, &mut back, &mut Vec::new(), 1).unwrap();
        assert_eq!(back, syms);
        // The same block in version 2 is 96 bytes of states longer.
        let mut wide = Vec::new();
        encode(&syms, &f, &mut wide);
        assert!(wide.len() > out.len() + 64, "{} {}", wide.len(), out.len());
        decode(&wide, 0, &mut back, &mut Vec::new(), 2).unwrap();
        assert_eq!(back, syms);
    }

    #[test]
    fn the_avx2_kernel_matches_the_scalar_loop_on_damaged_blocks() {
        for n in [40_000, 12_288, 6_144] {
            damaged_blocks_decode_alike(n);
        }
    }

    /// [`the_avx2_kernel_matches_the_scalar_loop_on_damaged_blocks`] on a
    /// block of `n` symbols (wide or narrow).
    fn damaged_blocks_decode_alike(n: usize) {
        let (syms, ctx) = skewed_with_context(n, 9);
        let payload = ctx_payload(&syms, &ctx);
        assert_eq!(ctx_decode_with(true, &payload, &ctx), (true, syms.clone()));
        assert_eq!(ctx_decode_with(false, &payload, &ctx), (true, syms));
        // Damage in the states, the words, and a context the tables do
        // not expect: both decoders read the same symbols and agree that
        // it is an error.
        let len = payload.len();
        for at in [len - 300, len - len / 3, len / 2, len - 2] {
            let mut bad = payload.clone();
            bad[at] ^= 0x5a;
            let simd = ctx_decode_with(true, &bad, &ctx);
            assert_eq!(simd, ctx_decode_with(false, &bad, &ctx), "byte {at}");
            assert!(!simd.0, "byte {at}");
        }
        // A context value listed twice (no encoder writes that): the first
        // one's class counts, in both.
        assert!(payload[0] >= 2, "seven context values");
        let mut twice = payload.clone();
        twice[2] = twice[1];
        let simd = ctx_decode_with(true, &twice, &ctx);
        assert_eq!(simd, ctx_decode_with(false, &twice, &ctx));
        let mut other = ctx.clone();
        other[123] = 7;
        other[n / 2] = 250;
        assert_eq!(
            ctx_decode_with(true, &payload, &other),
            ctx_decode_with(false, &payload, &other)
        );
    }

    /// A block so skewed that its last 64 bytes of words cover thousands
    /// of symbols: those groups are decoded over a zero-padded copy of the
    /// words, by the AVX2 kernel and by the scalar loop alike, and damage
    /// in the last words is an error in both, with the same symbols.
    #[test]
    fn the_last_words_of_a_sparse_block_decode_alike() {
        let n = 3 * WIDE_MIN_SYMBOLS + 5;
        let syms: Vec<u8> = (0..n as u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60 == 0 && i % 7 == 0) as u8)
            .collect();
        let f = normalize(&crate::codec::histogram(&syms));
        let mut payload = Vec::new();
        encode(&syms, &f, &mut payload);
        let words = payload.len() - table_bytes(&f) - 4 * WIDE;
        assert!(words < 8 * 1024, "{words} bytes of words");
        let run = |simd: bool, payload: &[u8]| {
            with_simd(simd, || {
                let mut back = vec![0u8; n];
                let ok = decode(payload, 0, &mut back, &mut Vec::new(), 2).is_ok();
                (ok, back)
            })
        };
        assert_eq!(run(true, &payload), (true, syms.clone()));
        assert_eq!(run(false, &payload), (true, syms));
        let len = payload.len();
        for at in [
            len - 1,
            len - 2,
            len - 30,
            len - 63,
            len - 64,
            len - 65,
            len - 130,
        ] {
            for flip in [0x01, 0x80, 0xff] {
                let mut bad = payload.clone();
                bad[at] ^= flip;
                let simd = run(true, &bad);
                assert_eq!(simd, run(false, &bad), "byte {at} ^ {flip:#x}");
                assert!(!simd.0, "byte {at} ^ {flip:#x}");
            }
        }
        // Words cut short or one too many.
        for bad in [&payload[..len - 2], &[&payload[..], &[0, 0]].concat()[..]] {
            let simd = run(true, bad);
            assert_eq!(simd, run(false, bad));
            assert!(!simd.0);
        }
    }

    proptest! {
        #[test]
        fn arbitrary_blocks_round_trip(syms in proptest::collection::vec(any::<u8>(), 2..3000)) {
            let mut s = syms;
            s[0] = 0;
            s[1] = 255;
            round_trip(&s);
        }

        /// The AVX2 encoders (wide and narrow blocks) write the scalar
        /// encoder's very bytes, context coded or plain.
        #[test]
        fn the_avx2_encoder_writes_the_scalar_bytes(
            n in prop_oneof![
                2usize..3000,
                WIDE_MIN_SYMBOLS_V11 - 3000..WIDE_MIN_SYMBOLS_V11 + 3000,
                WIDE_MIN_SYMBOLS - 3000..WIDE_MIN_SYMBOLS + 3000,
            ],
            seed in any::<u64>(),
        ) {
            let (syms, ctx) = skewed_with_context(n, seed);
            let simd = ctx_payload(&syms, &ctx);
            let scalar = with_simd(false, || ctx_payload(&syms, &ctx));
            prop_assert_eq!(simd, scalar);
            // Plain, over the context bytes (flat) and over nearly constant
            // symbols (frequencies 4095 and 1, the extremes of the division).
            let mut rare: Vec<u8> = (0..n as u64).map(|i| (i.wrapping_mul(seed | 1) % 4999 == 0) as u8).collect();
            (rare[0], rare[1]) = (1, 0);
            for t in [&ctx, &rare] {
                let f = normalize(&crate::codec::histogram(t));
                let plain = |simd| with_simd(simd, || {
                    let mut out = Vec::new();
                    encode(t, &f, &mut out);
                    out
                });
                prop_assert_eq!(plain(true), plain(false));
            }
        }

        /// Blocks, wide and narrow, context coded, of any length and
        /// context: the AVX2 kernels and the scalar loop decode the same
        /// symbols.
        #[test]
        fn blocks_decode_alike_with_and_without_avx2(
            n in prop_oneof![
                2usize..3000,
                WIDE_MIN_SYMBOLS_V11 - 3000..WIDE_MIN_SYMBOLS_V11 + 3000,
                WIDE_MIN_SYMBOLS - 3000..WIDE_MIN_SYMBOLS + 3000,
            ],
            seed in any::<u64>(),
        ) {
            let (syms, ctx) = skewed_with_context(n, seed);
            let payload = ctx_payload(&syms, &ctx);
            prop_assert_eq!(ctx_decode_with(true, &payload, &ctx), (true, syms.clone()));
            prop_assert_eq!(ctx_decode_with(false, &payload, &ctx), (true, syms));
        }
    }
}
