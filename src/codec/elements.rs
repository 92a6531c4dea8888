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

impl Runs<'_> {
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
    runs.clear();
    let mut r = Runs {
        runs,
        skipping: false,
        run: 0,
        skipped: 0,
    };
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
    let skipped = r.skipped;
    r.runs.push(r.run);
    skipped
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
    let r: usize = runs.iter().map(|&v| leb_len(v)).sum();
    let b = n.div_ceil(8);
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
/// stay in the streams).
pub fn worth_it(skipped: usize, n: usize, w: usize, map_bytes: usize) -> bool {
    skipped * 16 >= n && map_bytes * 8 <= skipped * w
}

/// Append the map section (`kind u8 | length u32 | data`).
pub fn write(runs: &[u32], n: usize, out: &mut Vec<u8>) {
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
            out.resize(start + len, 0);
            let bits = &mut out[start..];
            let mut i = 0usize;
            for (r, &len) in runs.iter().enumerate() {
                if r % 2 == 1 {
                    for j in i..i + len as usize {
                        bits[j / 8] |= 1 << (j % 8);
                    }
                }
                i += len as usize;
            }
        }
    }
    debug_assert_eq!(out.len(), start + len);
}

/// Parse the map section at `frame[pos..]` for `n` elements into `runs`;
/// returns the position after it and the number of kept elements.
pub fn read(
    frame: &[u8],
    pos: usize,
    n: usize,
    runs: &mut Vec<u32>,
) -> Result<(usize, usize), DecodeError> {
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
    let mut kept = 0usize;
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
        }
        2 => {
            if len != n.div_ceil(8) {
                return Err(corrupt(pos + 1, "element bitmap length"));
            }
            if n % 8 != 0 && data.last().is_some_and(|&b| b >> (n % 8) != 0) {
                return Err(corrupt(start + len - 1, "element bitmap padding set"));
            }
            let (mut skipping, mut run) = (false, 0u32);
            for i in 0..n {
                let s = data[i / 8] >> (i % 8) & 1 != 0;
                if s != skipping {
                    runs.push(run);
                    run = 0;
                    skipping = s;
                }
                run += 1;
                kept += !s as usize;
            }
            runs.push(run);
        }
        _ => return Err(corrupt(pos, "unknown element map kind")),
    }
    Ok((start + len, kept))
}

/// The kept elements of `raw` (`n * w` bytes) by `runs`, back to back, into
/// `out` (cleared first): what the encoder codes. The decoder puts them
/// back piece by piece ([`kept_pieces`], [`fill_skipped`]), or for a
/// scattered map gathers the base's the same way and [`expand`]s.
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

/// One kept run of an element map, as the decoder places it: `len`
/// elements that are `at..at + len` of the compacted (kept) elements and
/// `to..to + len` of the chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub at: usize,
    pub to: usize,
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
            pieces.push(Piece { at, to, len });
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

/// Undo [`compact`] in place: `out` holds the kept elements in its first
/// `kept * w` bytes and is `n * w` long; the skipped elements become the
/// base's (when given) or zero. Walks back to front, so every kept run
/// moves up (or stays). For scattered maps; the decoder places long runs
/// straight where they belong ([`kept_pieces`]).
pub fn expand(out: &mut [u8], kept: usize, runs: &[u32], base: Option<&[u8]>, w: usize) {
    let (mut src, mut dst) = (kept * w, out.len());
    for (r, &len) in runs.iter().enumerate().rev() {
        let len = len as usize * w;
        if r % 2 == 0 {
            if src != dst {
                out.copy_within(src - len..src, dst - len);
            }
            src -= len;
        } else {
            match base {
                Some(b) => out[dst - len..dst].copy_from_slice(&b[dst - len..dst]),
                None => out[dst - len..dst].fill(0),
            }
        }
        dst -= len;
    }
    debug_assert_eq!((src, dst), (0, 0));
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
            mask in proptest::collection::vec(prop_oneof![3 => Just(true), 1 => Just(false)], 0..600),
            w in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            with_base in any::<bool>(),
        ) {
            let n = mask.len();
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
            write(&runs, n, &mut sec);
            let mut back = Vec::new();
            let (end, kept) = read(&sec, 0, n, &mut back).unwrap();
            prop_assert_eq!(end, sec.len());
            prop_assert_eq!(kept, n - skipped);
            prop_assert_eq!(&back, &runs);
            let mut c = Vec::new();
            compact(&raw, &runs, w, &mut c);
            prop_assert_eq!(c.len(), kept * w);
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
            // And for scattered maps: moved up in place.
            c.resize(n * w, 0xEE);
            expand(&mut c, kept, &runs, b, w);
            prop_assert_eq!(c, raw);
        }
    }

    #[test]
    fn bitmap_padding_and_overlong_runs_are_corrupt() {
        let mut runs = Vec::new();
        // 3 elements, bitmap with padding bit 3 set.
        assert!(read(&[2, 1, 0, 0, 0, 0b1000], 0, 3, &mut runs).is_err());
        // runs 2 + 2 for 3 elements.
        assert!(read(&[1, 2, 0, 0, 0, 2, 2], 0, 3, &mut runs).is_err());
        // runs 1 + 0 + 2: an empty run after the first.
        assert!(read(&[1, 3, 0, 0, 0, 1, 0, 2], 0, 3, &mut runs).is_err());
        // runs 1 + 2: fine, one kept.
        assert_eq!(read(&[1, 2, 0, 0, 0, 1, 2], 0, 3, &mut runs), Ok((7, 1)));
        // a length past the end.
        assert!(read(&[1, 9, 0, 0, 0, 1, 2], 0, 3, &mut runs).is_err());
    }
}
