//! Sparse blocks (mode 7, format version 7): a block in which one symbol,
//! `z`, fills all but a few places is stored as the places and symbols of
//! the others, not symbol by symbol.
//!
//! Owns: the sparse payload, its coder and its decoder, and the two small
//! sub-blocks inside it (gap buckets and symbols, each raw, constant,
//! Huffman or bit-packed). Stands on `huffman` and `packed`; `block`
//! chooses it and nothing here chooses between block modes.
//!
//! Where it pays: the top byte of a delta's elements (a ULP difference's
//! high byte, or the XOR of two exponents) is 0 almost everywhere, one
//! symbol in tens or hundreds not. rANS codes such a block at 0.05-0.8
//! bits a symbol but still spends a table lookup and a state update on
//! every symbol (a third of the decode time of a fine-tune's weight
//! deltas, where half the rANS symbols are such); here the decoder fills
//! the block with `z` and then does work per symbol that is not `z`.
//!
//! A gap (the number of `z` symbols before a symbol that is not `z`, since
//! the previous one) is coded as its bucket, the bit length of the gap
//! (0 for a gap of 0), entropy coded, and the bits below the top one
//! verbatim, as DEFLATE codes match distances; for the geometric gaps of
//! scattered changes this is within a few hundredths of a bit of their
//! entropy, with a table of at most 17 symbols.

use super::bits::{BitReader, BitWriter};
use super::stats::{entropy_bits, histogram};
use super::{huffman, leb, packed, DecodeError};

/// Sub-block codings: the block mode codes of raw, constant, Huffman and
/// bit-packed blocks.
const SUB_RAW: u8 = 0;
const SUB_CONST: u8 = 1;
const SUB_HUFFMAN: u8 = 2;
const SUB_PACKED: u8 = 5;

/// The longest count or length (LEB128): 3 bytes, below 2^21; a block's
/// counts and sub-block lengths are below 2^17.
const LEB_BYTES: usize = 3;

/// Greatest gap bucket: a block holds at most 65,536 symbols, so a gap is
/// below 2^16.
const MAX_BUCKET: u8 = 16;

/// The bucket of gap `g` and how many verbatim bits follow it.
fn bucket(g: u32) -> (u8, u32) {
    let b = (u32::BITS - g.leading_zeros()) as u8;
    (b, extra_bits(b))
}

/// Verbatim bits after bucket `b`: the gap's bits below its top one.
fn extra_bits(b: u8) -> u32 {
    (b as u32).saturating_sub(1)
}

/// The most common symbol of `h` and how many symbols are not it.
pub fn dominant(h: &[u32; 256]) -> (u8, u32) {
    let (z, &c) = h
        .iter()
        .enumerate()
        .max_by_key(|&(s, &c)| (c, std::cmp::Reverse(s)))
        .expect("256 counts");
    (z as u8, h.iter().sum::<u32>() - c)
}

/// The coder's memory, kept between blocks.
#[derive(Default)]
pub struct EncodeScratch {
    buckets: Vec<u8>,
    values: Vec<u8>,
    /// The verbatim bits, packed LSB-first.
    extra: Vec<u8>,
    sub: Vec<u8>,
    huffman: huffman::EncodeScratch,
    /// The last payload [`plan`] built.
    pub payload: Vec<u8>,
}

/// The gaps and symbols of a block, as they are found.
struct Gaps<'a> {
    buckets: &'a mut Vec<u8>,
    values: &'a mut Vec<u8>,
    extra: &'a mut Vec<u8>,
    /// Verbatim bits not yet a whole byte.
    bits: BitWriter,
    /// The place after the last symbol found.
    next: usize,
}

impl Gaps<'_> {
    /// Symbol `v`, not `z`, at place `at`.
    fn put(&mut self, at: usize, v: u8) {
        let gap = (at - self.next) as u32;
        let (b, e) = bucket(gap);
        self.buckets.push(b);
        self.values.push(v);
        self.bits
            .put(u64::from(gap & ((1 << e) - 1)), e, self.extra);
        self.next = at + 1;
    }
}

