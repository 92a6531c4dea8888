//! Unsigned LEB128 numbers, as the frame format uses them (the version 6
//! header's raw length, a sparse block's counts and lengths): 7 bits a
//! byte, least significant group first, the high bit set on every byte
//! but the last, in the shortest form.
//!
//! Owns: writing them and reading them within a bound. Stands on nothing
//! but the codec's error type.

use super::DecodeError;

/// Append `v` as LEB128.
pub fn write(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// How many bytes [`write`] takes for `v`.
pub fn len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// The number at `buf[pos..end]` of at most `max_bytes` bytes, in its
/// shortest form (a last byte of 0 after the first is corrupt), and the
/// position after it. Running out of `buf` is a truncated frame; out of
/// `end` short of that, a corrupt one (the number runs past its block).
pub fn read(
    buf: &[u8],
    pos: usize,
    end: usize,
    max_bytes: usize,
) -> Result<(u64, usize), DecodeError> {
    let corrupt = |at: usize, reason| DecodeError::Corrupt {
        offset: at as u64,
        reason,
    };
    let mut v = 0u64;
    for i in 0..max_bytes {
        let at = pos + i;
        let b = match buf.get(at) {
            Some(&b) if at < end => b,
            _ if end < buf.len() => return Err(corrupt(at, "LEB128 number runs past its block")),
            _ => {
                return Err(DecodeError::Truncated {
                    need: (at + 1) as u64,
                    have: buf.len() as u64,
                })
            }
        };
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if b == 0 && i > 0 {
                return Err(corrupt(at, "LEB128 number not in its shortest form"));
            }
            return Ok((v, at + 1));
        }
    }
    Err(corrupt(pos, "LEB128 number longer than its format allows"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn len_is_the_bytes_write_takes(v in any::<u64>(), shift in 0u32..64) {
            for v in [v, v >> shift] {
                let mut b = Vec::new();
                write(v, &mut b);
                prop_assert_eq!(len(v), b.len());
            }
        }

        #[test]
        fn numbers_read_back_as_written(v in any::<u32>(), pad in 0usize..3) {
            let mut b = vec![0xEE; pad];
            write(v as u64, &mut b);
            let end = b.len();
            b.extend_from_slice(&[0x80, 0x80]);
            prop_assert_eq!(read(&b, pad, end, 5), Ok((v as u64, end)));
        }
    }

    #[test]
    fn long_cut_or_padded_numbers_are_errors() {
        // 2^21 needs 4 bytes: refused where 3 are allowed.
        let mut b = Vec::new();
        write(1 << 21, &mut b);
        assert!(read(&b, 0, b.len(), 3).is_err());
        assert_eq!(read(&b, 0, b.len(), 4), Ok((1 << 21, 4)));
        // 0x90 0x00 is 16 in a long form.
        assert!(matches!(
            read(&[0x90, 0x00], 0, 2, 5),
            Err(DecodeError::Corrupt { .. })
        ));
        // Cut by the buffer's end: truncated; by a block's end: corrupt.
        assert!(matches!(
            read(&[0x90], 0, 1, 5),
            Err(DecodeError::Truncated { need: 2, have: 1 })
        ));
        assert!(matches!(
            read(&[0x90, 0x01], 0, 1, 5),
            Err(DecodeError::Corrupt { .. })
        ));
    }
}
