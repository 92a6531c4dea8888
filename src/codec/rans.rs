//! Interleaved rANS (8 or 32 32-bit states, 12-bit probabilities, 16-bit
//! renormalisation) for blocks where Huffman's floor of one bit per symbol
//! wastes space: the mostly-zero streams of late-training deltas.
//!
//! Block payload (see docs/format/codec.md): `lo u8, hi u8, one LEB128
//! frequency per symbol lo..=hi (summing to 4096), the final states (u32
//! LE each), then the renormalisation words (u16 LE) in decoding order`.
//! With the state in `[2^16, 2^32)` a decode step needs at most one word,
//! so the decoder renormalises without a branch. Blocks of 16 Ki symbols
//! or more in format version 2 have 32 states: four AVX2 registers of
//! eight, whose table lookups (gathers) overlap.

use super::DecodeError;

pub const SCALE_BITS: u32 = 12;
/// Interleaved states of a small block (and of every block of a version 1
/// frame): symbol `i` is coded by state `i % NARROW`.
pub const NARROW: usize = 8;
/// Interleaved states of a block of [`WIDE_MIN_SYMBOLS`] or more in a
/// version 2 frame.
pub const WIDE: usize = 32;
/// Blocks at least this long have [`WIDE`] states (from format version 2):
/// the 96 more bytes of states are under 1% of such a block's payload.
pub const WIDE_MIN_SYMBOLS: usize = 16 * 1024;

/// How many interleaved states a block of `n` symbols has in a frame of
/// format `version`.
pub fn lanes(n: usize, version: u8) -> usize {
    if version >= 2 && n >= WIDE_MIN_SYMBOLS {
        WIDE
    } else {
        NARROW
    }
}

/// States of a block this build writes.
fn lanes_written(n: usize) -> usize {
    lanes(n, super::FORMAT_VERSION)
}
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

/// Bytes of the frequency table.
fn table_bytes(f: &[u32; 256]) -> usize {
    let lo = f.iter().position(|&v| v > 0).unwrap_or(0);
    let hi = 255 - f.iter().rev().position(|&v| v > 0).unwrap_or(0);
    2 + f[lo..=hi].iter().map(|&v| varint_len(v)).sum::<usize>()
}

/// Bytes of the frequency table plus the states of a block of `n` symbols.
pub fn header_bytes(f: &[u32; 256], n: usize) -> usize {
    table_bytes(f) + 4 * lanes_written(n)
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
    let n = syms.len();
    // At most one word per symbol, and room for the AVX2 kernel's last
    // store of eight.
    let mut words = vec![0u16; n + 8];
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
    // The AVX2 kernel takes every whole group, or none.
    let kernel = LANES == WIDE && avx2_kernels();
    #[cfg(target_arch = "x86_64")]
    if kernel {
        let fs: Vec<u32> = enc
            .iter()
            .flat_map(|t| t.iter().map(|e| (e.x_max >> 20) | e.start << 16))
            .collect();
        let x: &mut [u32; WIDE] = (&mut x[..]).try_into().expect("LANES == WIDE");
        // SAFETY: the CPU has the features the kernel was compiled for.
        k = unsafe { encode_wide_avx2(x, &syms[..full], classes, &fs, &mut words, k) };
    }
    let groups = if kernel { 0 } else { full / LANES };
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
    out.reserve(2 * k);
    for w in words[..k].iter().rev() {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// `COMPRESS[m]`: the lanes of mask `m` from the highest down, then the
/// rest (unused): the order in which the encoder's lanes of one register
/// write their renormalisation words.
#[cfg(target_arch = "x86_64")]
static COMPRESS: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let mut at = 0;
        let mut j = 8;
        while j > 0 {
            j -= 1;
            if m & (1 << j) != 0 {
                t[m][at] = j as u32;
                at += 1;
            }
        }
        m += 1;
    }
    t
};

/// The 32 bytes of `v` as four registers of eight u32, in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_quarters(v: std::arch::x86_64::__m256i) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256(v, 1);
    [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)].map(|q| _mm256_cvtepu8_epi32(q))
}

