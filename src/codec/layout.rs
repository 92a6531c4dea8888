//! Element layout transforms: sign-bit rotation, byte grouping and the
//! delta representations (per-stream XOR / byte difference, and the
//! whole-element ordered-integer difference).
//!
//! Every optimised routine here has a naive reference in the tests and is
//! checked against it on lengths that are not multiples of the width. The
//! hand-written AVX2 kernels of ungrouping (plain and against a base) and
//! of grouping against a base live with the codec's other kernels in
//! `simd`; the run-time choice of them stays here.
//!
//! Owns: how elements become streams and back, and each stream's delta
//! against the base (`StreamOp`). Must not: entropy code, or read frames.

use std::mem::MaybeUninit;

/// Rotate the top 16 bits of a float element left by one so the exponent
/// (bf16, f32, the top 8 exponent bits of f64) sits alone in the top byte and
/// the sign joins the top mantissa bits. For 8-bit floats the byte rotates.
#[inline(always)]
fn rot2(v: u16) -> u16 {
    v.rotate_left(1)
}
#[inline(always)]
fn unrot2(v: u16) -> u16 {
    v.rotate_right(1)
}

/// Make `v` at least `n` long, never shorter: a scratch buffer reused for
/// chunks of varying size is zero-filled only when it grows past its
/// largest size so far. Callers use `&v[..n]`.
pub fn grow(v: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if v.len() < n {
        v.resize(n, 0);
    }
    &mut v[..n]
}

/// Byte grouping: byte `k` of element `i` goes to `streams[k][i]`.
///
/// `raw.len()` must be `n * w` (the caller keeps a trailing partial element
/// aside). The streams are grown to at least `n` bytes (see [`grow`]) and
/// their first `n` bytes written: use `&streams[k][..n]`. With `rotate`, the
/// top 16 bits of each element (or the byte, for `w == 1`) are rotated left
/// by one bit first.
pub fn group(raw: &[u8], w: usize, rotate: bool, streams: &mut [Vec<u8>]) {
    let n = raw.len() / w;
    debug_assert_eq!(streams.len(), w);
    let mut parts: Vec<&mut [MaybeUninit<u8>]> = streams
        .iter_mut()
        .map(|s| {
            let s = grow(s, n);
            // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and
            // `group_parts` only ever writes initialised bytes, so the
            // stream stays initialised.
            unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), n) }
        })
        .collect();
    group_parts(raw, w, rotate, &mut parts);
}

/// [`group`] into one region of uninitialised memory, `w * n` bytes with
/// stream `k` at `out[k * n..(k + 1) * n]`: the encoder groups straight
/// into the frame, where most blocks of low mantissa bytes stay as they
/// are. Writes every byte of `out`.
pub fn group_uninit(raw: &[u8], w: usize, rotate: bool, out: &mut [MaybeUninit<u8>]) {
    let n = raw.len() / w;
    assert_eq!(out.len(), n * w, "w streams of n bytes");
    let mut parts: Vec<&mut [MaybeUninit<u8>]> = out.chunks_mut(n.max(1)).collect();
    parts.resize_with(w, Default::default);
    group_parts(raw, w, rotate, &mut parts);
}

/// Group `raw` (`n * w` bytes) into `w` parts of at least `n` bytes each,
/// writing the first `n` bytes of every part.
fn group_parts(raw: &[u8], w: usize, rotate: bool, parts: &mut [&mut [MaybeUninit<u8>]]) {
    let n = raw.len() / w;
    assert!(
        raw.len() == n * w && parts.len() == w && parts.iter().all(|p| p.len() >= n),
        "whole elements, and w parts of room for them"
    );
    match (w, parts) {
        (1, [s0]) => {
            for (d, &b) in s0.iter_mut().zip(raw) {
                d.write(if rotate { b.rotate_left(1) } else { b });
            }
        }
        (2, [s0, s1]) => {
            let done = group_simd::<2>(raw, [s0, s1], rotate);
            group2(&raw[2 * done..], &mut s0[done..], &mut s1[done..], rotate)
        }
        (4, [s0, s1, s2, s3]) => {
            let done = group_simd::<4>(raw, [s0, s1, s2, s3], rotate);
            let rest = [s0, s1, s2, s3].map(|p| &mut p[done..]);
            group4(&raw[4 * done..], rest, rotate)
        }
        (8, [s0, s1, s2, s3, s4, s5, s6, s7]) => {
            // Each part cut to exactly `n`: no bounds checks in the loop.
            let mut s = [s0, s1, s2, s3, s4, s5, s6, s7].map(|p| &mut p[..n]);
            // Eight elements at a time: an 8 x 8 byte transpose in
            // registers, one 8-byte store per stream.
            let whole = n / 8;
            for (g, block) in raw.chunks_exact(64).enumerate().take(whole) {
                let mut r: [u64; 8] = std::array::from_fn(|i| {
                    let v = u64::from_le_bytes(block[8 * i..8 * i + 8].try_into().expect("8"));
                    if rotate {
                        let hi = rot2((v >> 48) as u16) as u64;
                        (v & 0x0000_ffff_ffff_ffff) | (hi << 48)
                    } else {
                        v
                    }
                });
                transpose8(&mut r);
                for (p, v) in s.iter_mut().zip(r) {
                    p[8 * g..8 * g + 8].copy_from_slice(&v.to_le_bytes().map(MaybeUninit::new));
                }
            }
            let [s0, s1, s2, s3, s4, s5, s6, s7] = s.each_mut().map(|p| &mut p[8 * whole..]);
            let rest = &raw[64 * whole..];
            for (i, c) in rest.chunks_exact(8).enumerate().take(n - 8 * whole) {
                let mut v = u64::from_le_bytes(c.try_into().expect("chunk of 8"));
                if rotate {
                    let hi = rot2((v >> 48) as u16) as u64;
                    v = (v & 0x0000_ffff_ffff_ffff) | (hi << 48);
                }
                s0[i].write(v as u8);
                s1[i].write((v >> 8) as u8);
                s2[i].write((v >> 16) as u8);
                s3[i].write((v >> 24) as u8);
                s4[i].write((v >> 32) as u8);
                s5[i].write((v >> 40) as u8);
                s6[i].write((v >> 48) as u8);
                s7[i].write((v >> 56) as u8);
            }
        }
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

/// The leading elements of `raw` grouped into `s` by the AVX2 kernel
/// (a multiple of 32; none without AVX2); the caller groups the rest.
fn group_simd<const W: usize>(raw: &[u8], s: [&mut [MaybeUninit<u8>]; W], rotate: bool) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, just detected.
        return unsafe { super::simd::group_avx2::<W>(raw, s, rotate) };
    }
    let _ = (raw, s, rotate);
    0
}

