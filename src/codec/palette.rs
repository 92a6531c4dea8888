//! Palette frames (version 6, transform bit 7): a chunk whose whole
//! elements take at most 256 distinct values, stored as those values
//! (sorted, once) and one index byte per element, the index bytes then
//! coded as the single stream of a `u8` frame by the usual block coders
//! (bit-packed, Huffman or rANS as they pay).

use super::stats::Log2;

/// At most this many distinct values (one index byte).
pub(crate) const MAX: usize = 256;

/// Slots of the open-addressing table: twice `MAX`, a power of two.
const SLOTS: usize = 512;
const EMPTY: u16 = u16::MAX;

/// Whether the encoder tries a palette.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Palette {
    /// Never.
    Never,
    /// When a sample of the chunk holds few distinct values and the
    /// palette frame comes out smaller than the plain one.
    Auto,
    /// Whenever the chunk holds at most 256 distinct values (tests, fuzz).
    Always,
}

/// An element (1 to 8 bytes) as its little-endian unsigned value: the
/// palette's sort key.
#[inline]
pub(crate) fn key(e: &[u8]) -> u64 {
    // The common widths as fixed-size loads: a copy of `e.len()` bytes is
    // a call to memcpy per element (half the time a screen took).
    match *e {
        [a, b] => u64::from(u16::from_le_bytes([a, b])),
        [a, b, c, d] => u64::from(u32::from_le_bytes([a, b, c, d])),
        _ => {
            let mut b = [0u8; 8];
            b[..e.len()].copy_from_slice(e);
            u64::from_le_bytes(b)
        }
    }
}

/// A set of at most `MAX` keys, each with a `u8` value.
struct Table {
    keys: [u64; SLOTS],
    vals: [u16; SLOTS],
    len: usize,
}

impl Table {
    fn new() -> Table {
        Table {
            keys: [0; SLOTS],
            vals: [EMPTY; SLOTS],
            len: 0,
        }
    }

    #[inline]
    fn slot(&self, k: u64) -> usize {
        let mut i = (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 55) as usize;
        while self.vals[i] != EMPTY && self.keys[i] != k {
            i = (i + 1) & (SLOTS - 1);
        }
        i
    }

    /// Adds `k` and returns its value (the order it came in); `None`
    /// when it would be the 257th key.
    #[inline]
    fn insert(&mut self, k: u64) -> Option<u16> {
        let i = self.slot(k);
        if self.vals[i] == EMPTY {
            if self.len == MAX {
                return None;
            }
            self.keys[i] = k;
            self.vals[i] = self.len as u16;
            self.len += 1;
        }
        Some(self.vals[i])
    }
}

/// Elements the screen samples.
const SAMPLE: usize = 2048;

/// Whether a palette looks worth a full scan, by up to 1024 elements at
/// the start of `body` and about 2048 evenly spread ones (`w` bytes each): they hold at most 256
/// distinct values (float weights bail out within a few hundred
/// elements), and the order-0 entropy of those values, plus the palette,
/// is below 0.9 of the summed entropies of their byte positions (what
/// byte grouping codes). bf16 weights, whose few hundred values each
/// byte already codes well, fail the second test: a full scan of their
/// chunk would find the 257th value late, if at all.
pub(crate) fn screen(body: &[u8], w: usize) -> bool {
    let n = body.len() / w;
    if n == 0 {
        return false;
    }
    let step = n.div_ceil(SAMPLE);
    // A contiguous run first: float weights bail out within their first
    // 257 elements, read in order, instead of 257 cold cache lines of an
    // evenly spread sample (which cost 10-15% of FULL compress speed).
    let head = n.min(SAMPLE / 2);
    // 2-byte elements (bf16, fp16) have few enough values for a bitmap
    // to find a 257th in the run: a bit each instead of a hash-table
    // insert (bf16 weights bail here).
    if w == 2 && more_than_max_u16(&body[..head * w]) {
        return false;
    }
    let mut t = Table::new();
    let mut counts = [0u32; 256];
    for e in body[..head * w].chunks_exact(w) {
        let Some(v) = t.insert(key(e)) else {
            return false;
        };
        counts[v as usize] += 1;
    }
    // bf16 weights (a few hundred values) fail the entropy test on the
    // run already: no spread sample for them either.
    if !worth(&t, &counts, n, w) {
        return false;
    }
    if head == n {
        return true;
    }
    for e in body[head * w..].chunks_exact(w).step_by(step) {
        let Some(v) = t.insert(key(e)) else {
            return false;
        };
        counts[v as usize] += 1;
    }
    worth(&t, &counts, n, w)
}