/// The group loop of [`encode_core`] with [`WIDE`] states in four AVX2
/// registers, for every whole group of `syms` from the last: per register
/// one gather of `fs` (`freq | start << 16` per `class << 8 | symbol`),
/// the words of the lanes that renormalise compressed in descending lane
/// order (the scalar loop's order), and the quotient `x / freq` by a
/// double-precision division, which is exact here: `x < 2^32` and
/// `freq < 2^12` are exact doubles, and a quotient's distance below the
/// next integer (at least `1 / freq`, relative `2^-32`) is far above the
/// division's rounding (relative `2^-53`). Returns the words written
/// (`k` on entry plus this kernel's).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn encode_wide_avx2(
    x: &mut [u32; WIDE],
    syms: &[u8],
    classes: Option<&[u8]>,
    fs: &[u32],
    words: &mut [u16],
    mut k: usize,
) -> usize {
    use std::arch::x86_64::*;
    let mut xv: [__m256i; 4] =
        std::array::from_fn(|r| _mm256_loadu_si256(x.as_ptr().add(8 * r).cast()));
    // A class past the last table takes the last (only a caller's bug
    // could pass one; the gather stays in bounds either way).
    let last = _mm256_set1_epi32((fs.len() / 256).max(1) as i32 - 1);
    let low16 = _mm256_set1_epi32(0xffff);
    let m_scale = _mm256_set1_epi32(M as i32);
    let sign = _mm256_set1_epi32(i32::MIN);
    let two31 = _mm256_set1_pd(2_147_483_648.0);
    for g in (0..syms.len() / WIDE).rev() {
        let at = g * WIDE;
        let sk = widen_quarters(_mm256_loadu_si256(syms.as_ptr().add(at).cast()));
        let ck = match classes {
            Some(c) => {
                // `classes` is at least as long as `syms` (the caller's slice).
                let cv = _mm256_loadu_si256(c[at..at + WIDE].as_ptr().cast());
                widen_quarters(cv).map(|q| _mm256_min_epu32(q, last))
            }
            None => [_mm256_setzero_si256(); 4],
        };
        for r in (0..4).rev() {
            let idx = _mm256_or_si256(_mm256_slli_epi32(ck[r], 8), sk[r]);
            let e = _mm256_i32gather_epi32::<4>(fs.as_ptr().cast(), idx);
            let freq = _mm256_and_si256(e, low16);
            let start = _mm256_srli_epi32(e, 16);
            let v = xv[r];
            // x >= freq << 20, unsigned.
            let x_max = _mm256_slli_epi32(freq, 20);
            let need = _mm256_cmpeq_epi32(_mm256_max_epu32(v, x_max), v);
            let mask = _mm256_movemask_ps(_mm256_castsi256_ps(need)) as usize;
            let w = _mm256_permutevar8x32_epi32(
                _mm256_and_si256(v, low16),
                _mm256_loadu_si256(COMPRESS[mask & 255].as_ptr().cast()),
            );
            let w = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            // k + 8 <= words.len(): k counts words of symbols already coded
            // (fewer than syms.len()), and words has 8 to spare.
            debug_assert!(k + 8 <= words.len());
            _mm_storeu_si128(words.as_mut_ptr().add(k).cast(), w);
            k += mask.count_ones() as usize;
            let v = _mm256_blendv_epi8(v, _mm256_srli_epi32(v, 16), need);
            // q = v / freq in doubles: v as unsigned (flip the sign bit,
            // convert as signed, add 2^31 back).
            let vs = _mm256_xor_si256(v, sign);
            let f_lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(freq));
            let f_hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(freq, 1));
            let v_lo = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(vs)), two31);
            let v_hi = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(vs, 1)), two31);
            let q_lo = _mm256_cvttpd_epi32(_mm256_div_pd(v_lo, f_lo));
            let q_hi = _mm256_cvttpd_epi32(_mm256_div_pd(v_hi, f_hi));
            let q = _mm256_set_m128i(q_hi, q_lo);
            // x = v + q * (4096 - freq) + start
            let cmpl = _mm256_sub_epi32(m_scale, freq);
            xv[r] = _mm256_add_epi32(_mm256_add_epi32(v, _mm256_mullo_epi32(q, cmpl)), start);
        }
    }
    for (r, v) in xv.iter().enumerate() {
        _mm256_storeu_si256(x.as_mut_ptr().add(8 * r).cast(), *v);
    }
    k
}

/// Append the rANS payload of `syms` with normalised frequencies `f`.
pub fn encode(syms: &[u8], f: &[u32; 256], out: &mut Vec<u8>) {
    write_freqs(f, out);
    encode_lanes(syms, &[enc_table(f)], None, out);
}