/// Transpose the 8 x 8 bytes of `r` (byte `j` of word `i` becomes byte
/// `i` of word `j`) by swapping 4 x 4, 2 x 2, then 1 x 1 blocks.
#[inline(always)]
fn transpose8(r: &mut [u64; 8]) {
    // The pairs as constant arrays, which the compiler unrolls with `r`
    // in registers: as a loop filtering indices it kept `r` on the stack,
    // and grouping a 5 KiB chunk of 8-byte words took 12% of its encode.
    #[inline(always)]
    fn swap(r: &mut [u64; 8], i: usize, j: usize, shift: u32, mask: u64) {
        let t = ((r[i] >> shift) ^ r[j]) & mask;
        r[i] ^= t << shift;
        r[j] ^= t;
    }
    for (shift, mask, pairs) in [
        (32, 0x0000_0000_ffff_ffff, [(0, 4), (1, 5), (2, 6), (3, 7)]),
        (16, 0x0000_ffff_0000_ffff, [(0, 2), (1, 3), (4, 6), (5, 7)]),
        (8, 0x00ff_00ff_00ff_00ff, [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ] {
        for (i, j) in pairs {
            swap(r, i, j, shift, mask);
        }
    }
}

#[inline(always)]
fn group2_body(raw: &[u8], s0: &mut [MaybeUninit<u8>], s1: &mut [MaybeUninit<u8>], rotate: bool) {
    for ((c, a), b) in raw.chunks_exact(2).zip(s0.iter_mut()).zip(s1.iter_mut()) {
        let mut v = u16::from_le_bytes([c[0], c[1]]);
        if rotate {
            v = rot2(v);
        }
        a.write(v as u8);
        b.write((v >> 8) as u8);
    }
}

#[inline(always)]
fn group4_body(raw: &[u8], s: [&mut [MaybeUninit<u8>]; 4], rotate: bool) {
    let [s0, s1, s2, s3] = s;
    let it = raw
        .chunks_exact(4)
        .zip(s0.iter_mut())
        .zip(s1.iter_mut())
        .zip(s2.iter_mut())
        .zip(s3.iter_mut());
    for ((((c, a), b), d), e) in it {
        let mut v = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if rotate {
            v = (v & 0xffff) | ((rot2((v >> 16) as u16) as u32) << 16);
        }
        a.write(v as u8);
        b.write((v >> 8) as u8);
        d.write((v >> 16) as u8);
        e.write((v >> 24) as u8);
    }
}

dispatch!(group2, group2_body, (raw: &[u8], s0: &mut [MaybeUninit<u8>], s1: &mut [MaybeUninit<u8>], rotate: bool));
/// [`group_uninit`] of `raw` against `base` (the same `n * w` bytes of
/// the base) in one pass, into `out` (stream `k` at `k * n`): each byte of
/// every element after rotation expressed against the same byte of the
/// rotated base element by the per-stream ops of `masks`
/// ([`Against::ops`]): XORed, as the zigzagged byte difference, or kept.
/// The same as grouping both and applying each [`StreamOp`] to its
/// stream, without grouping the base; the inverse of
/// [`ungroup_against_uninit`]. Writes every byte of `out`.
pub fn group_against_uninit(
    raw: &[u8],
    base: &[u8],
    masks: [u64; 2],
    w: usize,
    rotate: bool,
    out: &mut [MaybeUninit<u8>],
) {
    let n = raw.len() / w;
    assert!(
        raw.len() == n * w && base.len() == n * w && out.len() == n * w,
        "n whole elements of raw and base, w streams of n bytes"
    );
    let mut parts: Vec<&mut [MaybeUninit<u8>]> = out.chunks_mut(n.max(1)).collect();
    parts.resize_with(w, Default::default);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        use super::simd;
        let (xor, diff) = (masks[0] as u32, masks[1] as u32);
        // SAFETY: the CPU has AVX2, just detected.
        done = unsafe {
            match &mut parts[..] {
                [s0, s1] => simd::group_against_avx2(raw, base, xor, diff, [s0, s1], rotate),
                [s0, s1, s2, s3] => {
                    simd::group_against_avx2(raw, base, xor, diff, [s0, s1, s2, s3], rotate)
                }
                _ => 0,
            }
        };
    }
    if done == n {
        return;
    }
    // The rest (all of it for other widths): group both, then the ops
    // stream by stream.
    let mut rest: Vec<&mut [MaybeUninit<u8>]> = parts.into_iter().map(|p| &mut p[done..]).collect();
    group_parts(&raw[w * done..], w, rotate, &mut rest);
    let m = n - done;
    let mut bs = vec![Vec::new(); w];
    group(&base[w * done..], w, rotate, &mut bs);
    for (k, (p, b)) in rest.iter_mut().zip(&bs).enumerate() {
        // SAFETY: `group_parts` initialised the first `m` bytes of every
        // part; MaybeUninit<u8> has the layout of u8.
        let t: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr().cast(), m) };
        let byte = |mask: u64| (mask >> (8 * k)) & 0xff != 0;
        if byte(masks[0]) {
            xor_into(t, &b[..m]);
        } else if byte(masks[1]) {
            diff_into(t, &b[..m]);
        }
    }
}

