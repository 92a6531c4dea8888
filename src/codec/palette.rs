//! Palette frames (version 6, transform bit 7): a chunk whose whole
//! elements take at most 256 distinct values, stored as those values
//! (sorted, once) and one index byte per element, the index bytes then
//! coded as the single stream of a `u8` frame by the usual block coders
//! (bit-packed, Huffman or rANS as they pay).

/// At most this many distinct values (one index byte).
pub(crate) const MAX: usize = 256;

/// Slots of the open-addressing table: four times `MAX`, a power of two.
const SLOTS: usize = 1024;
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
    let mut b = [0u8; 8];
    b[..e.len()].copy_from_slice(e);
    u64::from_le_bytes(b)
}

/// A set of at most `MAX` keys, each with a `u8` value.
struct Table {
    keys: [u64; SLOTS],
    vals: [u16; SLOTS],
    len: usize,
}

impl Table {
    fn new() -> Box<Table> {
        Box::new(Table {
            keys: [0; SLOTS],
            vals: [EMPTY; SLOTS],
            len: 0,
        })
    }

    #[inline]
    fn slot(&self, k: u64) -> usize {
        let mut i = (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize;
        while self.vals[i] != EMPTY && self.keys[i] != k {
            i = (i + 1) & (SLOTS - 1);
        }
        i
    }

    /// Adds `k`; false when it would be the 257th key.
    #[inline]
    fn insert(&mut self, k: u64) -> bool {
        let i = self.slot(k);
        if self.vals[i] == EMPTY {
            if self.len == MAX {
                return false;
            }
            self.keys[i] = k;
            self.vals[i] = self.len as u16;
            self.len += 1;
        }
        true
    }
}

/// Whether up to 4096 evenly spread elements of `body` (`w` bytes each)
/// hold at most 256 distinct values: the cheap look before a full scan
/// (on float weights it bails out within a few hundred elements).
pub(crate) fn screen(body: &[u8], w: usize) -> bool {
    let n = body.len() / w;
    if n == 0 {
        return false;
    }
    let step = n.div_ceil(4096);
    let mut t = Table::new();
    for e in body.chunks_exact(w).step_by(step) {
        if !t.insert(key(e)) {
            return false;
        }
    }
    true
}

/// The palette of `body` (`w` bytes an element), sorted, and each
/// element's index into it, written to `idx`; `None` at the 257th
/// distinct value.
pub(crate) fn scan(body: &[u8], w: usize, idx: &mut Vec<u8>) -> Option<Vec<u64>> {
    let mut t = Table::new();
    for e in body.chunks_exact(w) {
        if !t.insert(key(e)) {
            return None;
        }
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