/// [`encode_core`] with the states a block of this length has.
fn encode_lanes(syms: &[u8], enc: &[[EncSym; 256]], classes: Option<&[u8]>, out: &mut Vec<u8>) {
    if lanes_written(syms.len()) == WIDE {
        encode_core::<WIDE>(syms, enc, classes, out)
    } else {
        encode_core::<NARROW>(syms, enc, classes, out)
    }
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

/// The class of each context byte, as a decoder reads it from a block: a
/// byte equal to `values[j]` (the first such `j`) is in class `classes[j]`,
/// any other byte in class `other`. `coff` is the same map as slot table
/// offsets (class times 4096), for the scalar decoder.
struct ClassMap {
    nv: usize,
    values: [u8; MAX_CLASSES - 1],
    classes: [u8; MAX_CLASSES - 1],
    other: u8,
    coff: [u32; 256],
}

/// Decode with `LANES` states and the words at `payload[p..]`. Symbol `i`
/// uses the slot table of the class of `ctx[i]`, or the first one without
/// a context.
fn decode_core<const LANES: usize>(
    payload: &[u8],
    mut p: usize,
    offset: u64,
    slots: &[u32],
    ctx: Option<(&[u8], &ClassMap)>,
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
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if LANES == WIDE && avx2_kernels() {
        let x: &mut [u32; WIDE] = (&mut x[..]).try_into().expect("LANES == WIDE");
        // SAFETY: the CPU has the features the kernel was compiled for.
        (i, r) = unsafe { decode_wide_avx2(x, data, slots, ctx, out) };
    }
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
    let off_at = |i: usize| ctx.map_or(0, |(c, m)| m.coff[c[i] as usize]);
    let n = out.len();
    {
        // Fast path: a group of LANES symbols needs at most 2 * LANES bytes,
        // read from one fixed window; the states are independent chains
        // the CPU overlaps.
        let mut groups = out[i..].chunks_exact_mut(LANES);
        for g in &mut groups {
            let Some(win) = data.get(r..r + 2 * LANES) else {
                break;
            };
            let off: [u32; LANES] = match ctx {
                Some((c, m)) => std::array::from_fn(|j| m.coff[c[i + j] as usize]),
                None => [0; LANES],
            };
            // First every lane's symbol and new state (independent chains),
            // then the renormalisation words in lane order (only this part
            // depends on the lanes before).
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

/// `EXPAND[m][j]`: the index of the renormalisation word that lane `j` of
/// eight takes when the lanes in mask `m` take one each, in lane order
/// (the number of lanes of `m` below `j`).
#[cfg(target_arch = "x86_64")]
static EXPAND: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let mut j = 0;
        while j < 8 {
            t[m][j] = (m & ((1 << j) - 1)).count_ones();
            j += 1;
        }
        m += 1;
    }
    t
};

/// The fast path of [`decode_core`] with [`WIDE`] states, in four AVX2
/// registers: per group of 32 symbols, four gathers of eight slots (each
/// register's chain is independent, so their latencies overlap), then each
/// register's renormalisation words, expanded to the lanes that need them
/// with one permutation. Decodes whole groups while 64 bytes of words are
/// left (a group needs at most that) and returns the symbols decoded and
/// the words' bytes read; the caller goes on from there.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn decode_wide_avx2(
    x: &mut [u32; WIDE],
    data: &[u8],
    slots: &[u32; ALL_SLOTS],
    ctx: Option<(&[u8], &ClassMap)>,
    out: &mut [u8],
) -> (usize, usize) {
    use std::arch::x86_64::*;
    let mut xv: [__m256i; 4] =
        std::array::from_fn(|k| _mm256_loadu_si256(x.as_ptr().add(8 * k).cast()));
    let low12 = _mm256_set1_epi32(M as i32 - 1);
    let low8 = _mm256_set1_epi32(0xff);
    let zero = _mm256_setzero_si256();
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let n = out.len();
    let (mut i, mut r) = (0usize, 0usize);
    while i + WIDE <= n && r + 2 * WIDE <= data.len() {
        let off: [__m256i; 4] = match ctx {
            Some((c, m)) => {
                // The class of each of the 32 context bytes: compare with
                // each value, last to first, so the first match wins.
                let cv = _mm256_loadu_si256(c.as_ptr().add(i).cast());
                let mut cls = _mm256_set1_epi8(m.other as i8);
                for j in (0..m.nv).rev() {
                    let eq = _mm256_cmpeq_epi8(cv, _mm256_set1_epi8(m.values[j] as i8));
                    cls = _mm256_blendv_epi8(cls, _mm256_set1_epi8(m.classes[j] as i8), eq);
                }
                widen_quarters(cls).map(|q| _mm256_slli_epi32(q, SCALE_BITS as i32))
            }
            None => [zero; 4],
        };
        let mut e = [zero; 4];
        for k in 0..4 {
            let slot = _mm256_and_si256(xv[k], low12);
            // A class is below 8 and a slot below 4096: in bounds.
            let ek =
                _mm256_i32gather_epi32::<4>(slots.as_ptr().cast(), _mm256_or_si256(slot, off[k]));
            e[k] = ek;
            let freq = _mm256_and_si256(_mm256_srli_epi32(ek, 8), low12);
            let start = _mm256_srli_epi32(ek, 20);
            let v = _mm256_add_epi32(
                _mm256_mullo_epi32(freq, _mm256_srli_epi32(xv[k], SCALE_BITS as i32)),
                _mm256_sub_epi32(slot, start),
            );
            let need = _mm256_cmpeq_epi32(_mm256_srli_epi32(v, 16), zero);
            let mask = _mm256_movemask_ps(_mm256_castsi256_ps(need)) as usize;
            // r + 16 <= data.len(): the loop left 64 bytes, and each
            // register before this one took at most 16.
            let words = _mm256_cvtepu16_epi32(_mm_loadu_si128(data.as_ptr().add(r).cast()));
            let words = _mm256_permutevar8x32_epi32(
                words,
                _mm256_loadu_si256(EXPAND[mask & 255].as_ptr().cast()),
            );
            let renorm = _mm256_or_si256(_mm256_slli_epi32(v, 16), words);
            xv[k] = _mm256_blendv_epi8(v, renorm, need);
            r += 2 * mask.count_ones() as usize;
        }
        // Byte 0 of each entry is its symbol: pack 4 x 8 entries to 32
        // bytes (the packs work per 128-bit half; the permutation puts
        // the halves' quarters back in lane order).
        let a = _mm256_packus_epi32(_mm256_and_si256(e[0], low8), _mm256_and_si256(e[1], low8));
        let b = _mm256_packus_epi32(_mm256_and_si256(e[2], low8), _mm256_and_si256(e[3], low8));
        let syms = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), order);
        _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), syms);
        i += WIDE;
    }
    for (k, v) in xv.iter().enumerate() {
        _mm256_storeu_si256(x.as_mut_ptr().add(8 * k).cast(), *v);
    }
    (i, r)
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
    grow(slots, ALL_SLOTS);
    let mut p = 0;
    read_freqs(payload, &mut p, offset, &mut slots[..M as usize])?;
    decode_lanes(payload, p, offset, slots, None, out, version)
}