dispatch!(group4, group4_body, (raw: &[u8], s: [&mut [MaybeUninit<u8>]; 4], rotate: bool));
dispatch!(xor_into, xor_body, (dst: &mut [u8], src: &[u8]));
dispatch!(diff_into, diff_body, (dst: &mut [u8], src: &[u8]));

/// The context stream of a delta frame: the top byte of every element of
/// the base after rotation (for floats: the exponent; for integers: the
/// most significant byte). `raw` is `n * w` bytes; `out` becomes `n` bytes.
pub fn context_bytes(raw: &[u8], w: usize, float: bool, out: &mut Vec<u8>) {
    let n = raw.len() / w;
    context_bytes_into(raw, w, float, &mut grow(out, n)[..n]);
}

/// [`context_bytes`] into `out`, exactly `raw.len() / w` bytes.
pub fn context_bytes_into(raw: &[u8], w: usize, float: bool, out: &mut [u8]) {
    assert_eq!(out.len(), raw.len() / w, "one context byte per element");
    match w {
        1 => {
            for (o, &b) in out.iter_mut().zip(raw) {
                *o = if float { b.rotate_left(1) } else { b };
            }
        }
        2 => context2(raw, out, float),
        4 => context4(raw, out, float),
        _ => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(w)) {
                *o = top_byte(u16::from_le_bytes([c[w - 2], c[w - 1]]), float);
            }
        }
    }
}

/// The top byte of the top 16 bits `hi` of an element, after rotation for
/// a float: `rot2(hi) >> 8`, which is `hi >> 7` (the bit rotated in lands
/// in the low byte).
#[inline(always)]
fn top_byte(hi: u16, float: bool) -> u8 {
    if float {
        (hi >> 7) as u8
    } else {
        (hi >> 8) as u8
    }
}

#[inline(always)]
fn context2_body(raw: &[u8], out: &mut [u8], float: bool) {
    for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
        *o = top_byte(u16::from_le_bytes([c[0], c[1]]), float);
    }
}

#[inline(always)]
fn context4_body(raw: &[u8], out: &mut [u8], float: bool) {
    // `top_byte` of the element's top 16 bits, as one shift of the whole
    // element (which the compiler vectorises: shift, then pack).
    let shift = if float { 23 } else { 24 };
    for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
        *o = (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) >> shift) as u8;
    }
}

dispatch!(context2, context2_body, (raw: &[u8], out: &mut [u8], float: bool));
dispatch!(context4, context4_body, (raw: &[u8], out: &mut [u8], float: bool));

