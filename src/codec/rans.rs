//! Interleaved rANS (eight 32-bit states, 12-bit probabilities, 16-bit
//! renormalisation) for blocks where Huffman's floor of one bit per symbol
//! wastes space: the mostly-zero streams of late-training deltas.
//!
//! Block payload (see docs/format/codec.md): `lo u8, hi u8, one LEB128
//! frequency per symbol lo..=hi (summing to 4096), eight u32 LE final states,
//! then the renormalisation words (u16 LE) in decoding order`. With the state
//! in `[2^16, 2^32)` a decode step needs at most one word, so the decoder
//! renormalises without a branch.

use super::DecodeError;

pub const SCALE_BITS: u32 = 12;
/// Interleaved states: symbol `i` is coded by state `i % LANES`.
pub const LANES: usize = 8;
const M: u32 = 1 << SCALE_BITS;
const L: u32 = 1 << 16;

/// Normalise a histogram (at least two symbols present) to frequencies
/// summing to 4096, every present symbol at least 1.
pub fn normalize(hist: &[u32; 256]) -> [u32; 256] {
    let total: u64 = hist.iter().map(|&c| c as u64).sum();
    let mut f = [0u32; 256];
    let mut sum: i64 = 0;
    for s in 0..256 {
        if hist[s] > 0 {
            let v = ((hist[s] as u64 * M as u64 + total / 2) / total).max(1) as u32;
            f[s] = v;
            sum += v as i64;
        }
    }
    let mut excess = sum - M as i64;
    while excess != 0 {
        // Adjust the most probable symbol: the relative change costs least there.
        let (s, _) = f
            .iter()
            .enumerate()
            .max_by_key(|&(_, &v)| v)
            .expect("256 entries");
        if excess > 0 {
            let take = excess.min(f[s] as i64 - 1);
            if take == 0 {
                // Every symbol is at 1 and there are more than 4096 of them:
                // impossible with 256 symbols.
                unreachable!("256 symbols always fit 4096 slots");
            }
            f[s] -= take as u32;
            excess -= take;
        } else {
            f[s] += (-excess) as u32;
            excess = 0;
        }
    }
    f
}

/// Estimated payload bits for `hist` coded with frequencies `f`.
pub fn coded_bits(hist: &[u32; 256], f: &[u32; 256]) -> f64 {
    let log2 = super::block::Log2::get();
    let mut bits = 0.0;
    for s in 0..256 {
        if hist[s] > 0 {
            bits += hist[s] as f64 * (SCALE_BITS as f64 - log2.of(f[s]));
        }
    }
    bits
}

/// Bytes of the frequency table plus the states.
pub fn header_bytes(f: &[u32; 256]) -> usize {
    let lo = f.iter().position(|&v| v > 0).unwrap_or(0);
    let hi = 255 - f.iter().rev().position(|&v| v > 0).unwrap_or(0);
    2 + f[lo..=hi].iter().map(|&v| varint_len(v)).sum::<usize>() + 4 * LANES
}

fn varint_len(v: u32) -> usize {
    if v < 128 {
        1
    } else {
        2
    }
}

