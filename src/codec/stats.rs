//! Symbol statistics shared by the block coder and the entropy coders:
//! byte histograms (whole and sampled), order-0 entropy estimates, the
//! `log2` tables behind them, and rANS frequency normalisation with the
//! coded size it implies.
//!
//! A leaf: imports no other codec module, so `block` (which picks a coder
//! from these estimates) and `rans` / `context` (which code with the
//! normalised frequencies) both stand on it. Must not: encode or decode
//! anything, or know the frame format beyond the probability scale.

/// Probability scale of normalised frequencies: they sum to
/// `2^SCALE_BITS` (rANS's 12-bit probabilities, see `docs/format/codec.md`).
pub(crate) const SCALE_BITS: u32 = 12;
const M: u32 = 1 << SCALE_BITS;

/// Byte histogram. Interleaved tables break the store-to-load chains that
/// a run of one symbol (an exponent stream, the zero high bytes of small
/// integers) would otherwise serialise: eight for long inputs, four for
/// the short ones (the delta search's samples, a small chunk's streams:
/// on 640 equal bytes one table took 1.1 us, four 0.36 us), one for the
/// shortest, where clearing and summing more would cost more than
/// counting.
pub fn histogram(s: &[u8]) -> [u32; 256] {
    if s.len() < TINY_HISTOGRAM {
        let mut h = [0u32; 256];
        for &b in s {
            h[b as usize] += 1;
        }
        return h;
    }
    if is_constant(s) {
        let mut h = [0u32; 256];
        h[s[0] as usize] = s.len() as u32;
        return h;
    }
    if s.len() < SHORT_HISTOGRAM {
        return interleaved::<4>(s);
    }
    interleaved::<8>(s)
}

/// Whether every byte of `s` is its first (true when empty). 32 bytes at
/// a time, a form the compiler vectorises: 12 ns for 640 equal bytes,
/// where a byte loop took 250; a stream that is not constant usually
/// answers in its first 32 bytes.
fn is_constant(s: &[u8]) -> bool {
    let Some(&first) = s.first() else {
        return true;
    };
    let mut it = s.chunks_exact(32);
    for c in &mut it {
        if c.iter().fold(0u8, |a, &b| a | (b ^ first)) != 0 {
            return false;
        }
    }
    it.remainder().iter().all(|&b| b == first)
}