/// Whether the 2-byte elements of `run` take more than [`MAX`] distinct
/// values (what [`Table::insert`] would find at the same element).
fn more_than_max_u16(run: &[u8]) -> bool {
    let mut seen = [0u64; 1 << 10];
    let mut distinct = 0;
    for e in run.chunks_exact(2) {
        let v = usize::from(u16::from_le_bytes([e[0], e[1]]));
        let (word, bit) = (v >> 6, 1u64 << (v & 63));
        distinct += usize::from(seen[word] & bit == 0);
        seen[word] |= bit;
        if distinct > MAX {
            return true;
        }
    }
    false
}

/// The test of [`screen`] on the values sampled so far.
fn worth(t: &Table, counts: &[u32; 256], n: usize, w: usize) -> bool {
    // The palette alone costs `len * w * 8 / n` bits an element, and byte
    // grouping codes at most `8 * w`: at 0.9 of that (a small tensor of
    // distinct values) the test fails without computing an entropy.
    if t.len * 10 >= n * 9 {
        return false;
    }
    entropy_test(t, counts, n, w)
}

/// The order-0 entropy of the sampled values plus the palette against
/// the summed entropies of their byte positions, each summed over the
/// counts present only (a small tensor's screen took most of its encode
/// clearing and walking eight 256-bin histograms). Its own
/// `-c log2(c / m)`, apart from `stats::entropy_bits`, so the block
/// coders' hot callers of that keep their inlining.
fn entropy_test(t: &Table, counts: &[u32; 256], n: usize, w: usize) -> bool {
    let counts = &counts[..t.len];
    let total = counts.iter().sum::<u32>();
    let m = f64::from(total);
    // `-c log2(c / m)` as `c log2 m - c log2 c`, from the table of
    // `c log2 c` (every count of the sample is below its size): a call to
    // `log2` a value was a sixth of a 256-byte bf16 tensor's encode.
    let log = Log2::get();
    let log_m = log.of(total);
    let term = |c: u32| f64::from(c) * log_m - log.x_of(c);
    let joint =
        counts.iter().map(|&c| term(c)).sum::<f64>() / m + (t.len * w * 8) as f64 / n as f64;
    // Each distinct value's key, in the order of `counts`.
    let mut keys = [0u64; MAX];
    for i in (0..SLOTS).filter(|&i| t.vals[i] != EMPTY) {
        keys[t.vals[i] as usize] = t.keys[i];
    }
    let keys = &keys[..t.len];
    let mut grouped = 0.0;
    for k in 0..w {
        // Byte position `k`'s histogram, then each bin present taken once.
        let mut h = [0u32; 256];
        for (&key, &c) in keys.iter().zip(counts) {
            h[(key >> (8 * k)) as u8 as usize] += c;
        }
        let mut bits = 0.0;
        for &key in keys {
            let bin = &mut h[(key >> (8 * k)) as u8 as usize];
            if *bin > 0 {
                bits += term(*bin);
                *bin = 0;
            }
        }
        grouped += bits / m;
    }
    joint < 0.9 * grouped
}