/// Inverse of [`group`]: interleave `w` streams of `n` bytes into `out`
/// (`n * w` bytes), undoing the rotation.
pub fn ungroup(streams: &[&[u8]], w: usize, rotate: bool, out: &mut [u8]) {
    let n = out.len() / w;
    debug_assert_eq!(out.len(), n * w);
    debug_assert!(streams.iter().all(|s| s.len() == n));
    match w {
        1 if !rotate => out.copy_from_slice(streams[0]),
        1 => {
            for (d, &b) in out.iter_mut().zip(streams[0]) {
                *d = b.rotate_right(1);
            }
        }
        2 | 4 => {
            // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and
            // `ungroup_uninit` only ever writes initialised bytes, so `out`
            // stays initialised.
            let out: &mut [MaybeUninit<u8>] =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), out.len()) };
            ungroup_uninit(streams, w, rotate, out)
        }
        8 => {
            // Each stream cut to exactly `n`: no bounds checks in the loop.
            let s: [&[u8]; 8] = std::array::from_fn(|k| &streams[k][..n]);
            let unrotated = |v: u64| {
                if rotate {
                    let hi = unrot2((v >> 48) as u16) as u64;
                    (v & 0x0000_ffff_ffff_ffff) | (hi << 48)
                } else {
                    v
                }
            };
            // Eight elements at a time: one 8-byte load per stream, the
            // 8 x 8 byte transpose of grouping (its own inverse).
            let whole = n / 8;
            for (g, block) in out.chunks_exact_mut(64).enumerate().take(whole) {
                let mut r: [u64; 8] = std::array::from_fn(|k| {
                    u64::from_le_bytes(s[k][8 * g..8 * g + 8].try_into().expect("8"))
                });
                transpose8(&mut r);
                for (c, v) in block.chunks_exact_mut(8).zip(r) {
                    c.copy_from_slice(&unrotated(v).to_le_bytes());
                }
            }
            for (i, c) in out.chunks_exact_mut(8).enumerate().skip(8 * whole) {
                let v = (0..8).fold(0u64, |v, k| v | (s[k][i] as u64) << (8 * k));
                c.copy_from_slice(&unrotated(v).to_le_bytes());
            }
        }
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

/// [`ungroup`] into uninitialised memory: writes every byte of `out`
/// (`n * w` of them; every stream must hold exactly `n`).
pub fn ungroup_uninit(streams: &[&[u8]], w: usize, rotate: bool, out: &mut [MaybeUninit<u8>]) {
    let n = out.len() / w;
    assert_eq!(out.len(), n * w, "whole elements");
    assert!(
        streams.len() == w && streams.iter().all(|s| s.len() == n),
        "w streams of n symbols: every output byte is written"
    );
    match w {
        2 => ungroup2_uninit(streams[0], streams[1], out, rotate),
        4 => ungroup4_uninit(
            [streams[0], streams[1], streams[2], streams[3]],
            out,
            rotate,
        ),
        _ => {
            // Other widths are rare: fill, then interleave as usual.
            out.fill(MaybeUninit::new(0));
            // SAFETY: every byte was just initialised, and MaybeUninit<u8>
            // has the layout of u8.
            let out: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, out.len()) };
            ungroup(streams, w, rotate, out);
        }
    }
}

#[inline(always)]
fn ungroup2_uninit_body(s0: &[u8], s1: &[u8], out: &mut [MaybeUninit<u8>], rotate: bool) {
    for ((c, &a), &b) in out.chunks_exact_mut(2).zip(s0).zip(s1) {
        let mut v = u16::from_le_bytes([a, b]);
        if rotate {
            v = unrot2(v);
        }
        c.copy_from_slice(&v.to_le_bytes().map(MaybeUninit::new));
    }
}

#[inline(always)]
fn ungroup4_uninit_body(s: [&[u8]; 4], out: &mut [MaybeUninit<u8>], rotate: bool) {
    let [s0, s1, s2, s3] = s;
    let it = out.chunks_exact_mut(4).zip(s0).zip(s1).zip(s2).zip(s3);
    for ((((c, &a), &b), &d), &e) in it {
        let mut v = u32::from_le_bytes([a, b, d, e]);
        if rotate {
            v = (v & 0xffff) | ((unrot2((v >> 16) as u16) as u32) << 16);
        }
        c.copy_from_slice(&v.to_le_bytes().map(MaybeUninit::new));
    }
}

dispatch!(ungroup2_uninit, ungroup2_uninit_body, (s0: &[u8], s1: &[u8], out: &mut [MaybeUninit<u8>], rotate: bool));
dispatch!(ulp_delta_kernel, ulp_delta_body, (new: &[u8], base: &[u8], w: usize, float: bool, out: &mut [u8]));
dispatch!(ulp_undelta_kernel, ulp_undelta_body, (z: &mut [u8], base: &[u8], w: usize, float: bool));
dispatch!(ungroup4_rest, ungroup4_uninit_body, (s: [&[u8]; 4], out: &mut [MaybeUninit<u8>], rotate: bool));

/// Four streams into 4-byte elements: 32 elements at a time by byte and
/// word unpacks where the CPU has AVX2 (the compiler's own vectorisation
/// widens each byte separately, about three times the instructions), the
/// rest by [`ungroup4_uninit_body`].
fn ungroup4_uninit(s: [&[u8]; 4], out: &mut [MaybeUninit<u8>], rotate: bool) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, just detected.
        done = unsafe { super::simd::ungroup4_avx2(s, out, rotate) };
    }
    ungroup4_rest(s.map(|t| &t[done..]), &mut out[4 * done..], rotate);
}

/// How [`ungroup_against_uninit`] combines each element with the base's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Against {
    /// Per-stream ops, as byte masks (see [`Against::ops`]).
    Ops([u64; 2]),
    /// The whole-element ULP difference ([`ulp_delta`]), of floats or not.
    Ulp { float: bool },
}