/// Build the sparse payload of `syms` around `z` in `scratch.payload` and
/// return its length; None when more than `max_others` symbols are not
/// `z` (the scan stops there), when none is, or when the payload could not
/// come under `limit` bytes (the order-0 entropy of the buckets and of
/// the symbols plus the gap bits, a bound no coding of them comes under,
/// is checked before any is coded).
pub fn plan(
    syms: &[u8],
    z: u8,
    max_others: usize,
    limit: f64,
    scratch: &mut EncodeScratch,
) -> Option<usize> {
    let EncodeScratch {
        buckets,
        values,
        extra,
        sub,
        huffman,
        payload,
    } = scratch;
    buckets.clear();
    values.clear();
    extra.clear();
    let mut g = Gaps {
        buckets,
        values,
        extra,
        bits: BitWriter::default(),
        next: 0,
    };
    // Eight symbols at a time: the places where a word differs from eight
    // `z`s.
    let zz = u64::from_ne_bytes([z; 8]);
    let words = syms.len() / 8;
    for (i, w) in syms.chunks_exact(8).enumerate() {
        let mut d = u64::from_le_bytes(w.try_into().expect("8 bytes")) ^ zz;
        while d != 0 {
            let j = d.trailing_zeros() as usize / 8;
            g.put(8 * i + j, syms[8 * i + j]);
            d &= !(0xff << (8 * j));
        }
        if g.buckets.len() > max_others {
            return None;
        }
    }
    for (at, &s) in syms.iter().enumerate().skip(8 * words) {
        if s != z {
            g.put(at, s);
        }
    }
    g.bits.finish(g.extra);
    let k = buckets.len();
    if k == 0 || k > max_others {
        return None;
    }
    let bound = (entropy_bits(&histogram(buckets)) + entropy_bits(&histogram(values))) / 8.0
        + extra.len() as f64;
    if bound > limit {
        return None;
    }
    payload.clear();
    payload.push(z);
    leb::write(k as u64, payload);
    put_sub(buckets, payload, sub, huffman);
    put_sub(values, payload, sub, huffman);
    payload.extend_from_slice(extra);
    Some(payload.len())
}

/// Append a sub-block of `syms`: `coding u8 | len LEB128 | payload`, in
/// the smallest of raw, constant, bit-packed and Huffman.
fn put_sub(syms: &[u8], out: &mut Vec<u8>, sub: &mut Vec<u8>, hs: &mut huffman::EncodeScratch) {
    let h = histogram(syms);
    let n = syms.len();
    sub.clear();
    let mut coding = SUB_RAW;
    if h.iter().filter(|&&c| c > 0).count() == 1 {
        coding = SUB_CONST;
        sub.push(syms[0]);
    } else {
        let lens = huffman::code_lengths(&h, huffman::MAX_BITS);
        let huff = huffman::table_bytes(&lens)
            + 12
            + (huffman::coded_bits(&h, &lens) as usize).div_ceil(8);
        let shape = packed::Shape::of(&h);
        let pack = shape.map_or(usize::MAX, |p| p.payload_bytes(n));
        if pack <= huff.min(n) {
            coding = SUB_PACKED;
            packed::encode(syms, shape.expect("packs"), sub);
        } else if huff < n {
            huffman::encode(syms, &lens, sub, hs);
            coding = SUB_HUFFMAN;
        }
        // Huffman's four sub-streams each end on a byte: its estimate may
        // run a few bytes short.
        if coding != SUB_RAW && sub.len() >= n {
            sub.clear();
            coding = SUB_RAW;
        }
        if coding == SUB_RAW {
            sub.extend_from_slice(syms);
        }
    }
    out.push(coding);
    leb::write(sub.len() as u64, out);
    out.extend_from_slice(sub);
}

