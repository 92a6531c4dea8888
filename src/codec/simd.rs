//! Every `#[target_feature]` kernel of the codec, in one place: the
//! [`dispatch!`] macro (an AVX2 build of a portable loop, chosen at run
//! time), the hand-written AVX2 kernels of rANS with 8 or 32 states (encode and
//! decode of whole groups), of byte ungrouping (four streams into 4-byte
//! elements; two or four streams undone against a base's elements, by
//! per-byte ops or the ULP difference), of grouping against a base
//! (4- or 2-byte elements into streams, the per-byte ops applied) and of
//! the element map's scan (skip masks of 64 elements).
//!
//! Owns: the unsafe code that runs with CPU features enabled, and the
//! argument checks that keep every raw load, store and gather of those
//! kernels in bounds whatever the caller passes. Each kernel's only safety
//! precondition is that the CPU has the features it was compiled for; the
//! callers (`rans`, `layout`, `elements`) detect them at run time and keep
//! the scalar loop that does the same work everywhere else, and the tests
//! beside those callers compare the two on the same inputs.
//!
//! Must not: know the frame format beyond the shapes its kernels take (the
//! rANS state count and slot tables, checked against `rans` at compile time
//! there). A leaf apart from [`super::stats`]'s probability scale.

use super::stats::SCALE_BITS;

/// Runtime dispatch to an AVX2 build of a kernel when the CPU has it; the
/// portable build is the same source compiled for the baseline target.
/// `dispatch!(name, body, (args) -> ret)` defines `fn name(args) -> ret`
/// calling `body` (a safe `#[inline(always)]` fn, so it is compiled into
/// both builds).
macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        dispatch!($name, $body, ($($arg: $ty),*) -> ());
    };
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*) -> $ret:ty) => {
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                /// The body compiled with AVX2, BMI1 and BMI2.
                ///
                /// # Safety
                /// The CPU must support `avx2`, `bmi1` and `bmi2`. The body
                /// itself is safe code.
                #[target_feature(enable = "avx2,bmi1,bmi2")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("bmi1")
                    && std::arch::is_x86_feature_detected!("bmi2")
                {
                    // SAFETY: the CPU supports the features `avx2` was
                    // compiled for, just detected.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

/// States of a wide rANS block, as the kernels hold them: four registers of
/// eight u32.
pub(crate) const RANS_WIDE: usize = 32;
/// Slot tables a rANS decode kernel indexes: up to eight classes of
/// `2^SCALE_BITS` slots (`class << 12 | slot`).
pub(crate) const RANS_CLASSES: usize = 8;
pub(crate) const RANS_ALL_SLOTS: usize = RANS_CLASSES << SCALE_BITS;

/// How the rANS decoder kernels classify context bytes: a byte equal to
/// `values[j]` (the first such `j < nv`) is in class `classes[j]`, any
/// other byte in class `other`. Every class must be below
/// [`RANS_CLASSES`] and `nv` below `RANS_CLASSES` too, or the decoder
/// kernel declines the block (only a caller's bug could pass such a map).
pub(crate) struct CtxClasses {
    pub nv: usize,
    pub values: [u8; RANS_CLASSES - 1],
    pub classes: [u8; RANS_CLASSES - 1],
    pub other: u8,
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

/// The 32 bytes of the `__m256i` `$v` as four registers of eight u32, in
/// order. A macro, not a function: it expands inside the kernels' own
/// AVX2 context.
#[cfg(target_arch = "x86_64")]
macro_rules! widen_quarters {
    ($v:expr) => {{
        let v: __m256i = $v;
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256(v, 1);
        [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)].map(|q| _mm256_cvtepu8_epi32(q))
    }};
}

/// The group loop of `rans::encode_core` with `8 * R` states (`R` = 4
/// for a wide block, [`RANS_WIDE`] states, or 1 for a narrow one) in `R`
/// AVX2 registers, for every whole group of `syms` from the last: per
/// register one gather of `fs` (`freq | start << 16` per
/// `class << 8 | symbol`), the words of the lanes that renormalise
/// compressed in descending lane order (the scalar loop's order), and the
/// quotient `x / freq` by a double-precision division, which is exact
/// here: `x < 2^32` and `freq < 2^12` are exact doubles, and a quotient's
/// distance below the next integer (at least `1 / freq`, relative
/// `2^-32`) is far above the division's rounding (relative `2^-53`).
///
/// `words[k..]` receives the words; returns the words written in all (`k`
/// on entry plus this kernel's), or `None`, having touched nothing, when
/// the arguments leave it no room: `words` shorter than `k` plus one word
/// per symbol, `classes` shorter than `syms`, `fs` without a whole table,
/// or `x` not `8 * R` states. The caller then takes the scalar loop.
///
/// # Safety
/// The CPU must support `avx2` and `popcnt`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn rans_encode_avx2<const R: usize>(
    x: &mut [u32],
    syms: &[u8],
    classes: Option<&[u8]>,
    fs: &[u32],
    words: &mut [u16],
    mut k: usize,
) -> Option<usize> {
    use std::arch::x86_64::*;
    const M: i32 = 1 << SCALE_BITS;
    const { assert!(R == 1 || R == 4, "a narrow or a wide block") };
    let lanes = 8 * R;
    // Each symbol writes at most one word, so with this room every store
    // of eight below stays inside `words` (see the store).
    let room = k.checked_add(syms.len())? <= words.len();
    if !room || x.len() != lanes || fs.len() < 256 || classes.is_some_and(|c| c.len() < syms.len())
    {
        return None;
    }
    // SAFETY: the CPU has AVX2 and popcnt (the caller's contract), and
    // every pointer access is in bounds: `x` is `8 * R` u32 (checked
    // above), loaded and stored as `R` registers of eight; a group's
    // `8 * R` symbols (and classes) start at `at = 8 R g` with `at + 8 R
    // <= syms.len() <= classes.len()`, read as 32 bytes (`R` = 4) or 8;
    // each gather index is `class << 8 | symbol` with the class clamped
    // to `last`, so below `(last + 1) * 256 <= fs.len()`; the stores of
    // eight words are bounded at the store.
    unsafe {
        let mut xv: [__m256i; R] =
            std::array::from_fn(|r| _mm256_loadu_si256(x.as_ptr().add(8 * r).cast()));
        // The group's bytes at `p` (symbols or classes), one per lane.
        let widen = |p: *const u8| -> [__m256i; R] {
            if R == 4 {
                let q = widen_quarters!(_mm256_loadu_si256(p.cast()));
                std::array::from_fn(|r| q[r])
            } else {
                [_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())); R]
            }
        };
        // A class past the last table takes the last.
        let last = _mm256_set1_epi32((fs.len() / 256) as i32 - 1);
        let low16 = _mm256_set1_epi32(0xffff);
        let m_scale = _mm256_set1_epi32(M);
        let sign = _mm256_set1_epi32(i32::MIN);
        let two31 = _mm256_set1_pd(2_147_483_648.0);
        for g in (0..syms.len() / lanes).rev() {
            let at = g * lanes;
            let sk = widen(syms.as_ptr().add(at));
            let ck = match classes {
                Some(c) => widen(c.as_ptr().add(at)).map(|q| _mm256_min_epu32(q, last)),
                None => [_mm256_setzero_si256(); R],
            };
            for r in (0..R).rev() {
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
                // In bounds: `k` grew by at most one per symbol this kernel
                // coded, and the eight of this register are not among them
                // yet, so `k + 8 <=` (`k` on entry) `+ syms.len() <=
                // words.len()`, checked on entry.
                _mm_storeu_si128(words.as_mut_ptr().add(k).cast(), w);
                k += mask.count_ones() as usize;
                let v = _mm256_blendv_epi8(v, _mm256_srli_epi32(v, 16), need);
                // q = v / freq in doubles: v as unsigned (flip the sign bit,
                // convert as signed, add 2^31 back).
                let vs = _mm256_xor_si256(v, sign);
                let f_lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(freq));
                let f_hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(freq, 1));
                let v_lo = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(vs)), two31);
                let v_hi =
                    _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(vs, 1)), two31);
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
    }
    Some(k)
}

