//! RocksDB's checksum, computed with the CPU's CRC32 instruction.
//!
//! RocksDB checksums every record it writes with CRC32C: each blob record
//! (a chunk's whole payload), each WAL record and table block. Debian's
//! librocksdb is built without SSE4.2, so its `rocksdb::crc32c::Extend`
//! runs a table loop at ~1 byte/cycle: 14.5% of the CPU of a delta commit
//! of a 1.4 GiB checkpoint, all of it on RocksDB's one flush thread
//! (`perf`, large run, step 12 onto 9). The library calls that function
//! through its PLT (37 call sites), so a definition of the same symbol
//! in the program that links it takes its place: [`extend`] below, which
//! gives the same CRC32C (the crate `crc32c`: SSE4.2, three interleaved
//! streams; a table fallback on CPUs without it).
//!
//! The symbol must be in the program's dynamic symbol table. The linker
//! puts it there when the program links librocksdb (which names it), and
//! `build.rs` asks for it by name (`-u`, `--export-dynamic-symbol`) for
//! this crate's binaries, tests and examples; the Python extension module
//! exports it as a cdylib exports every `export_name` function. Where it is
//! missing, or a librocksdb calls its CRC directly, RocksDB keeps its own
//! (same values, slower): [`calls`] counts the calls that came here, so a
//! test can tell. The values are the standard CRC32C, so stores written
//! either way read back either way.
//!
//! Must not: compute anything but the CRC32C RocksDB defines (a different
//! value would make RocksDB refuse every record as corrupt).

use std::sync::atomic::{AtomicU64, Ordering};

/// Calls of [`extend`] in this process (one per record RocksDB checksums:
/// a relaxed increment beside a CRC of kilobytes to megabytes).
static CALLS: AtomicU64 = AtomicU64::new(0);

/// `rocksdb::crc32c::Extend`: the CRC32C of `len` bytes at `data`,
/// continuing from `crc` (the CRC of the bytes before them; 0 to start).
///
/// # Safety
/// `data` must be valid for reads of `len` bytes (RocksDB passes a slice),
/// or `len` must be 0.
#[export_name = "_ZN7rocksdb6crc32c6ExtendEjPKcm"]
pub unsafe extern "C" fn extend(crc: u32, data: *const u8, len: usize) -> u32 {
    CALLS.fetch_add(1, Ordering::Relaxed);
    if len == 0 || data.is_null() {
        return crc;
    }
    // SAFETY: the caller passes `len` readable bytes at `data`.
    let bytes = unsafe { std::slice::from_raw_parts(data, len) };
    crc32c::crc32c_append(crc, bytes)
}

/// How many CRCs [`extend`] has computed in this process: it grows with
/// RocksDB's writes when RocksDB's calls come here (the store's test
/// `rocks_checksums_blob_records_with_ckvcs_crc32c` and the Python test
/// of the extension module check that they do).
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit-at-a-time CRC32C (reflected polynomial 0x82F63B78): the
    /// definition, as slow as it is clear.
    fn reference(mut crc: u32, data: &[u8]) -> u32 {
        crc = !crc;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    fn ours(crc: u32, data: &[u8]) -> u32 {
        // SAFETY: a slice's pointer and length.
        unsafe { extend(crc, data.as_ptr(), data.len()) }
    }

    #[test]
    fn extend_gives_the_crc32c_check_value() {
        // The CRC catalogue's check value of CRC-32C, and RFC 3720 B.4's
        // vectors (which RocksDB's util/crc32c_test.cc checks too).
        assert_eq!(ours(0, b"123456789"), 0xE306_9283);
        assert_eq!(ours(0, &[0u8; 32]), 0x8A91_36AA);
        assert_eq!(ours(0, &[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(ours(0, &ascending), 0x46DD_794E);
        assert_eq!(ours(0x1234_5678, &[]), 0x1234_5678);
        // SAFETY: a null pointer with length 0 is allowed.
        assert_eq!(unsafe { extend(7, std::ptr::null(), 0) }, 7);
    }

    #[test]
    fn extend_matches_the_definition_at_every_length_and_split() {
        let data: Vec<u8> = (0..20_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in (0..300).chain([4095, 4096, 4097, 8191, 8192, 8193, 20_000]) {
            let d = &data[..len];
            let want = reference(0, d);
            assert_eq!(ours(0, d), want, "length {len}");
            for cut in [0, 1.min(len), len / 3, len.saturating_sub(1), len] {
                let (a, b) = d.split_at(cut);
                assert_eq!(ours(ours(0, a), b), want, "length {len} cut at {cut}");
            }
        }
    }
}
