//! The element map of a version 4 frame: which whole elements are *skipped*
//! (all bytes zero in a frame without a delta; all bytes equal to the
//! base's element in a delta frame) and so never reach rotation, grouping
//! or the block coders. Only the *kept* elements, compacted, go through
//! the rest of the pipeline.
//!
//! The map is a list of alternating run lengths, kept first (that first
//! run may be empty): `[kept, skipped, kept, skipped, ...]`, stored either
//! as LEB128 numbers or as a bitmap, whichever is shorter
//! (`docs/format/codec.md`, "Element map").

use super::DecodeError;

/// How the map is stored; the discriminant is the on-disk byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MapKind {
    /// The run lengths as LEB128 numbers.
    Runs = 1,
    /// One bit per element, LSB-first, 1 = skipped.
    Bitmap = 2,
}

/// Whether the encoder may store an element map (format version 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementMap {
    /// When a cheap count says it pays (see [`worth_it`]).
    Auto,
    /// Never.
    Never,
    /// Always (tests and measurements), even with nothing to skip.
    Always,
}

/// Whether element `e` is skipped: equal to the base's element, or zero.
#[inline(always)]
fn skip<const W: usize>(e: &[u8; W], b: Option<&[u8; W]>) -> bool {
    match b {
        Some(b) => e == b,
        None => *e == [0u8; W],
    }
}

fn as_array<const W: usize>(c: &[u8]) -> &[u8; W] {
    c.try_into().expect("chunks of W bytes")
}