/// [`histogram`] with `T` tables, byte `k` of every `T` in table `k`.
#[inline(always)]
fn interleaved<const T: usize>(s: &[u8]) -> [u32; 256] {
    let mut h = [[0u32; 256]; T];
    let mut it = s.chunks_exact(T);
    for c in &mut it {
        for (t, &b) in h.iter_mut().zip(c) {
            t[b as usize] += 1;
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
const TINY_HISTOGRAM: usize = 256;
/// Inputs shorter than this (and not tiny) get four tables, longer ones
/// eight.
const SHORT_HISTOGRAM: usize = 4096;

/// Histogram of every `step`-th byte: enough to see that a block of
/// noise (low mantissa bytes) is not worth entropy coding.
pub(crate) fn sampled_histogram(s: &[u8], step: usize) -> [u32; 256] {
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

/// What the 1-in-4 sample counts beyond the 1-in-16 one:
/// `sampled_histogram(s, 16)` plus this is `sampled_histogram(s, 4)`, so a
/// block past the noise screen reuses the screen's counts.
pub(crate) fn sampled_rest(s: &[u8]) -> [u32; 256] {
    let mut h = [[0u32; 256]; 4];
    let mut it = s.chunks_exact(64);
    for c in &mut it {
        for g in c.chunks_exact(16) {
            h[1][g[4] as usize] += 1;
            h[2][g[8] as usize] += 1;
            h[3][g[12] as usize] += 1;
        }
    }
    // The screen takes whole runs of 64, the 1-in-4 sample whole runs of 16.
    for g in it.remainder().chunks_exact(16) {
        for (k, t) in h.iter_mut().enumerate() {
            t[g[4 * k] as usize] += 1;
        }
    }
    let mut out = [0u32; 256];
    for (i, o) in out.iter_mut().enumerate() {
        *o = h.iter().map(|t| t[i]).sum();
    }
    out
}

/// Order-0 entropy of a histogram, in bits (the whole block, not per symbol):
/// `n log2 n - sum c log2 c`, the second term from a table (no branch per
/// bin: `0 log2 0` is 0), summed in four chains.
pub fn entropy_bits(h: &[u32; 256]) -> f64 {
    let n: u64 = h.iter().map(|&c| c as u64).sum();
    entropy_bits_of(h, n)
}

/// [`entropy_bits`] of a histogram whose counts the caller knows sum to
/// `n` (a stream of `n` symbols), without summing them again.
pub(crate) fn entropy_bits_of(h: &[u32; 256], n: u64) -> f64 {
    debug_assert_eq!(
        n,
        h.iter().map(|&c| c as u64).sum::<u64>(),
        "n is the counts' sum"
    );
    if n == 0 {
        return 0.0;
    }
    let t = Log2::get();
    let sum = if n < Log2::SIZE as u64 {
        // Every count is below the table's size: no bound to check.
        sum_x_log_x(h, t.1)
    } else {
        let mut acc = [0.0f64; 4];
        for q in h.chunks_exact(4) {
            for (a, &c) in acc.iter_mut().zip(q) {
                *a += t.x_of(c);
            }
        }
        acc[0] + acc[1] + acc[2] + acc[3]
    };
    // `n log2 n` from the table too when it holds it (the same value:
    // the table's entries are computed as this is): 2% of the 5 KiB RNG
    // state's encode was `log2`, a call per estimate.
    let n_log_n = if n < Log2::SIZE as u64 {
        t.x_of(n as u32)
    } else {
        let n = n as f64;
        n * n.log2()
    };
    n_log_n - sum
}

/// `sum c log2 c` over `h` from the table `x` (`Log2::SIZE` entries),
/// every count below its size, in eight chains. Inlined, not an AVX2
/// copy behind a feature check: its loop is scalar loads either way, and
/// the call through the check made each estimate 110 ns instead of 81
/// (a 632-symbol histogram; an eighth of the 5 KiB RNG state's encode).
#[inline(always)]
fn sum_x_log_x(h: &[u32; 256], x: &[f64]) -> f64 {
    let x: &[f64; Log2::SIZE] = x.try_into().expect("the table's size");
    let mut acc = [0.0f64; 8];
    for q in h.chunks_exact(8) {
        for (a, &c) in acc.iter_mut().zip(q) {
            *a += x[c as usize & (Log2::SIZE - 1)];
        }
    }
    acc.iter().sum()
}

/// `log2` and `x log2 x` of small integers from tables: the entropy
/// estimates take one per histogram bin, and `f64::log2` costs tens of
/// instructions. The tables hold the very values `f64::log2` gives.
pub(crate) struct Log2(&'static [f64], &'static [f64]);

impl Log2 {
    const SIZE: usize = 4096;

    pub(crate) fn get() -> Log2 {
        static TABLES: std::sync::OnceLock<(Vec<f64>, Vec<f64>)> = std::sync::OnceLock::new();
        let (l, x) = TABLES.get_or_init(|| {
            let l: Vec<f64> = (0..Self::SIZE).map(|c| (c as f64).log2()).collect();
            let x = l
                .iter()
                .enumerate()
                .map(|(c, &v)| if c == 0 { 0.0 } else { c as f64 * v })
                .collect();
            (l, x)
        });
        Log2(l, x)
    }

    #[inline(always)]
    pub(crate) fn of(&self, c: u32) -> f64 {
        match self.0.get(c as usize) {
            Some(&v) => v,
            None => (c as f64).log2(),
        }
    }

    /// `c log2 c`, 0 for 0.
    #[inline(always)]
    pub(crate) fn x_of(&self, c: u32) -> f64 {
        match self.1.get(c as usize) {
            Some(&v) => v,
            None => c as f64 * (c as f64).log2(),
        }
    }
}

/// Normalise a histogram (at least two symbols present) to frequencies
/// summing to 4096, every present symbol at least 1.
pub(crate) fn normalize(hist: &[u32; 256]) -> [u32; 256] {
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
pub(crate) fn coded_bits(hist: &[u32; 256], f: &[u32; 256]) -> f64 {
    let log2 = Log2::get();
    let mut bits = 0.0;
    for s in 0..256 {
        if hist[s] > 0 {
            bits += hist[s] as f64 * (SCALE_BITS as f64 - log2.of(f[s]));
        }
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every table layout (one, four, eight interleaved) counts each
        /// byte once: lengths around both thresholds, runs of one symbol
        /// and mixed bytes.
        #[test]
        fn histogram_counts_every_byte_once(
            len in prop_oneof![0usize..300, 4000usize..4200, 4200usize..9000],
            symbols in 1u32..257,
            seed in any::<u64>(),
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let s: Vec<u8> = (0..len).map(|_| (rng.next_u64() % symbols as u64) as u8).collect();
            let mut want = [0u32; 256];
            for &b in &s {
                want[b as usize] += 1;
            }
            prop_assert_eq!(histogram(&s), want);
            prop_assert_eq!(is_constant(&s), s.iter().all(|&b| b == s[0]));
        }

        /// The table sums (vectorised below 4096 symbols, in four chains
        /// from there on) give `n log2 n - sum c log2 c` as `f64::log2`
        /// does, to rounding.
        #[test]
        fn entropy_bits_matches_the_formula(
            h in proptest::collection::vec(0u32..40, 256),
            big in 0u32..100_000,
            at in 0usize..256,
        ) {
            let mut h: [u32; 256] = h.try_into().unwrap();
            // Small counts, then one count of up to 100,000 more.
            for add_big in [false, true] {
                if add_big {
                    h[at] += big;
                }
                let n: f64 = h.iter().map(|&c| c as f64).sum();
                let naive = if n == 0.0 {
                    0.0
                } else {
                    n * n.log2()
                        - h.iter()
                            .filter(|&&c| c > 0)
                            .map(|&c| c as f64 * (c as f64).log2())
                            .sum::<f64>()
                };
                let got = entropy_bits(&h);
                prop_assert!((got - naive).abs() <= 1e-9 * naive.max(1.0), "{got} vs {naive}");
            }
        }
    }
}