/// Decode the sparse payload `frame[start..start+len]` into `out` (its
/// symbol count, at most 65,536). `buf` holds the decoded sub-blocks;
/// `table` is the Huffman decoder's.
pub fn decode(
    frame: &[u8],
    start: usize,
    len: usize,
    out: &mut [u8],
    table: &mut huffman::DecodeTable,
    buf: &mut Vec<u8>,
) -> Result<(), DecodeError> {
    let end = start + len;
    let corrupt = |at: usize, reason| DecodeError::Corrupt {
        offset: at as u64,
        reason,
    };
    let m = out.len();
    let z = *frame
        .get(start)
        .filter(|_| len > 0)
        .ok_or(corrupt(start, "sparse block shorter than its header"))?;
    let (k, mut pos) = leb::read(frame, start + 1, end, LEB_BYTES)?;
    if k == 0 || k > m as u64 {
        return Err(corrupt(
            start + 1,
            "sparse block count not 1 to its symbols",
        ));
    }
    let k = k as usize;
    buf.resize(2 * k, 0);
    let (buckets, values) = buf.split_at_mut(k);
    pos = read_sub(frame, pos, end, buckets, table)?;
    pos = read_sub(frame, pos, end, values, table)?;
    if buckets.iter().any(|&b| b > MAX_BUCKET) {
        return Err(corrupt(pos, "sparse gap bucket above 16"));
    }
    let bits: u64 = buckets.iter().map(|&b| extra_bits(b) as u64).sum();
    if (end - pos) as u64 != bits.div_ceil(8) {
        return Err(corrupt(pos, "sparse gap bits differ from their buckets"));
    }
    out.fill(z);
    let mut r = BitReader::new(frame, pos, end);
    let mut at = 0usize;
    for (&b, &v) in buckets.iter().zip(values.iter()) {
        let gap = match b {
            0 | 1 => b as usize,
            _ => {
                let e = extra_bits(b);
                let low = r.peek_safe(e) as usize;
                r.consume(e);
                (1 << e) | low
            }
        };
        at += gap;
        if at >= m {
            return Err(corrupt(pos, "sparse gaps run past the block"));
        }
        out[at] = v;
        at += 1;
    }
    Ok(())
}