/// A look at about 2048 evenly spread elements: true when at least one in
/// 16 of them is skipped, the least share worth counting whole.
/// (Inlined: when a change elsewhere made the compiler call it instead,
/// gpt-small's FULL fp32 encode measured 1815 against 1971 MiB/s.)
#[inline]
pub fn screen(body: &[u8], base: Option<&[u8]>, w: usize) -> bool {
    match w {
        1 => screen_w::<1>(body, base),
        2 => screen_w::<2>(body, base),
        4 => screen_w::<4>(body, base),
        8 => screen_w::<8>(body, base),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

/// [`screen`] of `W`-byte elements, each compared whole (a byte-by-byte
/// compare was most of the screen's time).
#[inline]
fn screen_w<const W: usize>(body: &[u8], base: Option<&[u8]>) -> bool {
    let n = body.len() / W;
    if n == 0 {
        return false;
    }
    let step = (n / 2048).max(1) | 1;
    let (mut seen, mut hits) = (0usize, 0usize);
    let mut i = 0;
    while i < n {
        let e = as_array::<W>(&body[i * W..(i + 1) * W]);
        let b = base.map(|b| as_array::<W>(&b[i * W..(i + 1) * W]));
        hits += usize::from(skip::<W>(e, b));
        seen += 1;
        i += step;
    }
    hits * 16 >= seen
}

/// The skip mask of the 64 `W`-byte elements at `e` (against `b`'s):
/// bit `j` set when element `j` is skipped. Whole elements compared as
/// integers, a form the compiler turns into vector compares and a mask.
#[inline(always)]
fn mask64<const W: usize>(e: &[u8], b: Option<&[u8]>) -> u64 {
    let mut m = 0u64;
    match b {
        Some(b) => {
            for j in 0..64 {
                let s = skip::<W>(
                    as_array(&e[j * W..(j + 1) * W]),
                    Some(as_array(&b[j * W..(j + 1) * W])),
                );
                m |= (s as u64) << j;
            }
        }
        None => {
            for j in 0..64 {
                m |= (skip::<W>(as_array(&e[j * W..(j + 1) * W]), None) as u64) << j;
            }
        }
    }
    m
}

/// The run builder of [`scan_w`]: alternating kept / skipped run lengths,
/// kept first.
struct Runs<'a> {
    runs: &'a mut Vec<u32>,
    skipping: bool,
    run: u32,
    skipped: usize,
}

impl<'a> Runs<'a> {
    /// A builder into `runs`, cleared.
    fn new(runs: &'a mut Vec<u32>) -> Self {
        runs.clear();
        Runs {
            runs,
            skipping: false,
            run: 0,
            skipped: 0,
        }
    }

    /// Close the last run; returns how many elements were skipped.
    fn finish(self) -> usize {
        self.runs.push(self.run);
        self.skipped
    }

    #[inline(always)]
    fn visit(&mut self, s: bool) {
        if s != self.skipping {
            self.runs.push(self.run);
            self.run = 0;
            self.skipping = s;
        }
        self.run += 1;
        self.skipped += s as usize;
    }

    /// The 64 elements of skip mask `m`, in order. A mask of one kind that
    /// continues the current run (most of them, in runs of zero rows or of
    /// unchanged ones, and in chunks with nothing to skip) is one add.
    #[inline(always)]
    fn visit64(&mut self, m: u64) {
        self.skipped += m.count_ones() as usize;
        let (mut bits, mut left) = (m, 64u32);
        while left > 0 {
            let same = if self.skipping {
                bits.trailing_ones()
            } else {
                bits.trailing_zeros()
            }
            .min(left);
            self.run += same;
            left -= same;
            if left > 0 {
                bits >>= same;
                self.runs.push(self.run);
                self.run = 0;
                self.skipping = !self.skipping;
            }
        }
    }
}

fn scan_w<const W: usize>(
    body: &[u8],
    base: Option<&[u8]>,
    runs: &mut Vec<u32>,
    simd: bool,
) -> usize {
    let mut r = Runs::new(runs);
    // With a base, as many elements as both hold (the encoder passes a
    // base of the chunk's length).
    let n = base.map_or(body.len(), |b| b.len().min(body.len())) / W;
    let base = base.map(|b| &b[..n * W]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if simd && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, just detected.
        done = unsafe { super::simd::skip_masks_avx2::<W, _>(body, base, |m| r.visit64(m)) };
    }
    let _ = simd;
    let whole = n / 64 * 64;
    let at = |i: usize| i * W..(i + 1) * W;
    for g in (done..whole).step_by(64) {
        let span = g * W..(g + 64) * W;
        r.visit64(mask64::<W>(&body[span.clone()], base.map(|b| &b[span])));
    }
    for i in whole.max(done)..n {
        r.visit(skip::<W>(
            as_array(&body[at(i)]),
            base.map(|b| as_array(&b[at(i)])),
        ));
    }
    r.finish()
}

/// The run lengths of the skipped and kept elements of `body` (`n * w`
/// bytes), kept first, into `runs`; returns how many are skipped.
pub fn scan(body: &[u8], base: Option<&[u8]>, w: usize, runs: &mut Vec<u32>) -> usize {
    scan_with(body, base, w, runs, true)
}

/// [`scan`], with the AVX2 masks when `simd` and the CPU has them, else
/// the portable masks (the tests compare the two).
fn scan_with(body: &[u8], base: Option<&[u8]>, w: usize, runs: &mut Vec<u32>, simd: bool) -> usize {
    match w {
        1 => scan_w::<1>(body, base, runs, simd),
        2 => scan_w::<2>(body, base, runs, simd),
        4 => scan_w::<4>(body, base, runs, simd),
        8 => scan_w::<8>(body, base, runs, simd),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

fn leb_len(v: u32) -> usize {
    (32 - v.leading_zeros() as usize).max(1).div_ceil(7)
}

/// Bytes of the map's data in the shorter of its two forms, and that form.
pub fn map_size(runs: &[u32], n: usize) -> (usize, MapKind) {
    let b = n.div_ceil(8);
    // Every run takes a byte at least: more runs than the bitmap's bytes
    // settle it without summing their lengths.
    if runs.len() > b {
        return (b, MapKind::Bitmap);
    }
    let r: usize = runs.iter().map(|&v| leb_len(v)).sum();
    if r <= b {
        (r, MapKind::Runs)
    } else {
        (b, MapKind::Bitmap)
    }
}

/// Whether a map of `map_bytes` pays for skipping `skipped` of `n`
/// elements of width `w`: at least one element in 16 skipped, and the map
/// at most a bit per skipped byte (a skipped byte costs more than that in
/// a stream that also holds other values; scattered unchanged elements of
/// a bf16 delta, which the context coder already codes in about that,
/// stay in the streams); for 1-byte elements, under the binary entropy of
/// the skipped share as well ([`map_pays_alone`]).
pub fn worth_it(skipped: usize, n: usize, w: usize, map_bytes: usize) -> bool {
    skipped * 16 >= n
        && map_bytes * 8 <= skipped * w
        && (w > 1 || map_pays_alone(skipped, n, map_bytes))
}

/// For 1-byte elements the skipped ones are one symbol of the one stream,
/// which the block coders already code in about `n * h(skipped / n)` bits
/// (`h` the binary entropy): the map, which says the same thing, must come
/// under that to pay (runs long enough). A map of scattered skipped
/// bytes never does.
fn map_pays_alone(skipped: usize, n: usize, map_bytes: usize) -> bool {
    let mut h = [0u32; 256];
    (h[0], h[1]) = (skipped as u32, (n - skipped) as u32);
    (map_bytes * 8) as f64 <= super::stats::entropy_bits(&h)
}

/// Append the map section (`kind u8 | length u32 | data`).
/// `bits`, when given, are the runs' skip bits ([`bits_of_runs`]) the
/// caller has already.
pub fn write(runs: &[u32], n: usize, bits: Option<&[u64]>, out: &mut Vec<u8>) {
    let (len, kind) = map_size(runs, n);
    out.push(kind as u8);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    let start = out.len();
    match kind {
        MapKind::Runs => {
            for &v in runs {
                super::leb::write(v as u64, out);
            }
        }
        MapKind::Bitmap => {
            // The skip bits' words, little-endian, cut to the bitmap's
            // bytes (a word at a time, not a bit per element).
            let mut own = Vec::new();
            let bits = bits.unwrap_or_else(|| {
                bits_of_runs(runs, n, &mut own);
                &own
            });
            out.extend(bits.iter().flat_map(|w| w.to_le_bytes()).take(len));
        }
    }
    debug_assert_eq!(out.len(), start + len);
}

/// What [`read`] found: where the section ends, the kept elements and the
/// runs of skipped ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapRead {
    /// The position after the section.
    pub end: usize,
    /// Elements kept (in the streams).
    pub kept: usize,
    /// Runs of skipped elements: how scattered the map is.
    pub skipped_runs: usize,
}

/// Parse the map section at `frame[pos..]` for `n` elements: a run-length
/// section into `runs` (and `bits` cleared), a bitmap into `bits` as skip
/// bits ([`bits_of_runs`]'s form: the bitmap's bytes as little-endian
/// words, `runs` cleared). [`runs_of_bits`] and [`bits_of_runs`] give the
/// other form when it is wanted.
pub fn read(
    frame: &[u8],
    pos: usize,
    n: usize,
    runs: &mut Vec<u32>,
    bits: &mut Vec<u64>,
) -> Result<MapRead, DecodeError> {
    let corrupt = |offset: usize, reason| DecodeError::Corrupt {
        offset: offset as u64,
        reason,
    };
    let head = frame.get(pos..pos + 5).ok_or(DecodeError::Truncated {
        need: (pos + 5) as u64,
        have: frame.len() as u64,
    })?;
    let kind = head[0];
    let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
    let start = pos + 5;
    let data = frame
        .get(start..start.saturating_add(len))
        .ok_or(DecodeError::Truncated {
            need: start as u64 + len as u64,
            have: frame.len() as u64,
        })?;
    runs.clear();
    bits.clear();
    let mut kept = 0usize;
    let mut skipped_runs = 0usize;
    match kind {
        1 => {
            let (mut total, mut i) = (0usize, 0usize);
            while i < data.len() {
                let mut v = 0u64;
                let mut shift = 0;
                loop {
                    let b = *data
                        .get(i)
                        .ok_or(corrupt(start + i, "element map run cut short"))?;
                    i += 1;
                    v |= ((b & 0x7f) as u64) << shift;
                    if b & 0x80 == 0 {
                        break;
                    }
                    shift += 7;
                    if shift > 28 {
                        return Err(corrupt(start + i, "element map run too long"));
                    }
                }
                if v > (n - total) as u64 {
                    return Err(corrupt(start + i, "element map runs exceed the elements"));
                }
                if v == 0 && !runs.is_empty() {
                    return Err(corrupt(start + i, "empty element map run"));
                }
                if runs.len() % 2 == 0 {
                    kept += v as usize;
                }
                total += v as usize;
                runs.push(v as u32);
            }
            if total != n || runs.is_empty() {
                return Err(corrupt(start, "element map runs do not cover the elements"));
            }
            skipped_runs = runs.len() / 2;
        }
        2 => {
            if len != n.div_ceil(8) {
                return Err(corrupt(pos + 1, "element bitmap length"));
            }
            if n % 8 != 0 && data.last().is_some_and(|&b| b >> (n % 8) != 0) {
                return Err(corrupt(start + len - 1, "element bitmap padding set"));
            }
            // Word by word: the skipped count, and the runs' starts (a
            // skipped element after a kept one, or first).
            bits.extend(data.chunks(8).map(|c| {
                let mut word = [0u8; 8];
                word[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(word)
            }));
            let mut before = 0u64;
            let mut skipped = 0usize;
            for &m in bits.iter() {
                skipped += m.count_ones() as usize;
                skipped_runs += (m & !(m << 1 | before)).count_ones() as usize;
                before = m >> 63;
            }
            kept = n - skipped;
        }
        _ => return Err(corrupt(pos, "unknown element map kind")),
    }
    Ok(MapRead {
        end: start + len,
        kept,
        skipped_runs,
    })
}

/// The skip bits of `n` elements with run lengths `runs`: bit `i % 64` of
/// word `i / 64` set when element `i` is skipped, into `bits` (cleared
/// first). Whole words at a time inside a run.
pub fn bits_of_runs(runs: &[u32], n: usize, bits: &mut Vec<u64>) {
    bits.clear();
    bits.resize(n.div_ceil(64), 0);
    let mut i = 0usize;
    for (r, &len) in runs.iter().enumerate() {
        let end = (i + len as usize).min(n);
        if r % 2 == 1 {
            let mut j = i;
            while j < end {
                let (word, bit) = (j / 64, j % 64);
                let take = (64 - bit).min(end - j);
                let ones = if take == 64 { !0 } else { (1u64 << take) - 1 };
                bits[word] |= ones << bit;
                j += take;
            }
        }
        i = end;
    }
}

/// The run lengths of `n` elements' skip bits (the inverse of
/// [`bits_of_runs`]), kept first, into `runs` (cleared first).
pub fn runs_of_bits(bits: &[u64], n: usize, runs: &mut Vec<u32>) {
    let mut r = Runs::new(runs);
    let whole = n / 64;
    for &m in &bits[..whole] {
        r.visit64(m);
    }
    for i in whole * 64..n {
        r.visit(bits[i / 64] >> (i % 64) & 1 != 0);
    }
    r.finish();
}

/// The `n` elements' mask of one word of skip bits: the elements of word
/// `k` that exist.
#[inline(always)]
fn valid(k: usize, n: usize) -> u64 {
    let left = n - k * 64;
    if left >= 64 {
        !0
    } else {
        (1u64 << left) - 1
    }
}

/// [`compact`] by skip bits ([`bits_of_runs`]) for the `n` elements of
/// `raw`: each element copied as one fixed-size move, and a word with
/// nothing skipped as one copy (a run per element of a scattered map was
/// a `memcpy` call each).
pub fn compact_bits(raw: &[u8], bits: &[u64], n: usize, w: usize, out: &mut Vec<u8>) {
    match w {
        1 => compact_bits_w::<1>(raw, bits, n, out),
        2 => compact_bits_w::<2>(raw, bits, n, out),
        4 => compact_bits_w::<4>(raw, bits, n, out),
        8 => compact_bits_w::<8>(raw, bits, n, out),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

fn compact_bits_w<const W: usize>(raw: &[u8], bits: &[u64], n: usize, out: &mut Vec<u8>) {
    let raw = &raw[..n * W];
    let kept: usize = (0..n.div_ceil(64))
        .map(|k| (!bits[k] & valid(k, n)).count_ones() as usize)
        .sum();
    out.clear();
    // Room for the AVX2 kernel's last 16-byte store, cut off at the end.
    out.resize(kept * W + 16, 0);
    let simd = simd_moves::<W>();
    let mut at = 0usize;
    for (k, &m) in bits.iter().enumerate().take(n.div_ceil(64)) {
        let v = valid(k, n);
        let mut keep = !m & v;
        let lo = k * 64;
        if keep == v {
            let len = v.count_ones() as usize * W;
            out[at..at + len].copy_from_slice(&raw[lo * W..lo * W + len]);
            at += len;
            continue;
        }
        if keep == 0 {
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if simd {
            let hi = lo + v.count_ones() as usize;
            // SAFETY: `simd_moves` found AVX2.
            let (i, a) = unsafe {
                match W {
                    2 => super::simd::compact_word_avx2::<2>(raw, k, hi, m, out, at),
                    _ => super::simd::compact_word_avx2::<4>(raw, k, hi, m, out, at),
                }
            };
            at = a;
            // The elements the kernel left.
            keep &= !0u64 << (i - lo).min(63) << u32::from(i - lo == 64);
        }
        while keep != 0 {
            let j = lo + keep.trailing_zeros() as usize;
            out[at..at + W].copy_from_slice(&raw[j * W..(j + 1) * W]);
            at += W;
            keep &= keep - 1;
        }
    }
    debug_assert_eq!(at, kept * W);
    out.truncate(kept * W);
}

/// Whether the AVX2 moves of a scattered map run for `W`-byte elements:
/// 2 or 4 bytes (bf16 and fp16, fp32), on a CPU with AVX2.
#[inline(always)]
fn simd_moves<const W: usize>() -> bool {
    #[cfg(target_arch = "x86_64")]
    return (W == 2 || W == 4) && SIMD_MOVES.get() && std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

thread_local! {
    /// Tests switch the AVX2 moves off to compare the element loops with
    /// them.
    static SIMD_MOVES: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Switch this thread's AVX2 moves of scattered maps on or off (tests).
#[cfg(test)]
pub(crate) fn set_simd_moves(on: bool) {
    SIMD_MOVES.set(on);
}

/// Undo [`compact`] in place, by skip bits ([`bits_of_runs`]): `out`
/// holds the kept elements in its first `kept * w` bytes and is `n * w`
/// long; the skipped elements become the base's (when given) or zero.
/// For scattered maps (the decoder places long runs straight where they
/// belong, [`kept_pieces`]). Back to front, so every kept element moves
/// up (or stays); a word of one kind is one copy or fill, a mixed word
/// of 2- or 4-byte elements a 16-byte shuffle per 8 or 4 elements (AVX2),
/// else each element chosen without a branch (kept: the next one down;
/// skipped: the base's or zero). Run by run (as it was: a `memcpy` call
/// and a run-length parse per run), a bf16 run's delta weights with half
/// their elements unchanged decoded at 455-495 MiB/s; by skip bits at
/// 870-940 (`examples/codec_speed`, one core, scripts/gen_large_run.py
/// --dtype bf16).
pub fn expand_bits(out: &mut [u8], kept: usize, bits: &[u64], base: Option<&[u8]>, w: usize) {
    match w {
        1 => expand_bits_w::<1>(out, kept, bits, base),
        2 => expand_bits_w::<2>(out, kept, bits, base),
        4 => expand_bits_w::<4>(out, kept, bits, base),
        8 => expand_bits_w::<8>(out, kept, bits, base),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

/// Element `i` of `s` (`W` bytes) as the low bytes of a word.
#[inline(always)]
fn load<const W: usize>(s: &[u8], i: usize) -> u64 {
    let mut v = [0u8; 8];
    v[..W].copy_from_slice(&s[i * W..(i + 1) * W]);
    u64::from_le_bytes(v)
}

fn expand_bits_w<const W: usize>(out: &mut [u8], kept: usize, bits: &[u64], base: Option<&[u8]>) {
    let n = out.len() / W;
    // `src`: kept elements not yet moved, all below `i`; `i`: the first
    // element placed. A kept element `j` is the `src`-th from the bottom,
    // and `src <= j + 1`, so nothing below is overwritten before it moves.
    let mut src = kept;
    let mut i = n;
    let simd = simd_moves::<W>();
    while i > 0 {
        let k = (i - 1) / 64;
        let lo = k * 64;
        let all = valid(k, n);
        let m = bits[k] & all;
        if m == 0 {
            let len = i - lo;
            out.copy_within((src - len) * W..src * W, lo * W);
            src -= len;
        } else if m == all {
            match base {
                Some(b) => out[lo * W..i * W].copy_from_slice(&b[lo * W..i * W]),
                None => out[lo * W..i * W].fill(0),
            }
        } else {
            #[allow(unused_mut)]
            let mut top = i;
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd_moves` found AVX2.
                (top, src) = unsafe {
                    match W {
                        2 => super::simd::expand_word_avx2::<2>(out, k, i, m, src, base),
                        _ => super::simd::expand_word_avx2::<4>(out, k, i, m, src, base),
                    }
                };
            }
            for j in (lo..top).rev() {
                let s = (m >> (j - lo)) & 1;
                // The kept candidate (element 0 when none is left: then
                // every element below is skipped and it is not taken).
                let kv = load::<W>(out, src.saturating_sub(1));
                let bv = base.map_or(0, |b| load::<W>(b, j));
                let pick = 0u64.wrapping_sub(s);
                let v = (kv & !pick) | (bv & pick);
                out[j * W..(j + 1) * W].copy_from_slice(&v.to_le_bytes()[..W]);
                src -= (s ^ 1) as usize;
            }
        }
        i = lo;
    }
    debug_assert_eq!(src, 0);
}

/// The kept elements of `raw` (`n * w` bytes) by `runs`, back to back, into
/// `out` (cleared first): what the encoder codes. The decoder puts them
/// back piece by piece ([`kept_pieces`], [`fill_skipped`]), or for a
/// scattered map gathers the base's ([`compact_bits`]) and
/// [`expand_bits`].
pub fn compact(raw: &[u8], runs: &[u32], w: usize, out: &mut Vec<u8>) {
    out.clear();
    let mut i = 0usize;
    for (r, &len) in runs.iter().enumerate() {
        let len = len as usize * w;
        if r % 2 == 0 {
            out.extend_from_slice(&raw[i..i + len]);
        }
        i += len;
    }
}

/// One run of elements as the decoder places it: `len` elements that are
/// `at..at + len` of the frame's streams and `to..to + len` of the chunk,
/// against `from..from + len` of the base. A kept run of an element map
/// is against the base's same elements (`from == to`); a row of a row
/// frame's others against its root, elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub at: usize,
    pub to: usize,
    pub from: usize,
    pub len: usize,
}

/// The non-empty kept runs of `runs`, in order, into `pieces` (cleared
/// first).
pub fn kept_pieces(runs: &[u32], pieces: &mut Vec<Piece>) {
    pieces.clear();
    let (mut at, mut to) = (0usize, 0usize);
    for (r, &len) in runs.iter().enumerate() {
        let len = len as usize;
        if r % 2 == 0 && len > 0 {
            pieces.push(Piece {
                at,
                to,
                from: to,
                len,
            });
            at += len;
        }
        to += len;
    }
}

/// Write the skipped elements of `out` (`n * w` bytes): the base's (when
/// given) or zero. The kept elements' bytes are left as they are.
pub fn fill_skipped(
    out: &mut [std::mem::MaybeUninit<u8>],
    runs: &[u32],
    base: Option<&[u8]>,
    w: usize,
) {
    let mut to = 0usize;
    for (r, &len) in runs.iter().enumerate() {
        let len = len as usize * w;
        if r % 2 == 1 {
            let dst = &mut out[to..to + len];
            match base {
                Some(b) => {
                    let src = &b[to..to + len];
                    // SAFETY: `src` and `dst` are both `len` bytes (sliced
                    // just above, so in bounds) and in different buffers.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast(), len)
                    }
                }
                None => dst.fill(std::mem::MaybeUninit::new(0)),
            }
        }
        to += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The screen counts, at every `step`-th element, the elements
        /// equal to the base's (or zero), byte by byte.
        #[test]
        fn the_screen_matches_its_bytewise_definition(
            w in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            n in 0usize..9000,
            skipped_per_64 in 0u64..64,
            with_base in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let mut next = || rng.next_u64();
            let base: Vec<u8> = (0..n * w).map(|_| next() as u8).collect();
            let mut body = vec![0u8; n * w];
            for i in 0..n {
                if next() % 64 >= skipped_per_64 {
                    for k in 0..w {
                        body[i * w + k] = next() as u8 | 1;
                    }
                } else if with_base {
                    body[i * w..(i + 1) * w].copy_from_slice(&base[i * w..(i + 1) * w]);
                }
            }
            let b = with_base.then_some(base.as_slice());
            let step = (n / 2048).max(1) | 1;
            let (mut seen, mut hits) = (0usize, 0usize);
            for i in (0..n).step_by(step) {
                let e = &body[i * w..(i + 1) * w];
                hits += usize::from(match b {
                    Some(b) => e == &b[i * w..(i + 1) * w],
                    None => e.iter().all(|&v| v == 0),
                });
                seen += 1;
            }
            prop_assert_eq!(screen(&body, b, w), n > 0 && hits * 16 >= seen);
        }

        /// The 64-element masks of `scan` give the runs of the element by
        /// element definition: runs of every length, across and along the
        /// 64-element boundaries, with and without a base.
        #[test]
        fn scan_matches_its_element_by_element_definition(
            lens in proptest::collection::vec(prop_oneof![1usize..4, 60usize..70, 120usize..300], 0..12),
            first_skipped in any::<bool>(),
            w in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            with_base in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let n: usize = lens.iter().sum();
            let base: Vec<u8> = (0..n * w).map(|_| rng.next_u64() as u8).collect();
            let mut body = Vec::with_capacity(n * w);
            let mut skipping = first_skipped;
            for &len in &lens {
                for _ in 0..len {
                    let at = body.len();
                    for k in 0..w {
                        // A kept element differs from the base (or zero) in
                        // one byte only, so a whole-element compare is needed.
                        let same = if with_base { base[at + k] } else { 0 };
                        body.push(if !skipping && k == w - 1 { same ^ 0x80 } else { same });
                    }
                }
                skipping = !skipping;
            }
            let b = with_base.then_some(base.as_slice());
            let mut want = Vec::new();
            let (mut state, mut run, mut want_skipped) = (false, 0u32, 0usize);
            for i in 0..n {
                let e = &body[i * w..(i + 1) * w];
                let s = match b {
                    Some(b) => e == &b[i * w..(i + 1) * w],
                    None => e.iter().all(|&v| v == 0),
                };
                if s != state {
                    want.push(run);
                    run = 0;
                    state = s;
                }
                run += 1;
                want_skipped += s as usize;
            }
            want.push(run);
            for simd in [true, false] {
                let mut runs = vec![7];
                prop_assert_eq!(scan_with(&body, b, w, &mut runs, simd), want_skipped);
                prop_assert_eq!(runs, want.clone());
            }
        }

        #[test]
        fn map_forms_and_compaction_round_trip(
            skip_share in 1u32..4,
            mask_seed in any::<u64>(),
            n in 0usize..600,
            w in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            with_base in any::<bool>(),
        ) {
            // Element i is skipped with probability skip_share / 4.
            let mut rng = crate::testing::Rng(mask_seed | 1);
            let mask: Vec<bool> = (0..n).map(|_| rng.next_u64() % 4 < skip_share as u64).collect();
            let base: Vec<u8> = (0..n * w).map(|i| (i * 7 + 3) as u8).collect();
            // Element i is skipped where the mask says so.
            let raw: Vec<u8> = (0..n * w)
                .map(|i| {
                    let e = i / w;
                    match (mask[e], with_base) {
                        (true, true) => base[i],
                        (true, false) => 0,
                        (false, true) => base[i] ^ 0x5a,
                        (false, false) => 0x5a | i as u8,
                    }
                })
                .collect();
            let b = with_base.then_some(base.as_slice());
            let mut runs = Vec::new();
            let skipped = scan(&raw, b, w, &mut runs);
            prop_assert_eq!(skipped, mask.iter().filter(|&&m| m).count());
            let mut sec = Vec::new();
            write(&runs, n, None, &mut sec);
            if n > 0 {
                // The same section from the bits the caller has.
                let mut bits = Vec::new();
                bits_of_runs(&runs, n, &mut bits);
                let mut again = Vec::new();
                write(&runs, n, Some(&bits), &mut again);
                prop_assert_eq!(&again, &sec);
            }
            let (mut back, mut bits) = (Vec::new(), Vec::new());
            let map = read(&sec, 0, n, &mut back, &mut bits).unwrap();
            prop_assert_eq!(map.end, sec.len());
            let kept = map.kept;
            prop_assert_eq!(kept, n - skipped);
            prop_assert_eq!(map.skipped_runs, runs.len() / 2);
            // Read as runs or as bits, by the section's kind; each form
            // gives the other.
            let mut want_bits = Vec::new();
            bits_of_runs(&runs, n, &mut want_bits);
            if sec[0] == MapKind::Runs as u8 {
                prop_assert_eq!(&back, &runs);
                prop_assert!(bits.is_empty());
            } else {
                prop_assert!(back.is_empty());
                prop_assert_eq!(&bits, &want_bits);
                runs_of_bits(&bits, n, &mut back);
                prop_assert_eq!(&back, &runs);
            }
            let mut c = Vec::new();
            compact(&raw, &runs, w, &mut c);
            prop_assert_eq!(c.len(), kept * w);
            // With and without the AVX2 moves.
            for simd in [true, false] {
                SIMD_MOVES.set(simd);
                let mut by_bits = vec![1, 2, 3];
                compact_bits(&raw, &want_bits, n, w, &mut by_bits);
                prop_assert_eq!(&by_bits, &c);
                let mut e = c.clone();
                e.resize(n * w, 0xEE);
                expand_bits(&mut e, kept, &want_bits, b, w);
                prop_assert_eq!(&e, &raw);
            }
            SIMD_MOVES.set(true);
            // The decoder's inverse: each kept piece copied into place,
            // the skipped elements filled.
            let mut pieces = Vec::new();
            kept_pieces(&runs, &mut pieces);
            prop_assert_eq!(pieces.iter().map(|p| p.len).sum::<usize>(), kept);
            let mut back = vec![0xEEu8; n * w];
            for p in &pieces {
                back[p.to * w..(p.to + p.len) * w].copy_from_slice(&c[p.at * w..(p.at + p.len) * w]);
            }
            // SAFETY: MaybeUninit<u8> has the layout of u8; only
            // initialised bytes are written.
            let out = unsafe { std::slice::from_raw_parts_mut(back.as_mut_ptr().cast(), n * w) };
            fill_skipped(out, &runs, b, w);
            prop_assert_eq!(&back, &raw);
        }
    }

    #[test]
    fn bitmap_padding_and_overlong_runs_are_corrupt() {
        let (mut runs, mut bits) = (Vec::new(), Vec::new());
        // 3 elements, bitmap with padding bit 3 set.
        assert!(read(&[2, 1, 0, 0, 0, 0b1000], 0, 3, &mut runs, &mut bits).is_err());
        // A bitmap one byte short, and one byte long, for 9 elements.
        assert!(read(&[2, 1, 0, 0, 0, 0b1], 0, 9, &mut runs, &mut bits).is_err());
        assert!(read(&[2, 3, 0, 0, 0, 0b1, 0, 0], 0, 9, &mut runs, &mut bits).is_err());
        // runs 2 + 2 for 3 elements.
        assert!(read(&[1, 2, 0, 0, 0, 2, 2], 0, 3, &mut runs, &mut bits).is_err());
        // runs 1 + 0 + 2: an empty run after the first.
        assert!(read(&[1, 3, 0, 0, 0, 1, 0, 2], 0, 3, &mut runs, &mut bits).is_err());
        // runs 1 + 2: fine, one kept.
        let one_kept = MapRead {
            end: 7,
            kept: 1,
            skipped_runs: 1,
        };
        assert_eq!(
            read(&[1, 2, 0, 0, 0, 1, 2], 0, 3, &mut runs, &mut bits),
            Ok(one_kept)
        );
        // The same as a bitmap: elements 1 and 2 skipped.
        let bitmap = read(&[2, 1, 0, 0, 0, 0b110], 0, 3, &mut runs, &mut bits);
        assert_eq!(bitmap, Ok(MapRead { end: 6, ..one_kept }));
        assert_eq!(bits, [0b110]);
        // a length past the end.
        assert!(read(&[1, 9, 0, 0, 0, 1, 2], 0, 3, &mut runs, &mut bits).is_err());
    }
}
