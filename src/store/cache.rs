//! How much of a file the page cache holds, asked with `cachestat(2)`
//! (Linux 6.5 and later), which reads nothing and starts no read-ahead.
//!
//! Readers of bulk data use it to choose between a buffered read (the
//! bytes are in memory: a copy) and an `O_DIRECT` one (they are not: a
//! buffered read would first fill fresh page-cache pages, which on these
//! machines fault in slowly). Must not: read or write the file.

use std::fs::File;

/// Bytes of the `len` bytes of `file` at `at` (cut at the file's end) that
/// the page cache holds, counted in whole pages; `None` where the kernel
/// cannot tell.
#[cfg(target_os = "linux")]
pub fn cached_bytes(file: &File, at: u64, len: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    /// `__NR_cachestat`, the same on every architecture.
    const SYS_CACHESTAT: libc::c_long = 451;
    const PAGE: u64 = 4096;
    let size = file.metadata().ok()?.len();
    let len = len.min(size.saturating_sub(at));
    if len == 0 {
        return Some(0);
    }
    let range: [u64; 2] = [at, len];
    // nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted.
    let mut stat = [0u64; 5];
    // SAFETY: `range` and `stat` are the kernel's `struct cachestat_range`
    // and `struct cachestat` (two and five u64), borrowed for the call;
    // the descriptor is borrowed from `file`.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            range.as_ptr(),
            stat.as_mut_ptr(),
            0u32,
        )
    };
    // Pages the range touches, the first and last possibly in part.
    let pages = (at + len).div_ceil(PAGE) - at / PAGE;
    (r == 0).then(|| (stat[0].min(pages) * PAGE).min(len))
}

#[cfg(not(target_os = "linux"))]
pub fn cached_bytes(_: &File, _: u64, _: u64) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_file_just_written_is_cached_and_one_dropped_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let f = File::open(&path).unwrap();
        let Some(hot) = cached_bytes(&f, 0, 1 << 20) else {
            return; // a kernel before 6.5: nothing to check
        };
        assert_eq!(hot, 1 << 20);
        assert_eq!(cached_bytes(&f, 4000, 100), Some(100));
        assert_eq!(cached_bytes(&f, 1 << 20, 10), Some(0));
        f.sync_all().unwrap();
        // SAFETY: advice on a descriptor borrowed from `f`.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(cached_bytes(&f, 0, 1 << 20), Some(0));
    }
}