/// The fast path of `rans::decode_core` with `8 * R` states (`R` = 4 for
/// a wide block, [`RANS_WIDE`] states, or 1 for a narrow one) in `R` AVX2
/// registers: per group of `8 * R` symbols, `R` gathers of eight slots
/// (each register's chain is independent, so their latencies overlap),
/// then each register's renormalisation words, expanded to the lanes that
/// need them with one permutation. Decodes whole groups while `16 * R`
/// bytes of words are left (a group needs at most that) and returns the
/// symbols decoded and the words' bytes read; the caller goes on from
/// there. A group that would leave the words read past `end` is not taken
/// (its states and symbols are left as they were): `data` may then be the
/// stream's last words followed by padding, which only a damaged stream
/// reads. `ctx`, if given, is the context byte of each symbol and its
/// classes; with fewer context bytes than `out`, classes out of range, or
/// `x` not `8 * R` states, the kernel decodes nothing.
///
/// # Safety
/// The CPU must support `avx2` and `popcnt`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn rans_decode_avx2<const R: usize>(
    x: &mut [u32],
    data: &[u8],
    slots: &[u32; RANS_ALL_SLOTS],
    ctx: Option<(&[u8], &CtxClasses)>,
    out: &mut [u8],
    end: usize,
) -> (usize, usize) {
    use std::arch::x86_64::*;
    const { assert!(R == 1 || R == 4, "a narrow or a wide block") };
    const M: i32 = 1 << SCALE_BITS;
    let lanes = 8 * R;
    let n = out.len();
    if x.len() != lanes {
        return (0, 0);
    }
    if let Some((c, m)) = ctx {
        let in_range = |&k: &u8| (k as usize) < RANS_CLASSES;
        if c.len() < n || m.nv >= RANS_CLASSES || !m.classes.iter().chain([&m.other]).all(in_range)
        {
            return (0, 0);
        }
    }
    let (mut i, mut r) = (0usize, 0usize);
    // SAFETY: the CPU has AVX2 and popcnt (the caller's contract), and
    // every pointer access is in bounds: `x` is `8 * R` u32 (checked
    // above), loaded and stored as `R` registers of eight; a group reads
    // context bytes and writes symbols `i..i + 8 * R` with `i + 8 * R <= n
    // <= ctx.len()` (checked above); each register reads 16 bytes of words
    // at `r`, where the loop left `16 * R` and each register before took at
    // most 16; a gather index is a class (below 8, checked above) times
    // 4096 plus a 12-bit slot, inside `slots`.
    unsafe {
        let mut xv: [__m256i; R] =
            std::array::from_fn(|k| _mm256_loadu_si256(x.as_ptr().add(8 * k).cast()));
        let low12 = _mm256_set1_epi32(M - 1);
        let low8 = _mm256_set1_epi32(0xff);
        let zero = _mm256_setzero_si256();
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        while i + lanes <= n && r + 2 * lanes <= data.len() {
            let (x0, r0) = (xv, r);
            let off: [__m256i; R] = match ctx {
                Some((c, m)) => {
                    // The class of each context byte: compare with each
                    // value, last to first, so the first match wins.
                    let classify = |cv: __m256i| {
                        let mut cls = _mm256_set1_epi8(m.other as i8);
                        for j in (0..m.nv).rev() {
                            let eq = _mm256_cmpeq_epi8(cv, _mm256_set1_epi8(m.values[j] as i8));
                            cls = _mm256_blendv_epi8(cls, _mm256_set1_epi8(m.classes[j] as i8), eq);
                        }
                        cls
                    };
                    let at = c.as_ptr().add(i);
                    if R == 4 {
                        let cls = classify(_mm256_loadu_si256(at.cast()));
                        let q = widen_quarters!(cls);
                        std::array::from_fn(|k| _mm256_slli_epi32(q[k], SCALE_BITS as i32))
                    } else {
                        // Eight bytes classified (the register's other
                        // bytes are 0s, their classes unused), then widened
                        // to the register's lanes.
                        let cv = _mm256_castsi128_si256(_mm_loadl_epi64(at.cast()));
                        let cls = _mm256_cvtepu8_epi32(_mm256_castsi256_si128(classify(cv)));
                        [_mm256_slli_epi32(cls, SCALE_BITS as i32); R]
                    }
                }
                None => [zero; R],
            };
            let mut e = [zero; R];
            for k in 0..R {
                let slot = _mm256_and_si256(xv[k], low12);
                let ek = _mm256_i32gather_epi32::<4>(
                    slots.as_ptr().cast(),
                    _mm256_or_si256(slot, off[k]),
                );
                e[k] = ek;
                let freq = _mm256_and_si256(_mm256_srli_epi32(ek, 8), low12);
                let start = _mm256_srli_epi32(ek, 20);
                let v = _mm256_add_epi32(
                    _mm256_mullo_epi32(freq, _mm256_srli_epi32(xv[k], SCALE_BITS as i32)),
                    _mm256_sub_epi32(slot, start),
                );
                let need = _mm256_cmpeq_epi32(_mm256_srli_epi32(v, 16), zero);
                let mask = _mm256_movemask_ps(_mm256_castsi256_ps(need)) as usize;
                let words = _mm256_cvtepu16_epi32(_mm_loadu_si128(data.as_ptr().add(r).cast()));
                let words = _mm256_permutevar8x32_epi32(
                    words,
                    _mm256_loadu_si256(EXPAND[mask & 255].as_ptr().cast()),
                );
                let renorm = _mm256_or_si256(_mm256_slli_epi32(v, 16), words);
                xv[k] = _mm256_blendv_epi8(v, renorm, need);
                r += 2 * mask.count_ones() as usize;
            }
            if r > end {
                (xv, r) = (x0, r0);
                break;
            }
            // Byte 0 of each entry is its symbol (the packs work per
            // 128-bit half).
            let dst = out.as_mut_ptr().add(i);
            if R == 4 {
                // 4 x 8 entries to 32 bytes; the permutation puts the
                // halves' quarters back in lane order.
                let a =
                    _mm256_packus_epi32(_mm256_and_si256(e[0], low8), _mm256_and_si256(e[1], low8));
                let b =
                    _mm256_packus_epi32(_mm256_and_si256(e[2], low8), _mm256_and_si256(e[3], low8));
                let syms = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), order);
                _mm256_storeu_si256(dst.cast(), syms);
            } else {
                // Each half's four symbols to its low 4 bytes, then the two
                // halves side by side.
                let a = _mm256_and_si256(e[0], low8);
                let b = _mm256_packus_epi16(_mm256_packus_epi32(a, a), zero);
                let syms =
                    _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
                _mm_storel_epi64(dst.cast(), syms);
            }
            i += lanes;
        }
        for (k, v) in xv.iter().enumerate() {
            _mm256_storeu_si256(x.as_mut_ptr().add(8 * k).cast(), *v);
        }
    }
    (i, r)
}