/// The palette of `body` (`w` bytes an element), sorted, and each
/// element's index into it, written to `idx`; `None` at the 257th
/// distinct value.
pub(crate) fn scan(body: &[u8], w: usize, idx: &mut Vec<u8>) -> Option<Vec<u64>> {
    let mut t = Table::new();
    for e in body.chunks_exact(w) {
        t.insert(key(e))?;
    }
    let mut pal: Vec<u64> = (0..SLOTS)
        .filter(|&i| t.vals[i] != EMPTY)
        .map(|i| t.keys[i])
        .collect();
    pal.sort_unstable();
    // Values become ranks in the sorted palette.
    for (r, &k) in pal.iter().enumerate() {
        let i = t.slot(k);
        t.vals[i] = r as u16;
    }
    idx.clear();
    idx.extend(body.chunks_exact(w).map(|e| t.vals[t.slot(key(e))] as u8));
    Some(pal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn key_reads_elements_of_every_width_little_endian() {
        let bytes = [0x11u8, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88];
        for w in 1..=8 {
            let want = (0..w).fold(0u64, |k, i| k | u64::from(bytes[i]) << (8 * i));
            assert_eq!(key(&bytes[..w]), want, "width {w}");
        }
    }

    /// The entropy test as first written: a histogram per byte position,
    /// entropies by `-c log2(c / m)` over every bin.
    fn entropy_test_by_definition(t: &Table, counts: &[u32; 256], n: usize, w: usize) -> f64 {
        let bits = |h: &[u32; 256]| -> f64 {
            let m = f64::from(h.iter().sum::<u32>());
            h.iter()
                .filter(|&&c| c > 0)
                .map(|&c| -f64::from(c) * (f64::from(c) / m).log2())
                .sum()
        };
        let mut bytes = [[0u32; 256]; 8];
        for i in (0..SLOTS).filter(|&i| t.vals[i] != EMPTY) {
            let c = counts[t.vals[i] as usize];
            for (h, b) in bytes.iter_mut().zip(t.keys[i].to_le_bytes()).take(w) {
                h[b as usize] += c;
            }
        }
        let m = f64::from(counts.iter().sum::<u32>());
        let joint = bits(counts) / m + (t.len * w * 8) as f64 / n as f64;
        let grouped: f64 = bytes[..w].iter().map(|h| bits(h) / m).sum();
        // Below 0 the test passes.
        joint - 0.9 * grouped
    }

    proptest! {
        /// The entropy test from the table of `c log2 c` decides as the
        /// definition does, but within rounding of the threshold.
        #[test]
        fn the_entropy_test_matches_its_definition(
            w in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            n in 1usize..3072,
            distinct in 1usize..=256,
            skew in 0u32..8,
            seed in any::<u64>(),
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let mut next = || rng.next_u64();
            // Values sharing some bytes (a small range, shifted), counts
            // skewed towards the first ones.
            let values: Vec<u64> = (0..distinct).map(|_| (next() % 1024) << (next() % 5 * 8)).collect();
            let mut t = Table::new();
            let mut counts = [0u32; 256];
            for _ in 0..n {
                let r = next();
                let i = (r as usize % distinct) >> ((r >> 32) as u32 % (skew + 1));
                let e = &values[i].to_le_bytes()[..w];
                let Some(c) = t.insert(key(e)) else { break };
                counts[c as usize] += 1;
            }
            let margin = entropy_test_by_definition(&t, &counts, n, w);
            if margin.abs() > 1e-9 {
                prop_assert_eq!(entropy_test(&t, &counts, n, w), margin < 0.0);
            }
        }

        /// The bitmap count of 2-byte values bails where the table would.
        #[test]
        fn the_u16_bitmap_finds_a_257th_value_where_the_table_does(
            values in 200usize..320,
            len in 0usize..1200,
            seed in any::<u64>(),
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let run: Vec<u8> = (0..len)
                .flat_map(|_| ((rng.next_u64() % values as u64) as u16 * 97).to_le_bytes())
                .collect();
            let mut t = Table::new();
            let table_bails = run.chunks_exact(2).any(|e| t.insert(key(e)).is_none());
            prop_assert_eq!(more_than_max_u16(&run), table_bails);
        }

        /// The shortcut in `worth` (a palette of 0.9 of the elements or
        /// more fails) decides as the entropy test would.
        #[test]
        fn a_palette_of_nearly_every_element_fails_the_entropy_test_too(
            w in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            n in 1usize..600,
            distinct in 1usize..=256,
            seed in any::<u64>(),
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let mut next = || rng.next_u64();
            let values: Vec<u64> = (0..distinct).map(|_| next()).collect();
            let mut t = Table::new();
            let mut counts = [0u32; 256];
            for i in 0..n {
                let v = values[if i < distinct { i } else { next() as usize % distinct }];
                let e = &v.to_le_bytes()[..w];
                let Some(c) = t.insert(key(e)) else { break };
                counts[c as usize] += 1;
            }
            if t.len * 10 >= n * 9 {
                prop_assert!(!entropy_test(&t, &counts, n, w));
            }
            prop_assert_eq!(worth(&t, &counts, n, w), t.len * 10 < n * 9 && entropy_test(&t, &counts, n, w));
        }
    }
}