/// Decode the sub-block at `frame[pos..end]` into `out`; returns the
/// position after it.
fn read_sub(
    frame: &[u8],
    pos: usize,
    end: usize,
    out: &mut [u8],
    table: &mut huffman::DecodeTable,
) -> Result<usize, DecodeError> {
    let corrupt = |reason| DecodeError::Corrupt {
        offset: pos as u64,
        reason,
    };
    let coding = *frame
        .get(pos)
        .filter(|_| pos < end)
        .ok_or(corrupt("sparse sub-block cut short"))?;
    let (len, at) = leb::read(frame, pos + 1, end, LEB_BYTES)?;
    if len > (end - at) as u64 {
        return Err(corrupt("sparse sub-block longer than its block"));
    }
    let len = len as usize;
    let payload = &frame[at..at + len];
    match coding {
        SUB_RAW if len == out.len() => out.copy_from_slice(payload),
        SUB_CONST if len == 1 => out.fill(payload[0]),
        SUB_RAW | SUB_CONST => return Err(corrupt("sparse sub-block length")),
        SUB_HUFFMAN => huffman::decode(frame, at, len, out, table)?,
        SUB_PACKED => packed::decode(payload, at as u64, out)?,
        _ => return Err(corrupt("unknown sparse sub-block coding")),
    }
    Ok(at + len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(syms: &[u8]) -> Option<usize> {
        let h = histogram(syms);
        let (z, _) = dominant(&h);
        let mut s = EncodeScratch::default();
        let len = plan(syms, z, syms.len(), f64::MAX, &mut s)?;
        let mut frame = vec![0xEE; 3];
        frame.extend_from_slice(&s.payload);
        frame.extend_from_slice(&[0xEE; 9]);
        let mut out = vec![0u8; syms.len()];
        let (mut t, mut buf) = (Default::default(), Vec::new());
        decode(&frame, 3, len, &mut out, &mut t, &mut buf).unwrap();
        assert_eq!(out, syms);
        Some(len)
    }

    proptest! {
        #[test]
        fn sparse_blocks_decode_to_their_symbols(
            len in 1usize..70_000,
            z in any::<u8>(),
            others in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..300),
        ) {
            let mut syms = vec![z; len.min(65_536)];
            let n = syms.len();
            for (at, v) in others {
                syms[at % n] = v;
            }
            round_trip(&syms);
        }
    }

    /// Gaps at every bucket's edges (0, 1, 2, 3, 2^b - 1, 2^b, the whole
    /// block), a symbol at the first and the last place.
    #[test]
    fn gaps_at_every_bucket_edge_decode() {
        let mut gaps = vec![0usize, 0, 1, 2, 3];
        for b in 2..16 {
            gaps.extend([(1 << b) - 1, 1 << b, (1 << b) + 1]);
        }
        let mut syms = Vec::new();
        for (i, &g) in gaps.iter().enumerate() {
            syms.extend(std::iter::repeat_n(7u8, g));
            syms.push(i as u8 % 5);
        }
        syms.truncate(65_536);
        *syms.last_mut().unwrap() = 1;
        syms[0] = 2;
        assert!(round_trip(&syms).is_some());
        let mut one = vec![0u8; 65_536];
        one[65_535] = 9;
        assert!(round_trip(&one).is_some());
    }

    /// The payload is smaller than rANS could make the same symbols on a
    /// delta's top byte: 1 in 200 symbols not 0, geometric gaps.
    #[test]
    fn a_scattered_block_codes_near_its_entropy() {
        let mut syms = vec![0u8; 65_536];
        let mut x = 12345u64;
        let mut others = 0;
        for s in syms.iter_mut() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if (x >> 33) % 200 == 0 {
                *s = 1 + ((x >> 20) % 2) as u8 * 2;
                others += 1;
            }
        }
        let h = histogram(&syms);
        let bits = super::super::stats::entropy_bits(&h);
        let len = round_trip(&syms).unwrap();
        assert!(
            (len as f64) < bits / 8.0 * 1.06 + 64.0,
            "{len} bytes for {others} symbols, entropy {} bytes",
            bits / 8.0
        );
    }

    #[test]
    fn damaged_sparse_payloads_are_errors() {
        let mut syms = vec![3u8; 4096];
        for i in (0..4096).step_by(37) {
            syms[i] = (i % 7) as u8;
        }
        let mut s = EncodeScratch::default();
        let len = plan(&syms, 3, 4096, f64::MAX, &mut s).unwrap();
        let p = s.payload.clone();
        let (mut t, mut buf) = (Default::default(), Vec::new());
        let mut out = vec![0u8; 4096];
        for cut in 0..len {
            assert!(decode(&p[..cut], 0, cut, &mut out, &mut t, &mut buf).is_err());
        }
        // Too few symbols for the gaps.
        let mut short = vec![0u8; 4000];
        assert!(decode(&p, 0, len, &mut short, &mut t, &mut buf).is_err());
        // A count of 0, and one beyond the block.
        let mut zero = p.clone();
        zero[1] = 0;
        assert!(decode(&zero, 0, len, &mut out, &mut t, &mut buf).is_err());
        let mut over = vec![3u8, 0x81, 0x20];
        over.extend_from_slice(&p[3..]);
        assert!(decode(&over, 0, over.len(), &mut out, &mut t, &mut buf).is_err());
        // A bucket above 16 (a raw bucket sub-block of one symbol, 17).
        let bad = [0u8, 1, SUB_RAW, 1, 17, SUB_RAW, 1, 5, 0xff, 0xff, 0x01];
        let mut big = vec![0u8; 65_536];
        assert!(decode(&bad, 0, bad.len(), &mut big, &mut t, &mut buf).is_err());
        // An unknown sub-block coding.
        let bad = [0u8, 1, 3, 1, 0, SUB_RAW, 1, 5];
        assert!(decode(&bad, 0, bad.len(), &mut big, &mut t, &mut buf).is_err());
        // A gap of bucket 1 fits; the extra bytes after it do not.
        let ok = [0u8, 1, SUB_RAW, 1, 1, SUB_RAW, 1, 5];
        decode(&ok, 0, ok.len(), &mut big[..4], &mut t, &mut buf).unwrap();
        assert_eq!(big[..4], [0, 5, 0, 0]);
        let mut extra = ok.to_vec();
        extra.push(0);
        assert!(decode(&extra, 0, extra.len(), &mut big[..4], &mut t, &mut buf).is_err());
    }
}