/// The bulk of `layout::ungroup4_uninit`: four streams into 4-byte
/// elements, whole groups of 32 elements by byte and word unpacks (undoing
/// the sign-bit rotation with `rotate`); returns how many elements it
/// wrote, `out[..4 * that]`. Stops at the shortest stream or at
/// `out.len() / 4`, whichever comes first.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn ungroup4_avx2(
    s: [&[u8]; 4],
    out: &mut [std::mem::MaybeUninit<u8>],
    rotate: bool,
) -> usize {
    // SAFETY: the CPU has AVX2 (the caller's contract); no base.
    unsafe { ungroup4_kernel(s, None, out, rotate) }
}

/// How the fused kernels combine each element with the base's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Against {
    /// Per byte (`layout::StreamOp`, one op per byte of the element):
    /// bytes set in `xor` are XORed with the base's byte, bytes set in
    /// `diff` are the zigzagged difference to add to it, the rest kept.
    Ops { xor: u32, diff: u32 },
    /// The whole element is the zigzagged difference of the ordered
    /// integers (`layout::ulp_delta`; `float`: of float bit patterns).
    Ulp { float: bool },
}

/// The bulk of `layout::ungroup_against_uninit` for 4-byte elements:
/// [`ungroup4_avx2`] and, in the same pass, each element undone against
/// the base element `base[4i..4i + 4]` as `how` says (per byte, the base
/// rotated like the streams; or, unrotated first, as a whole-element ULP
/// difference). Returns how many elements it wrote; stops at
/// the shortest stream, `base.len() / 4` or `out.len() / 4`.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn ungroup4_against_avx2(
    s: [&[u8]; 4],
    base: &[u8],
    how: Against,
    out: &mut [std::mem::MaybeUninit<u8>],
    rotate: bool,
) -> usize {
    // SAFETY: the CPU has AVX2 (the caller's contract).
    unsafe { ungroup4_kernel(s, Some((base, how)), out, rotate) }
}

/// `layout`'s sign-bit rotation: rotate (`left`) or unrotate by one bit
/// every 16-bit lane of `v` (`whole`: 2-byte elements, or the high halves
/// of 4-byte ones already apart), or else only the top 16 bits of every
/// 4-byte element.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rot16(
    v: std::arch::x86_64::__m256i,
    left: bool,
    whole: bool,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 operations, inlined into callers that
    // have AVX2 enabled.
    unsafe {
        let r = if left {
            _mm256_or_si256(_mm256_slli_epi16::<1>(v), _mm256_srli_epi16::<15>(v))
        } else {
            _mm256_or_si256(_mm256_srli_epi16::<1>(v), _mm256_slli_epi16::<15>(v))
        };
        if whole {
            r
        } else {
            _mm256_blend_epi16::<0b1010_1010>(v, r)
        }
    }
}

