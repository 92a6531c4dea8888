//! Interleaved rANS (four states, 12-bit probabilities, byte-wise
//! renormalisation) for blocks where Huffman's floor of one bit per symbol
//! wastes space: the mostly-zero streams of late-training deltas.
//!
//! Block payload (see docs/format/codec.md): `lo u8, hi u8, one LEB128
//! frequency per symbol lo..=hi (summing to 4096), four u32 LE final states,
//! then the renormalisation bytes in decoding order`.

use super::DecodeError;

pub const SCALE_BITS: u32 = 12;
const M: u32 = 1 << SCALE_BITS;
const L: u32 = 1 << 23;

/// Normalise a histogram (at least two symbols present) to frequencies
/// summing to 4096, every present symbol at least 1.
pub fn normalize(hist: &[u32; 256]) -> [u32; 256] {
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
pub fn coded_bits(hist: &[u32; 256], f: &[u32; 256]) -> f64 {
    let mut bits = 0.0;
    for s in 0..256 {
        if hist[s] > 0 {
            bits += hist[s] as f64 * (SCALE_BITS as f64 - (f[s] as f64).log2());
        }
    }
    bits
}

/// Bytes of the frequency table plus the four states.
pub fn header_bytes(f: &[u32; 256]) -> usize {
    let lo = f.iter().position(|&v| v > 0).unwrap_or(0);
    let hi = 255 - f.iter().rev().position(|&v| v > 0).unwrap_or(0);
    2 + f[lo..=hi].iter().map(|&v| varint_len(v)).sum::<usize>() + 16
}

fn varint_len(v: u32) -> usize {
    if v < 128 {
        1
    } else {
        2
    }
}

#[derive(Clone, Copy, Default)]
struct EncSym {
    x_max: u32,
    rcp_freq: u32,
    bias: u32,
    cmpl_freq: u32,
    rcp_shift: u32,
}

impl EncSym {
    // Division-free encoding with a reciprocal (Fabian Giesen's rans_byte).
    fn new(start: u32, freq: u32) -> EncSym {
        let x_max = ((L >> SCALE_BITS) << 8) * freq;
        let cmpl_freq = M - freq;
        if freq < 2 {
            EncSym {
                x_max,
                rcp_freq: !0,
                bias: start + M - 1,
                cmpl_freq,
                rcp_shift: 0,
            }
        } else {
            let mut shift = 0;
            while freq > (1u32 << shift) {
                shift += 1;
            }
            let rcp = (1u64 << (shift + 31)).div_ceil(freq as u64) as u32;
            EncSym {
                x_max,
                rcp_freq: rcp,
                bias: start,
                cmpl_freq,
                rcp_shift: shift - 1,
            }
        }
    }
}

/// Append the rANS payload of `syms` with normalised frequencies `f`.
pub fn encode(syms: &[u8], f: &[u32; 256], out: &mut Vec<u8>) {
    let lo = f.iter().position(|&v| v > 0).expect("symbols present");
    let hi = 255
        - f.iter()
            .rev()
            .position(|&v| v > 0)
            .expect("symbols present");
    out.push(lo as u8);
    out.push(hi as u8);
    let mut enc = [EncSym::default(); 256];
    let mut start = 0;
    for s in 0..256 {
        if (lo..=hi).contains(&s) {
            let v = f[s];
            if v < 128 {
                out.push(v as u8);
            } else {
                out.push((v & 127) as u8 | 128);
                out.push((v >> 7) as u8);
            }
        }
        if f[s] > 0 {
            enc[s] = EncSym::new(start, f[s]);
        }
        start += f[s];
    }
    // Encode backwards into a reversed byte stack.
    let mut stack: Vec<u8> = Vec::with_capacity(syms.len() / 2 + 16);
    let mut x = [L; 4];
    for (i, &s) in syms.iter().enumerate().rev() {
        let e = &enc[s as usize];
        let st = &mut x[i & 3];
        let mut v = *st;
        while v >= e.x_max {
            stack.push(v as u8);
            v >>= 8;
        }
        let q = (((v as u64 * e.rcp_freq as u64) >> 32) as u32) >> e.rcp_shift;
        *st = v + e.bias + q * e.cmpl_freq;
    }
    for st in x {
        out.extend_from_slice(&st.to_le_bytes());
    }
    out.extend(stack.iter().rev());
}

/// Decode `out.len()` symbols from `payload`.
pub fn decode(payload: &[u8], offset: u64, out: &mut [u8]) -> Result<(), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    if payload.len() < 2 {
        return Err(corrupt("rans block shorter than its header"));
    }
    let (lo, hi) = (payload[0] as usize, payload[1] as usize);
    if lo > hi {
        return Err(corrupt("rans symbol range is empty"));
    }
    let mut p = 2;
    let mut slots = vec![0u32; M as usize];
    let mut start = 0u32;
    for s in lo..=hi {
        let b0 = *payload.get(p).ok_or(corrupt("rans table truncated"))? as u32;
        p += 1;
        let v = if b0 & 128 != 0 {
            let b1 = *payload.get(p).ok_or(corrupt("rans table truncated"))? as u32;
            p += 1;
            (b0 & 127) | (b1 << 7)
        } else {
            b0
        };
        if v >= M || start + v > M {
            return Err(corrupt("rans frequencies exceed 4096"));
        }
        for slot in &mut slots[start as usize..(start + v) as usize] {
            *slot = s as u32 | (v << 8) | (start << 20);
        }
        start += v;
    }
    if start != M {
        return Err(corrupt("rans frequencies do not sum to 4096"));
    }
    if payload.len() < p + 16 {
        return Err(corrupt("rans states truncated"));
    }
    let mut x: [u32; 4] = std::array::from_fn(|j| {
        u32::from_le_bytes(
            payload[p + 4 * j..p + 4 * j + 4]
                .try_into()
                .expect("4 bytes"),
        )
    });
    p += 16;
    let data = &payload[p..];
    let mut r = 0usize;
    for (i, o) in out.iter_mut().enumerate() {
        let st = &mut x[i & 3];
        let slot = *st & (M - 1);
        let e = slots[slot as usize];
        *o = e as u8;
        let (freq, base) = ((e >> 8) & 0xfff, e >> 20);
        let mut v = freq * (*st >> SCALE_BITS) + slot - base;
        while v < L {
            let b = *data.get(r).ok_or(corrupt("rans stream ends early"))?;
            v = (v << 8) | b as u32;
            r += 1;
        }
        *st = v;
    }
    if r != data.len() || x != [L; 4] {
        return Err(corrupt("rans stream does not end in the initial state"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(syms: &[u8]) -> usize {
        let mut h = [0u32; 256];
        for &s in syms {
            h[s as usize] += 1;
        }
        let f = normalize(&h);
        assert_eq!(f.iter().sum::<u32>(), M);
        let mut out = Vec::new();
        encode(syms, &f, &mut out);
        let mut back = vec![0u8; syms.len()];
        decode(&out, 0, &mut back).unwrap();
        assert_eq!(back, syms);
        out.len()
    }

    #[test]
    fn very_skewed_block_costs_well_under_one_bit_per_symbol() {
        let syms: Vec<u8> = (0..65536u32)
            .map(|i| if i % 97 == 0 { 1 } else { 0 })
            .collect();
        let size = round_trip(&syms);
        // entropy ~0.08 bits/symbol -> ~700 bytes; Huffman would need 8 KiB
        assert!(size < 1200, "{size}");
    }

    #[test]
    fn corrupt_state_is_an_error() {
        let syms: Vec<u8> = (0..1000u32).map(|i| (i % 3) as u8).collect();
        let mut h = [0u32; 256];
        for &s in &syms {
            h[s as usize] += 1;
        }
        let mut out = Vec::new();
        encode(&syms, &normalize(&h), &mut out);
        let n = out.len();
        out[n - 1] ^= 0x55;
        let mut back = vec![0u8; syms.len()];
        assert!(decode(&out, 0, &mut back).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_blocks_round_trip(syms in proptest::collection::vec(any::<u8>(), 2..3000)) {
            let mut s = syms;
            s[0] = 0;
            s[1] = 255;
            round_trip(&s);
        }
    }
}