impl Against {
    /// The per-stream `ops` as byte masks `[xor, diff]`, each with byte `j`
    /// set when stream `j % w` has that op (repeated over 8 bytes, so the
    /// 32-bit kernels see whole elements).
    pub fn ops(ops: &[StreamOp]) -> Against {
        let w = ops.len().max(1);
        let mask = |op: StreamOp| -> u64 {
            (0..8)
                .filter(|&j| ops.get(j % w) == Some(&op))
                .fold(0, |m, j| m | 0xff << (8 * j))
        };
        Against::Ops([mask(StreamOp::Xor), mask(StreamOp::Diff)])
    }
}

/// [`ungroup_uninit`] of delta streams in one pass: each element undone
/// against the same element of `base` (`n * w` bytes) as `how` says. With
/// per-stream ops, stream `k` holds byte `k` of every element expressed
/// against the base's (after rotation): each byte is undone against the
/// same byte of the rotated base element, then the element unrotated; the
/// same as undoing each stream against the grouped base and ungrouping,
/// without grouping the base or writing the streams twice. With the ULP
/// difference, the same as ungrouping, then [`ulp_undelta`]. Writes every
/// byte of `out`.
pub fn ungroup_against_uninit(
    streams: &[&[u8]],
    how: Against,
    base: &[u8],
    w: usize,
    rotate: bool,
    out: &mut [MaybeUninit<u8>],
) {
    let n = out.len() / w;
    assert!(
        out.len() == n * w
            && base.len() == n * w
            && streams.len() == w
            && streams.iter().all(|s| s.len() == n),
        "w streams, n whole elements of base and output"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if n >= 32 && std::arch::is_x86_feature_detected!("avx2") {
        use super::simd;
        let k = match how {
            Against::Ops([xor, diff]) => simd::Against::Ops {
                xor: xor as u32,
                diff: diff as u32,
            },
            Against::Ulp { float } => simd::Against::Ulp { float },
        };
        // SAFETY: the CPU has AVX2, just detected.
        done = unsafe {
            match *streams {
                [a, b] => simd::ungroup2_against_avx2([a, b], base, k, out, rotate),
                [a, b, c, d] => simd::ungroup4_against_avx2([a, b, c, d], base, k, out, rotate),
                _ => 0,
            }
        };
    }
    if done == n {
        return;
    }
    let mut rest: [&[u8]; 8] = [&[]; 8];
    for (r, s) in rest.iter_mut().zip(streams) {
        *r = &s[done..];
    }
    let (rest, base, out) = (&rest[..w], &base[w * done..], &mut out[w * done..]);
    match how {
        // One stream (1-byte elements): a loop the compiler vectorises.
        Against::Ops([xor, diff]) if w == 1 => {
            ungroup1_against(rest[0], base, xor as u8, diff as u8, rotate, out)
        }
        Against::Ops(masks) => ungroup_against_rest(rest, base, masks, w, rotate, out),
        Against::Ulp { float } => {
            ungroup_uninit(rest, w, rotate, out);
            // SAFETY: the ungrouping just wrote every byte of `out`, and
            // MaybeUninit<u8> has the layout of u8.
            let out: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), out.len()) };
            ulp_undelta(out, base, w, float);
        }
    }
}

#[inline(always)]
fn ungroup_against_body(
    streams: &[&[u8]],
    base: &[u8],
    masks: [u64; 2],
    w: usize,
    rotate: bool,
    out: &mut [MaybeUninit<u8>],
) {
    // Per element, as an integer of the element's width: the bytes from
    // the streams, the rotated base, then per byte (no carries between
    // bytes) `r ^ b` under the XOR mask and `b + unzigzag(r)` under the
    // difference mask.
    macro_rules! body {
        ($t:ty) => {{
            let ones = <$t>::MAX / 0xff;
            let low7 = ones * 0x7f;
            let top = ones * 0x80;
            let (xor, diff) = (masks[0] as $t, masks[1] as $t);
            let hi = 8 * (w as u32).saturating_sub(2);
            let rot = |v: $t, left: bool| -> $t {
                if !rotate {
                    return v;
                }
                if w == 1 {
                    return if left {
                        v.rotate_left(1)
                    } else {
                        v.rotate_right(1)
                    };
                }
                let h = (v >> hi) as u16;
                let h = if left { rot2(h) } else { unrot2(h) };
                (v & !((u16::MAX as $t) << hi)) | ((h as $t) << hi)
            };
            for (i, (o, b)) in out
                .chunks_exact_mut(w)
                .zip(base.chunks_exact(w))
                .enumerate()
            {
                let mut r: $t = 0;
                for (k, s) in streams.iter().enumerate() {
                    r |= (s[i] as $t) << (8 * k);
                }
                let b = rot(<$t>::from_le_bytes(b.try_into().expect("width")), true);
                let x = r ^ (b & xor);
                let u = ((r >> 1) & low7) ^ ((r & ones) * 0xff);
                let d = ((b & low7) + (u & low7)) ^ ((b ^ u) & top);
                let v = rot((d & diff) | (x & !diff), false);
                o.copy_from_slice(&v.to_le_bytes().map(MaybeUninit::new));
            }
        }};
    }
    match w {
        1 => body!(u8),
        2 => body!(u16),
        4 => body!(u32),
        8 => body!(u64),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

/// [`ungroup_against_body`] of 1-byte elements: `xor` and `diff` are the
/// one stream's masks (0 or 0xff). Its generic loop, element by element
/// through the stream slices, ran int8 and fp8 deltas at ~0.5 GB/s.
#[inline(always)]
fn ungroup1_against_body(
    s: &[u8],
    base: &[u8],
    xor: u8,
    diff: u8,
    rotate: bool,
    out: &mut [MaybeUninit<u8>],
) {
    for ((o, &r), &b) in out.iter_mut().zip(s).zip(base) {
        let b = if rotate { b.rotate_left(1) } else { b };
        let x = r ^ (b & xor);
        let d = b.wrapping_add((r >> 1) ^ (r & 1).wrapping_neg());
        let v = (d & diff) | (x & !diff);
        *o = MaybeUninit::new(if rotate { v.rotate_right(1) } else { v });
    }
}

dispatch!(ungroup1_against, ungroup1_against_body, (s: &[u8], base: &[u8], xor: u8, diff: u8, rotate: bool, out: &mut [MaybeUninit<u8>]));

dispatch!(ungroup_against_rest, ungroup_against_body, (streams: &[&[u8]], base: &[u8], masks: [u64; 2], w: usize, rotate: bool, out: &mut [MaybeUninit<u8>]));

#[inline(always)]
fn xor_body(dst: &mut [u8], src: &[u8]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d ^= s;
    }
}
#[inline(always)]
fn diff_body(dst: &mut [u8], src: &[u8]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        let v = d.wrapping_sub(s) as i8;
        *d = ((v << 1) ^ (v >> 7)) as u8;
    }
}
#[cfg(test)]
fn undiff_body(dst: &mut [u8], src: &[u8]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        let z = *d;
        let v = (z >> 1) ^ (z & 1).wrapping_neg();
        *d = s.wrapping_add(v);
    }
}