/// Undo the delta ops on the bytes `r` (rotated like the streams) against
/// the base's bytes `b` (rotated the same way): `r ^ b` where `xor` is set,
/// `b + unzigzag(r)` where `diff` is set, `r` elsewhere.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn undo_ops(
    r: std::arch::x86_64::__m256i,
    b: std::arch::x86_64::__m256i,
    xor: std::arch::x86_64::__m256i,
    diff: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 operations, inlined into callers that
    // have AVX2 enabled.
    unsafe {
        let x = _mm256_xor_si256(r, _mm256_and_si256(b, xor));
        let half = _mm256_and_si256(_mm256_srli_epi16::<1>(r), _mm256_set1_epi8(0x7f));
        let neg = _mm256_sub_epi8(
            _mm256_setzero_si256(),
            _mm256_and_si256(r, _mm256_set1_epi8(1)),
        );
        let d = _mm256_add_epi8(b, _mm256_xor_si256(half, neg));
        _mm256_blendv_epi8(x, d, diff)
    }
}

/// Undo the whole-element ULP delta on lanes of one width: `z` the
/// zigzagged difference, `b` the base element (`layout::ulp_undelta`).
/// `ord(b)` is `!b` for a negative float, `b | sign` otherwise; back from
/// `on`, `on & !sign` for a set top bit, `!on` otherwise. One body for
/// both widths: the lanes' intrinsics, their signed type and top bit.
macro_rules! ulp_undo {
    ($name:ident, $t:ty, $top:literal, $srli:ident, $srai:ident, $add:ident, $sub:ident, $set1:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn $name(
            z: std::arch::x86_64::__m256i,
            b: std::arch::x86_64::__m256i,
            float: bool,
        ) -> std::arch::x86_64::__m256i {
            use std::arch::x86_64::*;
            // SAFETY: register-only AVX2 operations, inlined into callers
            // that have AVX2 enabled.
            unsafe {
                let one = $set1(1);
                let d = _mm256_xor_si256(
                    $srli::<1>(z),
                    $sub(_mm256_setzero_si256(), _mm256_and_si256(z, one)),
                );
                if !float {
                    return $add(b, d);
                }
                let sign = $set1(<$t>::MIN);
                let ob = _mm256_xor_si256(b, _mm256_or_si256($srai::<$top>(b), sign));
                let on = $add(ob, d);
                let pos = _mm256_xor_si256($srai::<$top>(on), $set1(-1));
                _mm256_xor_si256(on, _mm256_or_si256(pos, sign))
            }
        }
    };
}

ulp_undo!(
    ulp_undo32,
    i32,
    31,
    _mm256_srli_epi32,
    _mm256_srai_epi32,
    _mm256_add_epi32,
    _mm256_sub_epi32,
    _mm256_set1_epi32
);
ulp_undo!(
    ulp_undo16,
    i16,
    15,
    _mm256_srli_epi16,
    _mm256_srai_epi16,
    _mm256_add_epi16,
    _mm256_sub_epi16,
    _mm256_set1_epi16
);

/// The one loop of [`ungroup4_avx2`] and [`ungroup4_against_avx2`].
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn ungroup4_kernel(
    s: [&[u8]; 4],
    base: Option<(&[u8], Against)>,
    out: &mut [std::mem::MaybeUninit<u8>],
    rotate: bool,
) -> usize {
    use std::arch::x86_64::*;
    let mut n = (out.len() / 4).min(s.iter().map(|t| t.len()).min().unwrap_or(0));
    if let Some((b, _)) = base {
        n = n.min(b.len() / 4);
    }
    let groups = n / 32;
    let splat = |m: u32| _mm256_set1_epi32(m as i32);
    let masks = match base {
        Some((_, Against::Ops { xor, diff })) => (splat(xor), splat(diff)),
        _ => (splat(0), splat(0)),
    };
    // SAFETY: for every load and store below, group g reads bytes
    // [32g, 32g + 32) of each stream, all below n <= its length, bytes
    // [128g, 128g + 128) of the base, below 4n <= base.len(), and writes
    // bytes [128g, 128g + 128) of `out`, below 4n <= out.len(); the CPU has
    // AVX2 (the caller's contract).
    unsafe {
        let o = out.as_mut_ptr() as *mut __m256i;
        for g in 0..groups {
            let ld = |t: &[u8]| _mm256_loadu_si256(t.as_ptr().add(32 * g) as *const __m256i);
            let (a, b, c, d) = (ld(s[0]), ld(s[1]), ld(s[2]), ld(s[3]));
            // Low and high halves of each element as u16, in-lane order:
            // elements 0-7 and 16-23 in `*_l`, 8-15 and 24-31 in `*_h`.
            let lo_l = _mm256_unpacklo_epi8(a, b);
            let lo_h = _mm256_unpackhi_epi8(a, b);
            let mut hi_l = _mm256_unpacklo_epi8(c, d);
            let mut hi_h = _mm256_unpackhi_epi8(c, d);
            // Unrotated here unless the bytes are undone against the
            // rotated base first (then after).
            if rotate && !matches!(base, Some((_, Against::Ops { .. }))) {
                hi_l = rot16(hi_l, false, true);
                hi_h = rot16(hi_h, false, true);
            }
            // Elements 0-3|16-19, 4-7|20-23, 8-11|24-27, 12-15|28-31.
            let e0 = _mm256_unpacklo_epi16(lo_l, hi_l);
            let e1 = _mm256_unpackhi_epi16(lo_l, hi_l);
            let e2 = _mm256_unpacklo_epi16(lo_h, hi_h);
            let e3 = _mm256_unpackhi_epi16(lo_h, hi_h);
            let mut v = [
                _mm256_permute2x128_si256::<0x20>(e0, e1),
                _mm256_permute2x128_si256::<0x20>(e2, e3),
                _mm256_permute2x128_si256::<0x31>(e0, e1),
                _mm256_permute2x128_si256::<0x31>(e2, e3),
            ];
            if let Some((bs, how)) = base {
                let bp = bs.as_ptr().add(128 * g) as *const __m256i;
                for (j, e) in v.iter_mut().enumerate() {
                    let mut bv = _mm256_loadu_si256(bp.add(j));
                    match how {
                        Against::Ops { .. } => {
                            if rotate {
                                bv = rot16(bv, true, false);
                            }
                            *e = undo_ops(*e, bv, masks.0, masks.1);
                            if rotate {
                                *e = rot16(*e, false, false);
                            }
                        }
                        Against::Ulp { float } => *e = ulp_undo32(*e, bv, float),
                    }
                }
            }
            let at = o.add(4 * g);
            for (j, e) in v.into_iter().enumerate() {
                _mm256_storeu_si256(at.add(j), e);
            }
        }
    }
    32 * groups
}

