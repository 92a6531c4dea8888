//! Bit-packed blocks (mode 5), their payload and coder: every symbol of
//! the block is `lo + (v << s)` (modulo 256) for a `k`-bit `v` (`k` of 1
//! to 7, `k + s` at most 8), and is stored as that `v`, LSB-first, with no
//! table.
//!
//! Where it pays: a stream whose values fill such a set almost evenly. The
//! top mantissa bits and the sign of a tensor that is never negative
//! (Adam's second moment, a quarter of an fp32 optimizer state's bytes
//! outside its exponents) are such a stream: after the sign rotation the
//! sign is the lowest bit, always 0, over 7 near-even mantissa bits. A
//! Huffman code takes 7.02 bits a symbol there (its table included),
//! packing exactly 7, and Huffman decodes with one table lookup per
//! symbol, each waiting on the last, where eight packed symbols are one
//! load and a few independent shifts.

use super::DecodeError;

/// How a block's symbols pack: each is `lo + (v << shift)` (modulo 256)
/// with `v` below `2^bits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub lo: u8,
    pub bits: u32,
    pub shift: u32,
}

impl Shape {
    /// A shape a decoder accepts: 1 to 7 bits, which shifted stay in a
    /// byte.
    fn valid(bits: u32, shift: u32) -> bool {
        (1..8).contains(&bits) && bits + shift <= 8
    }

    /// The packing of the symbols an exact histogram counts, if they pack
    /// in 7 bits or fewer. The shift is the largest that divides every
    /// symbol's distance from the least.
    pub fn of(h: &[u32; 256]) -> Option<Shape> {
        let lo = h.iter().position(|&c| c > 0)?;
        let hi = 255 - h.iter().rev().position(|&c| c > 0)?;
        Shape::of_range(h, lo as u8, hi as u8)
    }

    /// [`Shape::of`] for a histogram whose least and greatest symbols
    /// are known to be `lo` and `hi`.
    pub fn of_range(h: &[u32; 256], lo: u8, hi: u8) -> Option<Shape> {
        let diffs = (lo..=hi)
            .filter(|&v| h[v as usize] > 0)
            .fold(0, |a, v| a | (v ^ lo));
        Shape::of_bounds(lo, hi, diffs)
    }

    /// The packing of symbols from `lo` to `hi` that differ from one
    /// another only in the bits of `diffs` (any symbol XOR all the others,
    /// ORed), if it takes 7 bits or fewer: the same shape as [`Shape::of`]
    /// on their exact histogram, since the largest power of two dividing
    /// every distance from the least is the lowest bit in which any two
    /// symbols differ.
    pub fn of_bounds(lo: u8, hi: u8, diffs: u8) -> Option<Shape> {
        if lo > hi {
            return None;
        }
        let shift = if diffs == 0 {
            0
        } else {
            diffs.trailing_zeros()
        };
        let span = ((hi - lo) as u32) >> shift;
        let bits = (u32::BITS - span.leading_zeros()).max(1);
        Shape::valid(bits, shift).then_some(Shape { lo, bits, shift })
    }

    /// Payload bytes of `n` symbols packed this way.
    pub fn payload_bytes(&self, n: usize) -> usize {
        3 + (n * self.bits as usize).div_ceil(8)
    }
}

/// Append the packed payload of `syms` (each of the shape) to `out`:
/// `lo u8 | bits u8 | shift u8 | ceil(n bits / 8) bytes`, symbol `i`'s
/// `v` in bits `i bits .. (i + 1) bits`. Eight symbols fill exactly `bits`
/// bytes.
pub fn encode(syms: &[u8], shape: Shape, out: &mut Vec<u8>) {
    let Shape { lo, bits: k, shift } = shape;
    debug_assert!(Shape::valid(k, shift));
    out.push(lo);
    out.push(k as u8);
    out.push(shift as u8);
    let start = out.len();
    let len = (syms.len() * k as usize).div_ceil(8);
    // Eight bytes of room past the end: every group is stored whole, the
    // next one overwriting its spare bytes.
    out.resize(start + len + 8, 0);
    pack(syms, lo, k, shift, &mut out[start..]);
    out.truncate(start + len);
}

/// The byte `b` in every byte of a word.
#[inline(always)]
fn each_byte(b: u64) -> u64 {
    b * 0x0101_0101_0101_0101
}