#[cfg(test)]
thread_local! {
    /// Whether wide blocks may take the AVX2 kernel; tests switch it off to
    /// compare the scalar loop with it on the same payloads.
    static SIMD: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Whether the AVX2 kernels of 32-state blocks run here: x86-64 with AVX2
/// and popcnt (and, in tests, not switched off).
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
fn decode_lanes(
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

/// `out[i]` = the `j < nv` with `values[j] == ctx[i]` (the values are
/// distinct), else `nv`: seven compares and selects per byte, which the
/// compiler vectorises (a table lookup per byte does not).
#[inline(always)]
fn classes_body(values: &[u8; MAX_CLASSES - 1], nv: u8, ctx: &[u8], out: &mut [u8]) {
    for (o, &c) in out.iter_mut().zip(ctx) {
        let mut k = nv;
        for (j, &v) in values.iter().enumerate() {
            if (j as u8) < nv && c == v {
                k = j as u8;
            }
        }
        *o = k;
    }
}

dispatch!(classes_of, classes_body, (values: &[u8; MAX_CLASSES - 1], nv: u8, ctx: &[u8], out: &mut [u8]));

/// The classes of a context stream: its most frequent values get a class
/// each, every other value shares the last. One model serves every stream
/// of a block (they share the context), as does its class of each symbol.
pub struct CtxModel {
    /// Context values with a class of their own (classes 0..k-1); all other
    /// values fall in class `k`.
    values: Vec<u8>,
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
        CtxModel { values }
    }

    /// The class of each context byte, into `out` (cleared first).
    pub fn classes(&self, ctx: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.resize(ctx.len(), 0);
        self.classes_into(ctx, out);
    }

    /// The class of each context byte of `ctx` into `out` (as long).
    pub fn classes_into(&self, ctx: &[u8], out: &mut [u8]) {
        let mut values = [0u8; MAX_CLASSES - 1];
        values[..self.values.len()].copy_from_slice(&self.values);
        classes_of(&values, self.values.len() as u8, ctx, out);
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
        let states = 4 * lanes_written(syms.len());
        let mut bits = 8.0 * (1 + self.values.len() + states + 4) as f64;
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
    let mut bytes = (1 + model.values.len() + 4 * lanes_written(syms.len()) + 4) as f64;
    let freqs: Vec<Option<[u32; 256]>> = hist[..model.values.len() + 1]
        .iter()
        .map(|h| {
            let f = normalize_class(h);
            bytes += 1.0;
            if let Some(f) = &f {
                bytes += table_bytes(f) as f64 + coded_bits(h, f) / 8.0;
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
    encode_lanes(syms, &enc, Some(&classes[..syms.len()]), out);
}

/// Decode a context-modelled block; `ctx` is the base's same block.
pub fn ctx_decode(
    payload: &[u8],
    offset: u64,
    ctx: &[u8],
    out: &mut [u8],
    slots: &mut Vec<u32>,
    version: u8,
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
    let mut p = 1 + nv;
    grow(slots, ALL_SLOTS);
    let mut present = [false; MAX_CLASSES];
    for (c, pr) in present.iter_mut().enumerate().take(nv + 1) {
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
        .ok_or(corrupt("rans context block without tables"))? as u8;
    let table = |c: usize| if present[c] { c as u8 } else { fallback };
    let mut map = ClassMap {
        nv,
        values: [0; MAX_CLASSES - 1],
        classes: [0; MAX_CLASSES - 1],
        other: table(nv),
        coff: [0; 256],
    };
    let offset_of = |class: u8| (class as u32) << SCALE_BITS;
    map.coff = [offset_of(map.other); 256];
    // The first of equal values wins (an encoder never repeats one).
    for (c, &v) in values.iter().enumerate().rev() {
        map.values[c] = v;
        map.classes[c] = table(c);
        map.coff[v as usize] = offset_of(table(c));
    }
    decode_lanes(payload, p, offset, slots, Some((ctx, &map)), out, version)
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
            let r = ctx_decode(payload, 0, ctx, &mut back, &mut Vec::new(), 2);
            (r.is_ok(), back)
        })
    }

    #[test]
    fn large_blocks_have_32_states_from_version_2() {
        assert_eq!(lanes(WIDE_MIN_SYMBOLS, 2), WIDE);
        assert_eq!(lanes(WIDE_MIN_SYMBOLS - 1, 2), NARROW);
        assert_eq!(lanes(1 << 16, 1), NARROW);
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
        let (syms, ctx) = skewed_with_context(40_000, 9);
        let payload = ctx_payload(&syms, &ctx);
        assert_eq!(ctx_decode_with(true, &payload, &ctx), (true, syms.clone()));
        assert_eq!(ctx_decode_with(false, &payload, &ctx), (true, syms));
        // Damage in the states, the words, and a context the tables do
        // not expect: both decoders read the same symbols and agree that
        // it is an error.
        let n = payload.len();
        for at in [n - 300, n - 5000, n / 2, n - 2] {
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
        other[20_000] = 250;
        assert_eq!(
            ctx_decode_with(true, &payload, &other),
            ctx_decode_with(false, &payload, &other)
        );
    }

    proptest! {
        #[test]
        fn arbitrary_blocks_round_trip(syms in proptest::collection::vec(any::<u8>(), 2..3000)) {
            let mut s = syms;
            s[0] = 0;
            s[1] = 255;
            round_trip(&s);
        }

        /// The vectorised class of each context byte is the model's table's.
        #[test]
        fn classes_match_the_table(ctx in proptest::collection::vec(any::<u8>(), 0..2000), spread in 1u8..=255) {
            let ctx: Vec<u8> = ctx.iter().map(|&c| c % spread).collect();
            let model = CtxModel::new(&ctx);
            let mut got = Vec::new();
            model.classes(&ctx, &mut got);
            let nv = model.values.len();
            let want: Vec<u8> = ctx
                .iter()
                .map(|c| model.values.iter().position(|v| v == c).unwrap_or(nv) as u8)
                .collect();
            prop_assert_eq!(got, want);
        }

        /// The AVX2 encoder writes the scalar encoder's very bytes, context
        /// coded or plain.
        #[test]
        fn the_avx2_encoder_writes_the_scalar_bytes(
            n in WIDE_MIN_SYMBOLS..WIDE_MIN_SYMBOLS + 3000,
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

        /// Wide blocks, context coded, of any length and context: the AVX2
        /// kernel and the scalar loop decode the same symbols.
        #[test]
        fn wide_blocks_decode_alike_with_and_without_avx2(
            n in WIDE_MIN_SYMBOLS..WIDE_MIN_SYMBOLS + 3000,
            seed in any::<u64>(),
        ) {
            let (syms, ctx) = skewed_with_context(n, seed);
            let payload = ctx_payload(&syms, &ctx);
            prop_assert_eq!(ctx_decode_with(true, &payload, &ctx), (true, syms.clone()));
            prop_assert_eq!(ctx_decode_with(false, &payload, &ctx), (true, syms));
        }
    }
}