/// The bulk of `layout::ungroup_against_uninit` for 2-byte elements: two
/// streams interleaved into elements, each undone against the base
/// element as `how` says (per byte, both rotated as a whole 16 bits with
/// `rotate`, then unrotated; or as a whole-element ULP difference). Returns how many elements it wrote; stops at the shortest
/// stream, `base.len() / 2` or `out.len() / 2`.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn ungroup2_against_avx2(
    s: [&[u8]; 2],
    base: &[u8],
    how: Against,
    out: &mut [std::mem::MaybeUninit<u8>],
    rotate: bool,
) -> usize {
    use std::arch::x86_64::*;
    let n = (out.len() / 2)
        .min(base.len() / 2)
        .min(s[0].len())
        .min(s[1].len());
    let groups = n / 32;
    let splat = |m: u32| _mm256_set1_epi32(m as i32);
    let (xor, diff) = match how {
        Against::Ops { xor, diff } => (splat(xor), splat(diff)),
        Against::Ulp { .. } => (splat(0), splat(0)),
    };
    // SAFETY: group g reads bytes [32g, 32g + 32) of each stream, below
    // n <= its length, bytes [64g, 64g + 64) of the base, below 2n <=
    // base.len(), and writes bytes [64g, 64g + 64) of `out`, below 2n <=
    // out.len(); the CPU has AVX2 (the caller's contract).
    unsafe {
        let o = out.as_mut_ptr() as *mut __m256i;
        let bp = base.as_ptr() as *const __m256i;
        for g in 0..groups {
            let ld = |t: &[u8]| _mm256_loadu_si256(t.as_ptr().add(32 * g) as *const __m256i);
            let (a, b) = (ld(s[0]), ld(s[1]));
            // Elements 0-7|16-23 and 8-15|24-31, then in order.
            let l = _mm256_unpacklo_epi8(a, b);
            let h = _mm256_unpackhi_epi8(a, b);
            let v = [
                _mm256_permute2x128_si256::<0x20>(l, h),
                _mm256_permute2x128_si256::<0x31>(l, h),
            ];
            for (j, e) in v.into_iter().enumerate() {
                let mut bv = _mm256_loadu_si256(bp.add(2 * g + j));
                let unrot = |e| if rotate { rot16(e, false, true) } else { e };
                let e = match how {
                    Against::Ops { .. } => {
                        if rotate {
                            bv = rot16(bv, true, true);
                        }
                        unrot(undo_ops(e, bv, xor, diff))
                    }
                    Against::Ulp { float } => ulp_undo16(unrot(e), bv, float),
                };
                _mm256_storeu_si256(o.add(2 * g + j), e);
            }
        }
    }
    32 * groups
}

/// Apply per-byte delta ops to the bytes `r` against the base's bytes `b`
/// (both rotated alike): `r ^ b` where `xor` is set, `zigzag(r - b)` per
/// byte where `diff` is set, `r` elsewhere. The inverse of [`undo_ops`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn apply_ops(
    r: std::arch::x86_64::__m256i,
    b: std::arch::x86_64::__m256i,
    xor: std::arch::x86_64::__m256i,
    diff: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 operations, inlined into callers that
    // have AVX2 enabled.
    unsafe {
        let x = _mm256_xor_si256(r, _mm256_and_si256(b, xor));
        let d = _mm256_sub_epi8(r, b);
        let z = _mm256_xor_si256(
            _mm256_add_epi8(d, d),
            _mm256_cmpgt_epi8(_mm256_setzero_si256(), d),
        );
        _mm256_blendv_epi8(x, z, diff)
    }
}

/// One register of the group-against kernels: 32 bytes of elements `r`
/// and of the base's `b`, both rotated when `rotate` (`whole` as in
/// [`rot16`]), each byte expressed against the base's (`apply_ops`), then
/// shuffled by `by_byte` (the bytes of one position together per lane).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn against_register(
    mut r: std::arch::x86_64::__m256i,
    mut b: std::arch::x86_64::__m256i,
    rotate: bool,
    whole: bool,
    xor: std::arch::x86_64::__m256i,
    diff: std::arch::x86_64::__m256i,
    by_byte: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: register-only AVX2 operations, inlined into callers that
    // have AVX2 enabled.
    unsafe {
        if rotate {
            (r, b) = (rot16(r, true, whole), rot16(b, true, whole));
        }
        _mm256_shuffle_epi8(apply_ops(r, b, xor, diff), by_byte)
    }
}

/// The bulk of `layout::group_against_uninit` for `W`-byte elements (2 or
/// 4): 32 elements of `raw` and of `base` at a time (`W` registers of
/// each), both rotated with `rotate` (the top 16 bits of a 4-byte element,
/// the whole of a 2-byte one), each byte expressed against the base's by
/// `xor` and `diff` (the masks of [`Against::Ops`]), then byte `k` of
/// every element into `s[k]`. Returns how many elements it wrote; stops at
/// the shortest of `raw` and `base` (in elements) and of the streams.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn group_against_avx2<const W: usize>(
    raw: &[u8],
    base: &[u8],
    xor: u32,
    diff: u32,
    s: [&mut [std::mem::MaybeUninit<u8>]; W],
    rotate: bool,
) -> usize {
    // SAFETY: the CPU has AVX2 (the caller's contract).
    unsafe { group_kernel::<W, true>(raw, base, xor, diff, s, rotate) }
}