#[derive(Clone, Copy, Default)]
struct EncSym {
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

fn write_freqs(f: &[u32; 256], out: &mut Vec<u8>) {
    let lo = f.iter().position(|&v| v > 0).expect("symbols present");
    let hi = 255
        - f.iter()
            .rev()
            .position(|&v| v > 0)
            .expect("symbols present");
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

fn enc_table(f: &[u32; 256]) -> [EncSym; 256] {
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

/// Encode backwards, `classes[i]` picking the table of symbol `i` (the
/// first table without classes), then write the eight final states and
/// the words in decoding order. Groups of `LANES` symbols go lane by lane
/// with the states in registers; renormalisation stores a word whether or
/// not it is needed and advances only if it is (no branch).
#[inline(always)]
fn encode_core(syms: &[u8], enc: &[[EncSym; 256]], classes: Option<&[u8]>, out: &mut Vec<u8>) {
    let n = syms.len();
    // At most one word per symbol.
    let mut words = vec![0u16; n];
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
    for g in (0..full / LANES).rev() {
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
    out.reserve(2 * k);
    for w in words[..k].iter().rev() {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Append the rANS payload of `syms` with normalised frequencies `f`.
pub fn encode(syms: &[u8], f: &[u32; 256], out: &mut Vec<u8>) {
    write_freqs(f, out);
    encode_core(syms, &[enc_table(f)], None, out);
}

/// Read a frequency table; returns the slot table entries
/// (`symbol | freq << 8 | start << 20` per 12-bit slot).
fn read_freqs(
    payload: &[u8],
    p: &mut usize,
    offset: u64,
    slots: &mut [u32],
) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    let lo = *payload.get(*p).ok_or(corrupt("rans table truncated"))? as usize;
    let hi = *payload.get(*p + 1).ok_or(corrupt("rans table truncated"))? as usize;
    *p += 2;
    if lo > hi {
        return Err(corrupt("rans symbol range is empty"));
    }
    let mut start = 0u32;
    for s in lo..=hi {
        let b0 = *payload.get(*p).ok_or(corrupt("rans table truncated"))? as u32;
        *p += 1;
        let v = if b0 & 128 != 0 {
            let b1 = *payload.get(*p).ok_or(corrupt("rans table truncated"))? as u32;
            *p += 1;
            (b0 & 127) | (b1 << 7)
        } else {
            b0
        };
        if v >= M || start + v > M {
            return Err(corrupt("rans frequencies exceed 4096"));
        }
        for slot in &mut slots[start as usize..(start + v) as usize] {
            *slot = s as u32 | (v << 8) | (start << 20);
        }
        start += v;
    }
    if start != M {
        return Err(corrupt("rans frequencies do not sum to 4096"));
    }
    Ok(())
}

/// Slot tables of every class, back to back: `class << 12 | slot`.
const ALL_SLOTS: usize = MAX_CLASSES << SCALE_BITS;

/// Decode with the eight states and words at `payload[p..]`. Symbol `i`
/// uses the slot table at `coff[ctx[i]]` (a class times 4096), or the first
/// one without a context.
#[inline(always)]
fn decode_core(
    payload: &[u8],
    mut p: usize,
    offset: u64,
    slots: &[u32],
    ctx: Option<(&[u8], &[u32; 256])>,
    out: &mut [u8],
) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    if payload.len() < p + 4 * LANES {
        return Err(corrupt("rans states truncated"));
    }
    let slots: &[u32; ALL_SLOTS] = slots[..ALL_SLOTS].try_into().expect("slots grown");
    let mut x: [u32; LANES] = std::array::from_fn(|j| {
        u32::from_le_bytes(
            payload[p + 4 * j..p + 4 * j + 4]
                .try_into()
                .expect("4 bytes"),
        )
    });
    p += 4 * LANES;
    let data = &payload[p..];
    let mut r = 0usize;
    // One decode step of state `$x` with slot table offset `$off`: slot
    // lookup, state update, then at most one renormalisation word (x >= 16
    // after the update, L = 2^16), taken without a branch. `$word` is the
    // next word (read whether needed or not); the step says whether it used
    // it.
    macro_rules! step {
        ($x:expr, $off:expr, $o:expr, $word:expr) => {{
            let slot = $x & (M - 1);
            let e = slots[($off | slot) as usize & (ALL_SLOTS - 1)];
            *$o = e as u8;
            let (freq, base) = ((e >> 8) & 0xfff, e >> 20);
            let v = freq * ($x >> SCALE_BITS) + slot - base;
            let need = v < L;
            $x = if need { (v << 16) | $word as u32 } else { v };
            need
        }};
    }
    let off_at = |i: usize| ctx.map_or(0, |(c, coff)| coff[c[i] as usize]);
    let n = out.len();
    let mut i = 0;
    {
        // Fast path: a group of LANES symbols needs at most 2 * LANES bytes,
        // read from one fixed window; the states are independent chains
        // the CPU overlaps.
        let mut groups = out.chunks_exact_mut(LANES);
        for g in &mut groups {
            let Some(win) = data.get(r..r + 2 * LANES) else {
                break;
            };
            let win: &[u8; 2 * LANES] = win.try_into().expect("window");
            let off: [u32; LANES] = match ctx {
                Some((c, coff)) => {
                    let c: &[u8; LANES] = c[i..i + LANES].try_into().expect("context group");
                    c.map(|c| coff[c as usize])
                }
                None => [0; LANES],
            };
            // First every lane's symbol and new state (eight independent
            // chains), then the renormalisation words in lane order (only
            // this part depends on the lanes before).
            let mut v = [0u32; LANES];
            for j in 0..LANES {
                let xj = x[j];
                let slot = xj & (M - 1);
                let e = slots[(off[j] | slot) as usize & (ALL_SLOTS - 1)];
                g[j] = e as u8;
                v[j] = ((e >> 8) & 0xfff) * (xj >> SCALE_BITS) + slot - (e >> 20);
            }
            let mut k = 0usize;
            for j in 0..LANES {
                // k is even and at most 2 * (LANES - 1): the mask is a no-op.
                let kk = k & (2 * LANES - 2);
                let w = u16::from_le_bytes([win[kk], win[kk + 1]]) as u32;
                let need = v[j] < L;
                x[j] = if need { (v[j] << 16) | w } else { v[j] };
                k += 2 * need as usize;
            }
            r += k;
            i += LANES;
        }
    }
    // Tail, with every read checked.
    for (k, o) in out[i..n].iter_mut().enumerate() {
        let ii = i + k;
        let mut st = x[ii % LANES];
        // A missing word is only an error if it is needed.
        let w = data.get(r..r + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        let need = step!(st, off_at(ii), o, w.unwrap_or(0));
        if need && w.is_none() {
            return Err(corrupt("rans stream ends early"));
        }
        r += 2 * need as usize;
        x[ii % LANES] = st;
    }
    if r != data.len() || x != [L; LANES] {
        return Err(corrupt("rans stream does not end in the initial state"));
    }
    Ok(())
}

/// Decode `out.len()` symbols from `payload`.
/// `slots` is reusable scratch: grown as needed, never cleared (every slot a
/// decode can reach is written by the block's own tables first).
pub fn decode(
    payload: &[u8],
    offset: u64,
    out: &mut [u8],
    slots: &mut Vec<u32>,
) -> Result<(), DecodeError> {
    grow(slots, ALL_SLOTS);
    let mut p = 0;
    read_freqs(payload, &mut p, offset, &mut slots[..M as usize])?;
    decode_core(payload, p, offset, slots, None, out)
}

fn grow(v: &mut Vec<u32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    }
}

/// Context classes at most: seven context values of their own plus one
/// class for every other value.
pub const MAX_CLASSES: usize = 8;

/// A context-modelled rANS plan for one block: symbol `i` is coded with the
/// table of the class of `ctx[i]` (the base chunk's byte at the same place:
/// for an exponent-change stream, the old exponent).
pub struct CtxPlan {
    freqs: Vec<Option<[u32; 256]>>,
    /// Estimated payload bytes.
    pub bytes: f64,
    /// The block's histogram (the classes' summed).
    pub hist: [u32; 256],
}

/// Normalise a class histogram; a class with one symbol lends one slot to
/// a neighbour, since a frequency of 4096 does not fit the slot format.
fn normalize_class(h: &[u32; 256]) -> Option<[u32; 256]> {
    let present = h.iter().filter(|&&c| c > 0).count();
    match present {
        0 => None,
        1 => {
            let s = h.iter().position(|&c| c > 0).expect("one present");
            let mut f = [0u32; 256];
            f[s] = M - 1;
            f[(s + 1) & 255] = 1;
            Some(f)
        }
        _ => Some(normalize(h)),
    }
}

/// The classes of a context stream: its most frequent values get a class
/// each, every other value shares the last. One model serves every stream
/// of a block (they share the context), as does its class of each symbol.
pub struct CtxModel {
    /// Context values with a class of their own (classes 0..k-1); all other
    /// values fall in class `k`.
    values: Vec<u8>,
    cmap: [u8; 256],
}

impl CtxModel {
    pub fn new(ctx: &[u8]) -> CtxModel {
        let ch = super::histogram(ctx);
        let mut order: Vec<usize> = (0..256).filter(|&v| ch[v] > 0).collect();
        order.sort_by_key(|&v| std::cmp::Reverse(ch[v]));
        let values: Vec<u8> = order
            .iter()
            .take(MAX_CLASSES - 1)
            .map(|&v| v as u8)
            .collect();
        let mut cmap = [values.len() as u8; 256];
        for (c, &v) in values.iter().enumerate() {
            cmap[v as usize] = c as u8;
        }
        CtxModel { values, cmap }
    }

    /// The class of each context byte, into `out` (cleared first).
    pub fn classes(&self, ctx: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.extend(ctx.iter().map(|&c| self.cmap[c as usize]));
    }

    /// One histogram per class (the first `values.len() + 1` are used);
    /// `classes` from [`CtxModel::classes`]. A long input is counted in
    /// four interleaved sets, so that a run of one symbol in one class (a
    /// stream of unchanged bytes) is four chains of increments, not one.
    fn class_histograms(&self, syms: &[u8], classes: &[u8]) -> [[u32; 256]; MAX_CLASSES] {
        let n = syms.len().min(classes.len());
        let (syms, classes) = (&syms[..n], &classes[..n]);
        let mut h = [[0u32; 256]; MAX_CLASSES];
        let cls = |c: u8| c as usize % MAX_CLASSES;
        if n < 16 * 1024 {
            for (&s, &c) in syms.iter().zip(classes) {
                h[cls(c)][s as usize] += 1;
            }
            return h;
        }
        let mut hs = [[[0u32; 256]; MAX_CLASSES]; 3];
        let mut quads = syms.chunks_exact(4).zip(classes.chunks_exact(4));
        for (s, c) in &mut quads {
            h[cls(c[0])][s[0] as usize] += 1;
            hs[0][cls(c[1])][s[1] as usize] += 1;
            hs[1][cls(c[2])][s[2] as usize] += 1;
            hs[2][cls(c[3])][s[3] as usize] += 1;
        }
        for (&s, &c) in syms[n / 4 * 4..].iter().zip(&classes[n / 4 * 4..]) {
            h[cls(c)][s as usize] += 1;
        }
        for t in &hs {
            for (a, b) in h.iter_mut().zip(t) {
                for (p, q) in a.iter_mut().zip(b) {
                    *p += q;
                }
            }
        }
        h
    }

    /// Estimated bits of `syms` coded with this model: per-class order-0
    /// entropy plus the tables.
    pub fn cost_bits(&self, syms: &[u8], classes: &[u8]) -> f64 {
        let hist = self.class_histograms(syms, classes);
        let mut bits = 8.0 * (1 + self.values.len() + 4 * LANES + 4) as f64;
        for h in &hist[..self.values.len() + 1] {
            let present = h.iter().filter(|&&c| c > 0).count();
            bits += 8.0 * (1 + if present > 0 { 2 + present } else { 0 }) as f64;
            bits += super::entropy_bits(h);
        }
        bits
    }
}

/// Plan context coding of `syms` under `model`, `classes` being the class
/// of each symbol's context.
pub fn ctx_plan(syms: &[u8], model: &CtxModel, classes: &[u8]) -> CtxPlan {
    let hist = model.class_histograms(syms, classes);
    let mut bytes = (1 + model.values.len() + 4 * LANES + 4) as f64;
    let freqs: Vec<Option<[u32; 256]>> = hist[..model.values.len() + 1]
        .iter()
        .map(|h| {
            let f = normalize_class(h);
            bytes += 1.0;
            if let Some(f) = &f {
                bytes += header_bytes(f) as f64 - (4 * LANES) as f64 + coded_bits(h, f) / 8.0;
            }
            f
        })
        .collect();
    let mut all = [0u32; 256];
    for h in &hist {
        for (a, &c) in all.iter_mut().zip(h) {
            *a += c;
        }
    }
    CtxPlan {
        freqs,
        bytes,
        hist: all,
    }
}

/// Append the context-modelled payload: `k-1` as u8, the `k-1` context
/// values, per class a presence byte and (if present) its frequency table,
/// then the states and bytes as in plain rANS.
pub fn ctx_encode(
    syms: &[u8],
    model: &CtxModel,
    classes: &[u8],
    plan: &CtxPlan,
    out: &mut Vec<u8>,
) {
    out.push(model.values.len() as u8);
    out.extend_from_slice(&model.values);
    let mut enc = Vec::with_capacity(plan.freqs.len());
    for f in &plan.freqs {
        match f {
            Some(f) => {
                out.push(1);
                write_freqs(f, out);
                enc.push(enc_table(f));
            }
            None => {
                out.push(0);
                enc.push([EncSym::default(); 256]);
            }
        }
    }
    encode_core(syms, &enc, Some(&classes[..syms.len()]), out);
}

/// Decode a context-modelled block; `ctx` is the base's same block.
pub fn ctx_decode(
    payload: &[u8],
    offset: u64,
    ctx: &[u8],
    out: &mut [u8],
    slots: &mut Vec<u32>,
) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    if ctx.len() != out.len() {
        return Err(corrupt("context block length differs"));
    }
    let nv = *payload
        .first()
        .ok_or(corrupt("rans context header truncated"))? as usize;
    if nv >= MAX_CLASSES {
        return Err(corrupt("too many rans context classes"));
    }
    let values = payload
        .get(1..1 + nv)
        .ok_or(corrupt("rans context header truncated"))?;
    let k = nv + 1;
    let mut cmap = [nv as u8; 256];
    for (c, &v) in values.iter().enumerate() {
        cmap[v as usize] = c as u8;
    }
    let mut p = 1 + nv;
    grow(slots, ALL_SLOTS);
    let mut present = [false; MAX_CLASSES];
    for (c, pr) in present.iter_mut().enumerate().take(k) {
        let flag = *payload
            .get(p)
            .ok_or(corrupt("rans context table truncated"))?;
        p += 1;
        match flag {
            0 => {}
            1 => {
                *pr = true;
                let tbl = &mut slots[c << SCALE_BITS..(c + 1) << SCALE_BITS];
                read_freqs(payload, &mut p, offset, tbl)?;
            }
            _ => return Err(corrupt("bad rans class flag")),
        }
    }
    // A context whose class has no table only occurs in a corrupt frame:
    // point it at a class that has one, so decoding stays in bounds and the
    // final-state check (and the caller's blake3) reports the damage.
    let fallback = present
        .iter()
        .position(|&p| p)
        .ok_or(corrupt("rans context block without tables"))?;
    for c in cmap.iter_mut() {
        if !present[*c as usize] {
            *c = fallback as u8;
        }
    }
    let coff: [u32; 256] = cmap.map(|c| (c as u32) << SCALE_BITS);
    decode_core(payload, p, offset, slots, Some((ctx, &coff)), out)
}

#[cfg(test)]
mod tests {
    use super::*;
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
        decode(&out, 0, &mut back, &mut Vec::new()).unwrap();
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
        assert!(decode(&out, 0, &mut back, &mut Vec::new()).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_blocks_round_trip(syms in proptest::collection::vec(any::<u8>(), 2..3000)) {
            let mut s = syms;
            s[0] = 0;
            s[1] = 255;
            round_trip(&s);
        }
    }
}