/// Masks of [`spread`]'s steps: the low `k` bits of every 16-bit lane,
/// `2k` of every 32-bit lane, `4k` of the word.
fn masks(k: u32) -> [u64; 3] {
    let rep = |field: u64, lane: u32| (0..64 / lane).fold(0u64, |a, i| a | field << (lane * i));
    [
        rep((1 << k) - 1, 16),
        rep((1 << (2 * k)) - 1, 32),
        (1 << (4 * k)) - 1,
    ]
}

/// Eight symbols less `lo`, shifted down, as eight `k`-bit fields in the
/// low `8k` bits: pairs of fields joined in each 16-bit lane, then pairs
/// of those in each 32-bit lane, then the two halves.
#[inline(always)]
fn squeeze(w: u64, k: u32) -> u64 {
    let x = (w & 0x00ff_00ff_00ff_00ff) | ((w & 0xff00_ff00_ff00_ff00) >> (8 - k));
    let y = (x & 0x0000_ffff_0000_ffff) | ((x & 0xffff_0000_ffff_0000) >> (16 - 2 * k));
    (y & 0xffff_ffff) | ((y >> 32) << (4 * k))
}

/// The inverse of [`squeeze`]: eight `k`-bit fields, each in a byte.
#[inline(always)]
fn spread(v: u64, k: u32, m: &[u64; 3]) -> u64 {
    let y = (v & m[2]) | ((v << (32 - 4 * k)) & (m[2] << 32));
    let x = (y & m[1]) | ((y << (16 - 2 * k)) & (m[1] << 16));
    (x & m[0]) | ((x << (8 - k)) & (m[0] << 8))
}

/// Subtract `lo` from every byte, modulo 256 (the inverse of the
/// decoder's addition).
#[inline(always)]
fn sub_bytes(w: u64, los: u64) -> u64 {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    ((w | HIGH) - (los & !HIGH)) ^ ((w ^ !los) & HIGH)
}

/// Add `lo` to every byte, modulo 256: the low seven bits of each byte are
/// added, the top bit is their carry plus both top bits, without a carry
/// out.
#[inline(always)]
fn add_bytes(w: u64, los: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    ((w & LOW7) + (los & LOW7)) ^ ((w ^ los) & !LOW7)
}

/// The fields of `syms` into `dst`, which has 8 bytes of room past the
/// packed length.
#[inline(always)]
fn pack_body(syms: &[u8], lo: u8, k: u32, shift: u32, dst: &mut [u8]) {
    let kb = k as usize;
    let los = each_byte(lo as u64);
    let mask = each_byte((1 << k) - 1);
    // The shift brings bits of the byte above into each byte's top: the
    // mask keeps each byte's `k` field only.
    let group = |w: u64| squeeze((sub_bytes(w, los) >> shift) & mask, k);
    let mut it = syms.chunks_exact(8);
    for (g, c) in (&mut it).enumerate() {
        let v = group(u64::from_le_bytes(c.try_into().expect("8 symbols")));
        dst[g * kb..g * kb + 8].copy_from_slice(&v.to_le_bytes());
    }
    let rest = it.remainder();
    if !rest.is_empty() {
        let mut b = [lo; 8];
        b[..rest.len()].copy_from_slice(rest);
        let g = syms.len() / 8;
        dst[g * kb..g * kb + 8].copy_from_slice(&group(u64::from_le_bytes(b)).to_le_bytes());
    }
}

dispatch!(pack, pack_body, (syms: &[u8], lo: u8, k: u32, shift: u32, dst: &mut [u8]));

/// Decode a packed payload into `out` (its symbol count). `offset` is the
/// payload's place in the frame, for errors.
pub fn decode(payload: &[u8], offset: u64, out: &mut [u8]) -> Result<(), DecodeError> {
    let corrupt = |reason| DecodeError::Corrupt { offset, reason };
    let [lo, k, shift, data @ ..] = payload else {
        return Err(corrupt("packed block shorter than its header"));
    };
    let (k, shift) = (*k as u32, *shift as u32);
    if !Shape::valid(k, shift) {
        return Err(corrupt(
            "packed block width not 1 to 7 bits, or width and shift above 8",
        ));
    }
    if data.len() != (out.len() * k as usize).div_ceil(8) {
        return Err(corrupt("packed block length differs from its symbol count"));
    }
    unpack(data, *lo, k, shift, out);
    Ok(())
}