/// The bulk of `layout::group_uninit` for `W`-byte elements (2 or 4):
/// [`group_against_avx2`] with no base (every byte kept). Against the
/// compiler's vectorisation of the scalar loop (`examples/codec_speed`
/// FULL encode, one core, CPU time, medians of five alternating runs):
/// fp32 gpt-small weights 1812 -> 1938 MiB/s, optimizer 1271 -> 1352,
/// bert-ft weights 1894 -> 2042, optimizer 1764 -> 1839; bf16 the same
/// (1406 -> 1425).
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn group_avx2<const W: usize>(
    raw: &[u8],
    s: [&mut [std::mem::MaybeUninit<u8>]; W],
    rotate: bool,
) -> usize {
    // SAFETY: the CPU has AVX2 (the caller's contract).
    unsafe { group_kernel::<W, false>(raw, &[], 0, 0, s, rotate) }
}

/// [`group_against_avx2`] (`AGAINST`) or [`group_avx2`] (`base` unread).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn group_kernel<const W: usize, const AGAINST: bool>(
    raw: &[u8],
    base: &[u8],
    xor: u32,
    diff: u32,
    mut s: [&mut [std::mem::MaybeUninit<u8>]; W],
    rotate: bool,
) -> usize {
    use std::arch::x86_64::*;
    const { assert!(W == 2 || W == 4) };
    let n = (raw.len() / W)
        .min(if AGAINST { base.len() / W } else { usize::MAX })
        .min(s.iter().map(|t| t.len()).min().unwrap_or(0));
    let groups = n / 32;
    // SAFETY: register-only AVX2 operations; the callers have AVX2.
    let (xor, diff, by_byte, pairs) = unsafe {
        (
            _mm256_set1_epi32(xor as i32),
            _mm256_set1_epi32(diff as i32),
            // Within each 128-bit lane, byte k of its elements together:
            // four 4-byte elements, or the low then the high bytes of
            // eight 2-byte ones.
            if W == 4 {
                _mm256_setr_epi8(
                    0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13,
                    2, 6, 10, 14, 3, 7, 11, 15,
                )
            } else {
                _mm256_setr_epi8(
                    0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                    14, 1, 3, 5, 7, 9, 11, 13, 15,
                )
            },
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        )
    };
    // SAFETY: group g reads bytes [32Wg, 32W(g + 1)) of `raw` and (when
    // `AGAINST`) of `base`, below Wn <= their lengths, and writes bytes
    // [32g, 32g + 32) of each stream, below n <= its length; the CPU has
    // AVX2 (the callers' contract).
    unsafe {
        let (rp, bp) = (
            raw.as_ptr() as *const __m256i,
            base.as_ptr() as *const __m256i,
        );
        for g in 0..groups {
            let mut q = [_mm256_setzero_si256(); W];
            for (j, e) in q.iter_mut().enumerate() {
                let r = _mm256_loadu_si256(rp.add(W * g + j));
                let v = if AGAINST {
                    let b = _mm256_loadu_si256(bp.add(W * g + j));
                    against_register(r, b, rotate, W == 2, xor, diff, by_byte)
                } else {
                    let r = if rotate { rot16(r, true, W == 2) } else { r };
                    _mm256_shuffle_epi8(r, by_byte)
                };
                // 64-bit quarter k: byte k of the register's elements
                // (4-byte: eight per quarter; 2-byte: low bytes of 16 in
                // the first two quarters, high in the last two).
                *e = if W == 4 {
                    _mm256_permutevar8x32_epi32(v, pairs)
                } else {
                    _mm256_permute4x64_epi64::<0b11_01_10_00>(v)
                };
            }
            let out: [__m256i; W] = if W == 4 {
                let t0 = _mm256_unpacklo_epi64(q[0], q[1]);
                let t1 = _mm256_unpackhi_epi64(q[0], q[1]);
                let t2 = _mm256_unpacklo_epi64(q[2], q[3]);
                let t3 = _mm256_unpackhi_epi64(q[2], q[3]);
                std::array::from_fn(|k| match k {
                    0 => _mm256_permute2x128_si256::<0x20>(t0, t2),
                    1 => _mm256_permute2x128_si256::<0x20>(t1, t3),
                    2 => _mm256_permute2x128_si256::<0x31>(t0, t2),
                    _ => _mm256_permute2x128_si256::<0x31>(t1, t3),
                })
            } else {
                std::array::from_fn(|k| match k {
                    0 => _mm256_permute2x128_si256::<0x20>(q[0], q[1]),
                    _ => _mm256_permute2x128_si256::<0x31>(q[0], q[1]),
                })
            };
            for (t, v) in s.iter_mut().zip(out) {
                _mm256_storeu_si256(t.as_mut_ptr().add(32 * g).cast(), v);
            }
        }
    }
    32 * groups
}