/// How one grouped stream is expressed against the base's same stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamOp {
    /// The stream as it is (no delta).
    Keep = 0,
    /// XOR with the base stream.
    Xor = 1,
    /// Zigzagged byte difference: `zigzag(new - base)` with the difference
    /// taken as an `i8` (mod 256), so small changes either way are small
    /// symbols (for the exponent stream: the exponent change, 0, 1, 2, ...).
    Diff = 2,
}

impl StreamOp {
    pub fn from_code(c: u8) -> Option<StreamOp> {
        match c {
            0 => Some(StreamOp::Keep),
            1 => Some(StreamOp::Xor),
            2 => Some(StreamOp::Diff),
            _ => None,
        }
    }
    /// Apply to `s` (the new stream) given `b` (the base stream).
    pub fn apply(self, s: &mut [u8], b: &[u8]) {
        match self {
            StreamOp::Keep => {}
            StreamOp::Xor => xor_into(s, b),
            StreamOp::Diff => diff_into(s, b),
        }
    }
    /// Undo [`StreamOp::apply`] on one stream: the definition
    /// [`ungroup_against_uninit`] is tested against (the decoder undoes
    /// every stream in that one pass).
    #[cfg(test)]
    pub fn undo(self, s: &mut [u8], b: &[u8]) {
        match self {
            StreamOp::Keep => {}
            StreamOp::Xor => xor_into(s, b),
            StreamOp::Diff => undiff_body(s, b),
        }
    }
}

/// Whole-element delta: `zigzag(ord(new) - ord(base))` per element, where
/// `ord` maps a float's bit pattern to an integer of the same order as the
/// value (so the difference counts ULPs) and is the identity for integers.
/// Little-endian output of the same width, `n * w` bytes.
pub fn ulp_delta(new: &[u8], base: &[u8], w: usize, float: bool, out: &mut Vec<u8>) {
    let out = grow(out, new.len());
    ulp_delta_kernel(new, base, w, float, out);
}

