//! LSB-first bits: the reader for the Huffman streams and gamma-coded
//! rANS tables, and the writer of sparse gaps, row indices and gamma
//! tables (Huffman's writer is the encoder's four-lane loop in `huffman`).
//!
//! Owns: reading bits past a buffer's end as zeros without a branch per
//! read (the callers check where their streams end), and appending fields
//! of up to 56 bits, least significant first, to a byte vector.

/// Reads bits LSB-first from `buf[start..end]`. The fast refill may load the
/// 8 bytes at the cursor even past `end` (they stay inside `buf`); bits past
/// `end` are never trusted: [`BitReader::overrun`] reports consuming them.
pub struct BitReader<'a> {
    pub(super) buf: &'a [u8],
    /// Next byte to load.
    pub(super) next: usize,
    end: usize,
    pub(super) acc: u64,
    /// Valid bits in `acc`; bits consumed = 8 * (next - start) - nbits.
    pub(super) nbits: u32,
    start: usize,
}

impl<'a> BitReader<'a> {
    pub fn new(buf: &'a [u8], start: usize, end: usize) -> Self {
        BitReader {
            buf,
            next: start,
            end,
            acc: 0,
            nbits: 0,
            start,
        }
    }
    #[inline(always)]
    pub fn peek(&self, n: u32) -> u64 {
        self.acc & ((1u64 << n) - 1)
    }
    /// Peek with a byte-wise refill that never reads past `end` (zeros there).
    pub fn peek_safe(&mut self, n: u32) -> u64 {
        while self.nbits <= 56 {
            let b = if self.next < self.end {
                self.buf[self.next]
            } else {
                0
            };
            self.acc |= (b as u64) << self.nbits;
            self.next += 1;
            self.nbits += 8;
        }
        self.peek(n)
    }
    #[inline(always)]
    pub fn consume(&mut self, n: u32) {
        self.acc >>= n;
        self.nbits -= n;
    }
    /// The next bit to read, counted from the start of `buf`.
    pub fn position(&self) -> usize {
        8 * self.next - self.nbits as usize
    }
    /// Continue reading at bit `bit` of `buf` (at or after the start).
    pub fn set_position(&mut self, bit: usize) {
        (self.next, self.acc, self.nbits) = (bit >> 3, 0, 0);
        if bit & 7 != 0 {
            self.peek_safe(0);
            self.consume(bit as u32 & 7);
        }
    }
    /// True when more bits were consumed than the stream holds.
    pub fn overrun(&self) -> bool {
        let consumed = 8 * (self.next - self.start) as u64 - self.nbits as u64;
        consumed > 8 * (self.end - self.start) as u64
    }
}

/// Appends bit fields LSB-first to a byte vector: each field starts at
/// the lowest bit not yet written; [`BitWriter::finish`] pads the last
/// byte with zeros.
#[derive(Default)]
pub struct BitWriter {
    /// Bits not yet a whole byte (fewer than 8 between calls), and how many.
    acc: u64,
    n: u32,
}

impl BitWriter {
    /// The low `bits` bits of `v` (at most 56; higher bits must be 0).
    #[inline(always)]
    pub fn put(&mut self, v: u64, bits: u32, out: &mut Vec<u8>) {
        debug_assert!(bits <= 56 && v >> bits == 0);
        self.acc |= v << self.n;
        self.n += bits;
        while self.n >= 8 {
            out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    /// The last, partial byte, if any.
    pub fn finish(self, out: &mut Vec<u8>) {
        if self.n > 0 {
            out.push(self.acc as u8);
        }
    }
}