/// Eight symbols from each `k` bytes: the `k`-bit fields of a 64-bit load,
/// each in a byte of its own ([`spread`]; `k + shift <= 8` keeps them
/// there shifted), shifted and added to `lo` byte by byte, modulo 256. The
/// last group, short of 8 readable bytes, goes through a zero-padded copy.
#[inline(always)]
fn unpack_body(data: &[u8], lo: u8, k: u32, shift: u32, out: &mut [u8]) {
    let kb = k as usize;
    let m = masks(k);
    let los = each_byte(lo as u64);
    let one = |v: u64| add_bytes(spread(v, k, &m) << shift, los);
    let groups = out.len() / 8;
    // Groups whose 8-byte load stays inside `data`.
    let fast = match data.len().checked_sub(8) {
        Some(last) => (last / kb + 1).min(groups),
        None => 0,
    };
    for (g, o) in out.chunks_exact_mut(8).take(fast).enumerate() {
        let v = u64::from_le_bytes(data[g * kb..g * kb + 8].try_into().expect("8 bytes"));
        o.copy_from_slice(&one(v).to_le_bytes());
    }
    for (g, o) in out.chunks_mut(8).enumerate().skip(fast) {
        let mut b = [0u8; 8];
        let src = &data[g * kb..];
        let n = src.len().min(8);
        b[..n].copy_from_slice(&src[..n]);
        let w = one(u64::from_le_bytes(b)).to_le_bytes();
        o.copy_from_slice(&w[..o.len()]);
    }
}