#[inline(always)]
fn ulp_delta_body(new: &[u8], base: &[u8], w: usize, float: bool, out: &mut [u8]) {
    macro_rules! body {
        ($t:ty, $it:ty, $n:expr) => {{
            let bits = <$t>::BITS;
            let sign: $t = 1 << (bits - 1);
            let ord = |v: $t| -> $t {
                if !float {
                    v
                } else if v & sign != 0 {
                    !v
                } else {
                    v | sign
                }
            };
            for ((o, a), b) in out
                .chunks_exact_mut($n)
                .zip(new.chunks_exact($n))
                .zip(base.chunks_exact($n))
            {
                let a = <$t>::from_le_bytes(a.try_into().expect("width"));
                let b = <$t>::from_le_bytes(b.try_into().expect("width"));
                let d = ord(a).wrapping_sub(ord(b)) as $it;
                let z = ((d << 1) ^ (d >> (bits - 1))) as $t;
                o.copy_from_slice(&z.to_le_bytes());
            }
        }};
    }
    match w {
        1 => body!(u8, i8, 1),
        2 => body!(u16, i16, 2),
        4 => body!(u32, i32, 4),
        8 => body!(u64, i64, 8),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

/// Inverse of [`ulp_delta`]: `z` holds the zigzagged differences and is
/// overwritten with the new elements.
pub fn ulp_undelta(z: &mut [u8], base: &[u8], w: usize, float: bool) {
    ulp_undelta_kernel(z, base, w, float);
}

#[inline(always)]
fn ulp_undelta_body(z: &mut [u8], base: &[u8], w: usize, float: bool) {
    macro_rules! body {
        ($t:ty, $it:ty, $n:expr) => {{
            let bits = <$t>::BITS;
            let sign: $t = 1 << (bits - 1);
            for (o, b) in z.chunks_exact_mut($n).zip(base.chunks_exact($n)) {
                let zz = <$t>::from_le_bytes((&*o).try_into().expect("width"));
                let b = <$t>::from_le_bytes(b.try_into().expect("width"));
                let d = ((zz >> 1) as $it ^ -((zz & 1) as $it)) as $t;
                let ob = if !float {
                    b
                } else if b & sign != 0 {
                    !b
                } else {
                    b | sign
                };
                let on = ob.wrapping_add(d);
                let v = if !float {
                    on
                } else if on & sign != 0 {
                    on & !sign
                } else {
                    !on
                };
                o.copy_from_slice(&v.to_le_bytes());
            }
        }};
    }
    match w {
        1 => body!(u8, i8, 1),
        2 => body!(u16, i16, 2),
        4 => body!(u32, i32, 4),
        8 => body!(u64, i64, 8),
        _ => unreachable!("element width is 1, 2, 4 or 8"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The obvious bit-by-bit definition the fast kernels must agree with.
    fn naive_group(raw: &[u8], w: usize, rotate: bool) -> Vec<Vec<u8>> {
        let n = raw.len() / w;
        let mut out = vec![Vec::new(); w];
        for i in 0..n {
            let mut e = raw[i * w..(i + 1) * w].to_vec();
            if rotate {
                if w == 1 {
                    let b = e[0];
                    #[allow(clippy::manual_rotate)] // the definition, spelled out
                    let r = (b << 1) | (b >> 7);
                    e[0] = r;
                } else {
                    // top 16 bits: bytes w-2 (low) and w-1 (high)
                    let hi = ((e[w - 1] as u32) << 8) | e[w - 2] as u32;
                    let sign = hi >> 15;
                    let r = ((hi << 1) & 0xffff) | sign;
                    e[w - 2] = r as u8;
                    e[w - 1] = (r >> 8) as u8;
                }
            }
            for k in 0..w {
                out[k].push(e[k]);
            }
        }
        out
    }

    fn check_group(raw: &[u8], w: usize, rotate: bool) {
        let n = raw.len() / w;
        let body = &raw[..n * w];
        let mut streams = vec![vec![0xAAu8; 7]; w]; // stale bytes beyond n stay
        group(body, w, rotate, &mut streams);
        let streams: Vec<Vec<u8>> = streams.iter().map(|s| s[..n].to_vec()).collect();
        assert_eq!(streams, naive_group(body, w, rotate));
        let mut region: Vec<u8> = Vec::with_capacity(n * w);
        group_uninit(body, w, rotate, &mut region.spare_capacity_mut()[..n * w]);
        // SAFETY: group_uninit writes all n * w bytes.
        unsafe { region.set_len(n * w) };
        assert_eq!(region, streams.concat());
        let refs: Vec<&[u8]> = streams.iter().map(|s| s.as_slice()).collect();
        let mut back = vec![0u8; n * w];
        ungroup(&refs, w, rotate, &mut back);
        assert_eq!(back, body);
        let mut fresh: Vec<u8> = Vec::with_capacity(n * w);
        ungroup_uninit(&refs, w, rotate, &mut fresh.spare_capacity_mut()[..n * w]);
        // SAFETY: ungroup_uninit writes all n * w bytes.
        unsafe { fresh.set_len(n * w) };
        assert_eq!(fresh, body);
    }

    #[test]
    fn bf16_rotation_puts_the_exponent_in_one_byte() {
        // -1.5 in bf16 = 0xBFC0: sign 1, exponent 0x7F, mantissa 0x40
        let mut s = vec![Vec::new(), Vec::new()];
        group(&0xBFC0u16.to_le_bytes(), 2, true, &mut s);
        assert_eq!(s[1], vec![0x7F]);
        assert_eq!(s[0], vec![0x81]); // mantissa 0x40 << 1 | sign
                                      // f32 1.0 = 0x3F800000: exponent 0x7F in the top stream, low bytes untouched
        let mut s = vec![Vec::new(); 4];
        group(&0xBF80_1234u32.to_le_bytes(), 4, true, &mut s);
        assert_eq!(
            (s[3][0], s[2][0], s[1][0], s[0][0]),
            (0x7F, 0x01, 0x12, 0x34)
        );
    }

    proptest! {
        #[test]
        fn group_matches_naive(raw in proptest::collection::vec(any::<u8>(), 0..600), rotate: bool) {
            for w in [1, 2, 4, 8] {
                check_group(&raw, w, rotate);
            }
        }

        #[test]
        fn ulp_delta_round_trips(a in proptest::collection::vec(any::<u8>(), 0..256),
                                 b in proptest::collection::vec(any::<u8>(), 0..256), float: bool) {
            let n = a.len().min(b.len()) / 8 * 8;
            for w in [1, 2, 4, 8] {
                let mut z = Vec::new();
                ulp_delta(&a[..n], &b[..n], w, float, &mut z);
                ulp_undelta(&mut z, &b[..n], w, float);
                prop_assert_eq!(&z[..], &a[..n]);
            }
        }

        #[test]
        fn stream_ops_round_trip(a in proptest::collection::vec(any::<u8>(), 0..300), op in 0u8..3) {
            let b: Vec<u8> = a.iter().map(|x| x.wrapping_mul(7).wrapping_add(3)).collect();
            let op = StreamOp::from_code(op).unwrap();
            let mut s = a.clone();
            op.apply(&mut s, &b);
            op.undo(&mut s, &b);
            prop_assert_eq!(s, a);
        }
    }

    proptest! {
        /// The encoder's one-pass group-and-apply and the decoder's
        /// one-pass undo-and-ungroup agree with their definitions (group
        /// both, apply each stream's op against the base's stream; group
        /// the base, undo each stream, ungroup; or ungroup, then undo the
        /// ULP difference) for every width, every op per stream, rotated
        /// or not, on lengths around the kernels' 32-element groups.
        #[test]
        fn grouping_against_a_base_matches_its_definition(
            raw in proptest::collection::vec(any::<u8>(), 0..700),
            base in proptest::collection::vec(any::<u8>(), 700),
            codes in proptest::collection::vec(0u8..3, 8),
            rotate: bool,
        ) {
            for w in [1, 2, 4, 8] {
                let n = raw.len() / w;
                let ops: Vec<StreamOp> = codes[..w].iter().map(|&c| StreamOp::from_code(c).unwrap()).collect();
                let b = &base[..n * w];
                let mut bs = vec![Vec::new(); w];
                group(b, w, rotate, &mut bs);
                let streams = naive_group(&raw[..n * w], w, rotate);
                let coded: Vec<Vec<u8>> = streams.iter().zip(&ops).zip(&bs).map(|((s, op), bk)| {
                    let mut s = s.clone();
                    op.apply(&mut s, &bk[..n]);
                    s
                }).collect();
                // The encoder's one pass gives those streams.
                let mut region: Vec<u8> = Vec::with_capacity(n * w);
                let Against::Ops(masks) = Against::ops(&ops) else { unreachable!() };
                group_against_uninit(&raw[..n * w], b, masks, w, rotate, &mut region.spare_capacity_mut()[..n * w]);
                // SAFETY: group_against_uninit writes all n * w bytes.
                unsafe { region.set_len(n * w) };
                prop_assert_eq!(&region, &coded.concat());
                let refs: Vec<&[u8]> = coded.iter().map(|s| s.as_slice()).collect();
                let mut out: Vec<u8> = Vec::with_capacity(n * w);
                ungroup_against_uninit(&refs, Against::ops(&ops), b, w, rotate, &mut out.spare_capacity_mut()[..n * w]);
                // SAFETY: ungroup_against_uninit writes all n * w bytes.
                unsafe { out.set_len(n * w) };
                prop_assert_eq!(&out[..], &raw[..n * w]);
                // The whole-element ULP difference: ungrouped, then added
                // to the base's ordered integers.
                for float in [false, true] {
                    let mut z = Vec::new();
                    ulp_delta(&raw[..n * w], b, w, float, &mut z);
                    let zs = naive_group(&z[..n * w], w, rotate);
                    let refs: Vec<&[u8]> = zs.iter().map(|s| s.as_slice()).collect();
                    let mut out: Vec<u8> = Vec::with_capacity(n * w);
                    let how = Against::Ulp { float };
                    ungroup_against_uninit(&refs, how, b, w, rotate, &mut out.spare_capacity_mut()[..n * w]);
                    // SAFETY: ungroup_against_uninit writes all n * w bytes.
                    unsafe { out.set_len(n * w) };
                    prop_assert_eq!(&out[..], &raw[..n * w]);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn context_bytes_match_naive(raw in proptest::collection::vec(any::<u8>(), 0..600), float: bool) {
            for w in [1, 2, 4, 8] {
                let n = raw.len() / w;
                let mut out = vec![0xAA; 3];
                context_bytes(&raw[..n * w], w, float, &mut out);
                // The definition: byte w-1 of the element after rotation
                // (floats) or as it is.
                let streams = naive_group(&raw[..n * w], w, float);
                prop_assert_eq!(&out[..n], &streams[w - 1][..]);
            }
        }
    }

    #[test]
    fn ulp_delta_of_neighbouring_floats_is_small() {
        let a: Vec<u8> = [1.0f32, -2.0, 0.0]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let b: Vec<u8> = [f32::from_bits(1.0f32.to_bits() + 3), -2.0, -0.0]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let mut z = Vec::new();
        ulp_delta(&a, &b, 4, true, &mut z);
        let zs: Vec<u32> = z
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // -3 ulps -> zigzag 5; equal -> 0; +0 vs -0 are adjacent in order -> 1 -> zigzag 2
        assert_eq!(zs, vec![5, 0, 2]);
    }
}