/// The skip masks of the element map's scan: for each whole group of 64
/// `W`-byte elements of `body`, in order, `f` gets a mask whose bit `j` is
/// set when element `j` of the group equals the base's element (with a
/// base) or is all zero bytes (without). Returns the elements covered (a
/// multiple of 64; the caller scans the rest); with a base, stops at the
/// shorter of the two.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn skip_masks_avx2<const W: usize, F: FnMut(u64)>(
    body: &[u8],
    base: Option<&[u8]>,
    mut f: F,
) -> usize {
    use std::arch::x86_64::*;
    const { assert!(W == 1 || W == 2 || W == 4 || W == 8) };
    let n = base.map_or(body.len(), |b| b.len().min(body.len())) / W;
    let groups = n / 64;
    let zero = _mm256_setzero_si256();
    for g in 0..groups {
        // Register r of the group: bytes [32r, 32r + 32) of the group's
        // 64 W bytes, 32 / W elements.
        let eq = |r: usize| {
            let at = 64 * W * g + 32 * r;
            // SAFETY: at + 32 <= 64 W (g + 1) <= n W, within `body` and,
            // with a base, within it too (`n` counts both).
            unsafe {
                let e = _mm256_loadu_si256(body.as_ptr().add(at).cast());
                let b = match base {
                    Some(b) => _mm256_loadu_si256(b.as_ptr().add(at).cast()),
                    None => zero,
                };
                match W {
                    1 => _mm256_cmpeq_epi8(e, b),
                    2 => _mm256_cmpeq_epi16(e, b),
                    4 => _mm256_cmpeq_epi32(e, b),
                    _ => _mm256_cmpeq_epi64(e, b),
                }
            }
        };
        let mut m = 0u64;
        match W {
            1 => {
                for r in 0..2 {
                    m |= (_mm256_movemask_epi8(eq(r)) as u32 as u64) << (32 * r);
                }
            }
            2 => {
                for r in 0..2 {
                    // Two registers of 16 equal-or-not words packed to 32
                    // bytes (-1 or 0), back in element order across lanes.
                    let p = _mm256_packs_epi16(eq(2 * r), eq(2 * r + 1));
                    let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(p);
                    m |= (_mm256_movemask_epi8(p) as u32 as u64) << (32 * r);
                }
            }
            4 => {
                for r in 0..8 {
                    let v = _mm256_movemask_ps(_mm256_castsi256_ps(eq(r)));
                    m |= (v as u32 as u64) << (8 * r);
                }
            }
            _ => {
                for r in 0..16 {
                    let v = _mm256_movemask_pd(_mm256_castsi256_pd(eq(r)));
                    m |= (v as u32 as u64) << (4 * r);
                }
            }
        }
        f(m);
    }
    64 * groups
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("popcnt")
    }

    /// A flat table (every symbol frequency 16) in the encoder kernel's
    /// `freq | start << 16` form.
    fn flat_fs() -> Vec<u32> {
        (0..256u32).map(|s| 16 | (16 * s) << 16).collect()
    }

    /// The check that replaced a `debug_assert!`: an encoder kernel given
    /// too little room for its words (or too few classes, or no whole
    /// table) declines, touching nothing, instead of storing past the end.
    #[test]
    fn the_encoder_kernels_decline_arguments_that_leave_them_no_room() {
        if !avx2() {
            return;
        }
        let syms: Vec<u8> = (0..4 * RANS_WIDE as u32)
            .map(|i| (i * 37 % 251) as u8)
            .collect();
        let classes = vec![0u8; syms.len()];
        let fs = flat_fs();
        let k = 5;
        let start = [1u32 << 16; RANS_WIDE];
        let run = |words: &mut [u16], classes: Option<&[u8]>, fs: &[u32]| {
            let mut x = start;
            // SAFETY: the CPU has AVX2 and popcnt, checked above.
            let got = unsafe { rans_encode_avx2::<4>(&mut x, &syms, classes, fs, words, k) };
            (got, x)
        };
        // One word short of one per symbol: declined, states as they were.
        let mut short = vec![0xabcd_u16; k + syms.len() - 1];
        assert_eq!(run(&mut short, None, &fs), (None, start));
        assert!(short.iter().all(|&w| w == 0xabcd));
        let mut words = vec![0u16; k + syms.len()];
        assert_eq!(run(&mut words, Some(&classes[1..]), &fs).0, None);
        assert_eq!(run(&mut words, None, &fs[..255]).0, None);
        assert_eq!(run(&mut words, None, &[]).0, None);
        // Exactly one word per symbol is enough, with classes or without.
        let (plain, _) = run(&mut words, None, &fs);
        assert!(plain.is_some_and(|end| end >= k && end <= words.len()));
        assert_eq!(run(&mut words, Some(&classes), &fs).0, plain);
        // The narrow kernel takes eight states, no other count.
        let narrow = |x: &mut [u32], words: &mut [u16]| {
            // SAFETY: the CPU has AVX2 and popcnt, checked above.
            unsafe { rans_encode_avx2::<1>(x, &syms, None, &fs, words, k) }
        };
        assert_eq!(narrow(&mut [1 << 16; RANS_WIDE], &mut words), None);
        assert!(narrow(&mut [1 << 16; 8], &mut words).is_some());
    }

    /// The decoder kernel decodes nothing with fewer context bytes than
    /// symbols or with a class map that would index past the slot tables
    /// (the scalar loop then goes on, bounds-checked); with a sound map it
    /// decodes whole groups.
    #[test]
    fn the_decoder_kernels_decline_a_short_context_or_bad_classes() {
        if !avx2() {
            return;
        }
        let slots = vec![0u32; RANS_ALL_SLOTS];
        let slots: &[u32; RANS_ALL_SLOTS] = slots[..].try_into().expect("sized");
        let data = vec![0u8; 4096];
        let run = |ctx: &[u8], nv: usize, classes: [u8; RANS_CLASSES - 1], other: u8| {
            let map = CtxClasses {
                nv,
                values: [3; RANS_CLASSES - 1],
                classes,
                other,
            };
            let mut out = vec![0u8; 256];
            let mut x = [1u32 << 16; RANS_WIDE];
            // SAFETY: the CPU has AVX2 and popcnt, checked above.
            unsafe {
                rans_decode_avx2::<4>(
                    &mut x,
                    &data,
                    slots,
                    Some((ctx, &map)),
                    &mut out,
                    data.len(),
                )
            }
            .0
        };
        let ctx = vec![3u8; 256];
        let sound = [7, 0, 1, 2, 3, 4, 5];
        assert_eq!(run(&ctx, 7, sound, 6), 256);
        assert_eq!(run(&ctx[..255], 7, sound, 6), 0);
        assert_eq!(run(&ctx, 8, sound, 6), 0);
        assert_eq!(run(&ctx, 7, sound, 8), 0);
        assert_eq!(run(&ctx, 7, [8, 0, 1, 2, 3, 4, 5], 6), 0);
        // The narrow kernel takes eight states, no other count.
        let narrow = |x: &mut [u32]| {
            let mut out = vec![0u8; 256];
            // SAFETY: the CPU has AVX2 and popcnt, checked above.
            unsafe { rans_decode_avx2::<1>(x, &data, slots, None, &mut out, data.len()) }.0
        };
        assert_eq!(narrow(&mut [1 << 16; RANS_WIDE]), 0);
        assert_eq!(narrow(&mut [1 << 16; 8]), 256);
    }
}