dispatch!(unpack, unpack_body, (data: &[u8], lo: u8, k: u32, shift: u32, out: &mut [u8]));

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Symbol `i` read bit by bit: the reference for `unpack`.
    fn naive_unpack(data: &[u8], s: Shape, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| {
                let mut v = 0u32;
                for b in 0..s.bits as usize {
                    let bit = i * s.bits as usize + b;
                    v |= ((data[bit / 8] >> (bit % 8)) as u32 & 1) << b;
                }
                s.lo.wrapping_add((v << s.shift) as u8)
            })
            .collect()
    }

    fn shape_of(syms: &[u8]) -> Option<Shape> {
        let mut h = [0u32; 256];
        for &s in syms {
            h[s as usize] += 1;
        }
        Shape::of(&h)
    }

    #[test]
    fn the_shape_is_the_fewest_bits_of_the_span_over_its_step() {
        let sh = |lo, bits, shift| Some(Shape { lo, bits, shift });
        assert_eq!(shape_of(&[5]), sh(5, 1, 0));
        assert_eq!(shape_of(&[0, 1]), sh(0, 1, 0));
        assert_eq!(shape_of(&[0, 127, 3]), sh(0, 7, 0));
        assert_eq!(shape_of(&[128, 255]), sh(128, 7, 0));
        assert_eq!(shape_of(&[10, 17, 12]), sh(10, 3, 0));
        assert_eq!(shape_of(&[0, 128]), sh(0, 1, 7));
        assert_eq!(shape_of(&[0, 128, 1]), None);
        assert_eq!(shape_of(&[0, 129]), None);
        // Non-negative floats: the rotated sign, bit 0, is always 0.
        assert_eq!(shape_of(&[0, 2, 254, 100]), sh(0, 7, 1));
        assert_eq!(shape_of(&[1, 3, 255]), sh(1, 7, 1));
        assert_eq!(shape_of(&[200, 255]), sh(200, 6, 0));
        assert_eq!(shape_of(&[130, 255]), sh(130, 7, 0));
        assert_eq!(shape_of(&[]), None);
    }

    #[test]
    fn damaged_payloads_are_errors() {
        let mut out = [0u8; 10];
        for (payload, why) in [
            (&[0, 7][..], "header"),
            (&[0, 0, 0, 0][..], "width"),
            (&[0, 8, 0, 0][..], "width"),
            (&[0, 1, 8, 0][..], "shift"),
            (&[0, 7, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], "shift"),
            (&[0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], "length"),
            (&[0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], "length"),
        ] {
            let e = decode(payload, 9, &mut out).unwrap_err();
            assert!(
                matches!(e, DecodeError::Corrupt { offset: 9, reason } if reason.contains(why)),
                "{payload:?}: {e}"
            );
        }
    }

    /// A decoder adds modulo 256: a crafted block may wrap past 255, and
    /// every byte lane of the SWAR addition wraps on its own.
    #[test]
    fn packed_symbols_wrap_modulo_256() {
        // lo 250, 3 bits: v = 7, 6, 5, 0, 1, 2, 3, 4, then 7 alone.
        let v: u64 = [7u64, 6, 5, 0, 1, 2, 3, 4]
            .iter()
            .enumerate()
            .fold(0, |a, (i, &x)| a | x << (3 * i));
        let mut payload = vec![250, 3, 0];
        payload.extend_from_slice(&v.to_le_bytes()[..3]);
        payload.push(7);
        let mut out = [0u8; 9];
        decode(&payload, 0, &mut out).unwrap();
        assert_eq!(out, [1, 0, 255, 250, 251, 252, 253, 254, 1]);
        assert_eq!(
            naive_unpack(
                &payload[3..],
                Shape {
                    lo: 250,
                    bits: 3,
                    shift: 0
                },
                9
            ),
            out
        );
    }

    /// Every width and shift, lengths around whole groups, symbols from the
    /// project's generator: the SWAR steps against the bit-by-bit reader.
    #[test]
    fn every_shape_round_trips() {
        let mut rng = crate::testing::Rng(0x5eed_1234);
        for bits in 1..8u32 {
            for shift in 0..=8 - bits {
                let top = 255 - (((1u32 << bits) - 1) << shift);
                for lo in [0, top / 2, top] {
                    for n in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000] {
                        let syms: Vec<u8> = (0..n)
                            .map(|_| {
                                let v = rng.next_u64() as u32 & ((1 << bits) - 1);
                                (lo + (v << shift)) as u8
                            })
                            .collect();
                        let shape = Shape {
                            lo: lo as u8,
                            bits,
                            shift,
                        };
                        let mut payload = Vec::new();
                        encode(&syms, shape, &mut payload);
                        assert_eq!(payload.len(), shape.payload_bytes(n), "{shape:?} n {n}");
                        assert_eq!(
                            naive_unpack(&payload[3..], shape, n),
                            syms,
                            "{shape:?} n {n}"
                        );
                        let mut out = vec![0u8; n];
                        decode(&payload, 0, &mut out).unwrap();
                        assert_eq!(out, syms, "{shape:?} n {n}");
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn the_shape_from_bounds_is_the_shape_from_the_histogram(
            syms in prop_oneof![
                proptest::collection::vec(any::<u8>(), 1..200),
                // Few values on a step: the shapes that pack.
                (any::<u8>(), 0u32..8, proptest::collection::vec(0u8..4, 1..200))
                    .prop_map(|(lo, shift, v)| v.iter().map(|&x| lo.wrapping_add(x << shift)).collect()),
            ],
        ) {
            let lo = *syms.iter().min().unwrap();
            let hi = *syms.iter().max().unwrap();
            let diffs = syms.iter().fold(0, |a, &s| a | (s ^ syms[0]));
            prop_assert_eq!(Shape::of_bounds(lo, hi, diffs), shape_of(&syms));
        }

        #[test]
        fn packed_blocks_round_trip_and_match_the_naive_reader(
            lo in 0u8..=255,
            bits in 1u32..8,
            shift in 0u32..8,
            seeds in proptest::collection::vec(any::<u8>(), 1..300),
        ) {
            // The encoder packs what does not wrap past 255.
            prop_assume!(
                Shape::valid(bits, shift) && lo as u32 + (((1 << bits) - 1) << shift) <= 255
            );
            let syms: Vec<u8> = seeds
                .iter()
                .map(|&s| lo + ((s as u32 & ((1 << bits) - 1)) << shift) as u8)
                .collect();
            let shape = shape_of(&syms).expect("packs");
            prop_assert!(shape.bits <= bits);
            let mut payload = Vec::new();
            encode(&syms, shape, &mut payload);
            prop_assert_eq!(payload.len(), shape.payload_bytes(syms.len()));
            let mut out = vec![0u8; syms.len()];
            decode(&payload, 0, &mut out).unwrap();
            prop_assert_eq!(&out, &syms);
            prop_assert_eq!(naive_unpack(&payload[3..], shape, syms.len()), syms);
        }
    }
}