/// The shuffles of the element map's scattered moves, for `W`-byte
/// elements, `16 / W` to a 16-byte register, indexed by the register's
/// skip bits `m` (bit `e` set: element `e` skipped):
/// - `expand[m]`: the register's kept elements, taken from the top of a
///   register of kept elements back to back, each to its place; skipped
///   elements' bytes zero (`0x80`);
/// - `skipped[m]`: `0xff` on the bytes of skipped elements;
/// - `compact[m]`: the register's kept elements to its bottom, in order.
struct MoveTables<const T: usize> {
    expand: [[u8; 16]; T],
    skipped: [[u8; 16]; T],
    compact: [[u8; 16]; T],
}

const fn move_tables<const W: usize, const T: usize>() -> MoveTables<T> {
    let e_per = 16 / W;
    let mut t = MoveTables {
        expand: [[0x80; 16]; T],
        skipped: [[0; 16]; T],
        compact: [[0x80; 16]; T],
    };
    let mut m = 0;
    while m < T {
        let kept = e_per - (m as u32).count_ones() as usize;
        let (mut e, mut k) = (0, 0);
        while e < e_per {
            let mut b = 0;
            if m >> e & 1 == 0 {
                while b < W {
                    t.expand[m][e * W + b] = ((e_per - kept + k) * W + b) as u8;
                    t.compact[m][k * W + b] = (e * W + b) as u8;
                    b += 1;
                }
                k += 1;
            } else {
                while b < W {
                    t.skipped[m][e * W + b] = 0xff;
                    b += 1;
                }
            }
            e += 1;
        }
        m += 1;
    }
    t
}

static MOVES2: MoveTables<256> = move_tables::<2, 256>();
static MOVES4: MoveTables<16> = move_tables::<4, 16>();

/// The mixed 64-element word `k` of a scattered element map's expansion
/// (`elements::expand_bits`), for `W` of 2 or 4: elements `64 k..hi` of
/// `out` from the top `src` kept elements below them (moved up) and,
/// where skipped (bit set in `m`), the base's or zero. 16 bytes at a time
/// while 16 / W kept elements lie below; returns `(element, src)` where
/// it stopped, for the caller's element loop to finish.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn expand_word_avx2<const W: usize>(
    out: &mut [u8],
    k: usize,
    hi: usize,
    m: u64,
    mut src: usize,
    base: Option<&[u8]>,
) -> (usize, usize) {
    use std::arch::x86_64::*;
    const { assert!(W == 2 || W == 4) };
    let e_per = 16 / W;
    let lo = 64 * k;
    let mut i = hi;
    // Whole registers only: `i` a multiple of 16 / W above `lo`, 16 / W
    // kept elements below `src`, and the register inside `out` (and the
    // base, which the caller passes as long as `out` or not at all).
    let fits = hi.checked_mul(W).is_some_and(|end| end <= out.len());
    if (i - lo) % e_per != 0 || !fits || base.is_some_and(|b| b.len() < out.len()) {
        return (i, src);
    }
    while i > lo && src >= e_per && src <= i {
        let at = i - e_per;
        let g = ((m >> (at - lo)) & ((1u64 << e_per) - 1)) as usize;
        let (expand, skipped) = match W {
            2 => (&MOVES2.expand[g], &MOVES2.skipped[g]),
            _ => (&MOVES4.expand[g], &MOVES4.skipped[g]),
        };
        // SAFETY: the kept register is elements `src - 16 / W..src`, and
        // `src <= i <= hi`: within `out` (checked above); the written
        // register is elements `at..i`, within `out` and the base. Both
        // tables are 16 bytes.
        unsafe {
            let v = _mm_loadu_si128(out.as_ptr().add((src - e_per) * W).cast());
            let mut r = _mm_shuffle_epi8(v, _mm_loadu_si128(expand.as_ptr().cast()));
            if let Some(b) = base {
                let bv = _mm_loadu_si128(b.as_ptr().add(at * W).cast());
                let sk = _mm_loadu_si128(skipped.as_ptr().cast());
                r = _mm_or_si128(r, _mm_and_si128(bv, sk));
            }
            _mm_storeu_si128(out.as_mut_ptr().add(at * W).cast(), r);
        }
        src -= e_per - g.count_ones() as usize;
        i = at;
    }
    (i, src)
}

/// The mixed 64-element word `k` of a scattered element map's compaction
/// (`elements::compact_bits`), for `W` of 2 or 4: the kept elements (bit
/// clear in `m`) of `raw`'s elements `64 k..hi` to `out` from byte `at`,
/// 16 bytes at a time; returns `(element, at)` where it stopped, for the
/// caller's loop to finish. Each register's store is 16 bytes whatever it
/// keeps, so it stops where fewer than 16 bytes of `out` are left.
///
/// # Safety
/// The CPU must support `avx2`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn compact_word_avx2<const W: usize>(
    raw: &[u8],
    k: usize,
    hi: usize,
    m: u64,
    out: &mut [u8],
    mut at: usize,
) -> (usize, usize) {
    use std::arch::x86_64::*;
    const { assert!(W == 2 || W == 4) };
    let e_per = 16 / W;
    let mut i = 64 * k;
    if hi.checked_mul(W).is_none_or(|end| end > raw.len()) {
        return (i, at);
    }
    while i + e_per <= hi && at <= out.len().saturating_sub(16) && out.len() >= 16 {
        let g = ((m >> (i - 64 * k)) & ((1u64 << e_per) - 1)) as usize;
        let compact = match W {
            2 => &MOVES2.compact[g],
            _ => &MOVES4.compact[g],
        };
        // SAFETY: elements `i..i + 16 / W` are within `raw` (`hi * W` is,
        // checked above), bytes `at..at + 16` within `out` (the loop's
        // condition), the table 16 bytes.
        unsafe {
            let v = _mm_loadu_si128(raw.as_ptr().add(i * W).cast());
            let r = _mm_shuffle_epi8(v, _mm_loadu_si128(compact.as_ptr().cast()));
            _mm_storeu_si128(out.as_mut_ptr().add(at).cast(), r);
        }
        at += (e_per - g.count_ones() as usize) * W;
        i += e_per;
    }
    (i, at)
}
