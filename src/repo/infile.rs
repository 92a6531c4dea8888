//! Commit's input files: read front to back in large page-aligned blocks,
//! from the page cache when it holds them and with `O_DIRECT` when it does
//! not.
//!
//! Why: a buffered read of bytes the page cache does not hold first fills
//! fresh page-cache pages, then copies them out. On these machines a page
//! the guest has not touched for a while costs ~10 µs to fault in (the
//! hypervisor backs guest memory lazily and takes freed memory back), so
//! `dd` of a 950 MB optimizer file not in the cache took 1.58 s, 1.55 s of
//! it in the kernel, against 0.79-0.90 s and 0.03 s with `O_DIRECT`; and a
//! checkpoint larger than the memory cannot stay cached anyway. A block the
//! cache holds is read as usual (`cachestat(2)` tells which), since a
//! direct read of it would go to the disk for nothing: a checkpoint the
//! trainer just wrote is read from memory.
//!
//! File systems without direct I/O (tmpfs before Linux 6.6, some FUSE and
//! network mounts) refuse the flag at open or at the first read, and are
//! then read buffered.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::outfile::PageBuf;

/// Bytes of a block: each block the cache does not hold is one direct read.
pub(crate) const IN_BLOCK_BYTES: usize = 8 << 20;

/// Reads shorter than this, where the block does not hold them (the format
/// parsers' headers), go straight to the file.
const SMALL_READ: usize = 64 << 10;

/// A file read through one block buffer where the page cache does not
/// hold it (see the module docs); `Read` and `Seek` as the file's own.
pub(crate) struct InFile {
    file: File,
    direct: Direct,
    /// The file system refused a direct read (or its open): no more tries.
    refused: bool,
    /// The block read last with `O_DIRECT` (taken from the thread's spare
    /// on the first such read), its file offset and length.
    buf: Option<PageBuf>,
    buf_at: u64,
    buf_len: usize,
    pos: u64,
    /// Blocks read with `O_DIRECT` so far.
    #[cfg(test)]
    direct_reads: usize,
}

thread_local! {
    /// Each thread's spare block buffer: the files a thread reads one after
    /// the other share one, so a run of files allocates it once.
    static SPARE: std::cell::RefCell<Option<PageBuf>> = const { std::cell::RefCell::new(None) };
    /// Each thread's buffer for direct reads at unaligned offsets.
    static BOUNCE: std::cell::RefCell<Option<PageBuf>> = const { std::cell::RefCell::new(None) };
}

impl InFile {
    pub(crate) fn open(path: &Path) -> io::Result<InFile> {
        Ok(InFile {
            file: crate::format::open_nonblocking(path)?,
            direct: Direct::default(),
            refused: false,
            buf: None,
            buf_at: 0,
            buf_len: 0,
            pos: 0,
            #[cfg(test)]
            direct_reads: 0,
        })
    }

    pub(crate) fn metadata(&self) -> io::Result<std::fs::Metadata> {
        self.file.metadata()
    }

    /// Fill the buffer with the block holding `pos`, read with `O_DIRECT`
    /// (buffered if that is refused).
    fn fill(&mut self, pos: u64) -> io::Result<()> {
        let at = pos - pos % PageBuf::ALIGN as u64;
        self.buf_len = 0;
        let buf = self.buf.get_or_insert_with(|| {
            SPARE
                .with_borrow_mut(Option::take)
                .unwrap_or_else(|| PageBuf::new(IN_BLOCK_BYTES))
        });
        let n = match self.direct.get(&self.file) {
            Some(d) => match d.read_at(buf.bytes_mut(), at) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.refused = true;
                    self.file.read_at(buf.bytes_mut(), at)?
                }
                r => {
                    #[cfg(test)]
                    {
                        self.direct_reads += 1;
                    }
                    r?
                }
            },
            None => {
                self.refused = true;
                self.file.read_at(buf.bytes_mut(), at)?
            }
        };
        self.buf_at = at;
        self.buf_len = n;
        Ok(())
    }
}

impl Drop for InFile {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            SPARE.with_borrow_mut(|s| *s = Some(b));
        }
    }
}

impl Read for InFile {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let held = self.pos >= self.buf_at && self.pos < self.buf_at + self.buf_len as u64;
        if !held {
            // Small reads (the parsers' headers), and bytes the cache holds,
            // straight from the file into `out`.
            if out.len() < SMALL_READ
                || self.refused
                || all_cached(&self.file, self.pos, out.len() as u64)
            {
                let n = self.file.read_at(out, self.pos)?;
                self.pos += n as u64;
                return Ok(n);
            }
            self.fill(self.pos)?;
            if self.pos >= self.buf_at + self.buf_len as u64 {
                return Ok(0); // the file's end
            }
        }
        let Some(buf) = &self.buf else {
            return Ok(0);
        };
        let from = (self.pos - self.buf_at) as usize;
        let n = out.len().min(self.buf_len - from);
        out[..n].copy_from_slice(&buf.bytes()[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for InFile {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let base = match to {
            SeekFrom::Start(p) => {
                self.pos = p;
                return Ok(p);
            }
            SeekFrom::Current(d) => (self.pos, d),
            SeekFrom::End(d) => (self.file.metadata()?.len(), d),
        };
        match base.0.checked_add_signed(base.1) {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek before the file's start",
            )),
        }
    }
}

/// A file read at offsets, from the page cache where it holds the bytes
/// and with `O_DIRECT` (through a page-aligned buffer of the reading
/// thread) where it does not: the parent's checkpoint file a delta commit
/// reads its bases from.
pub(crate) struct AtFile {
    file: File,
    direct: Direct,
}

impl AtFile {
    pub(crate) fn open(path: &Path) -> io::Result<AtFile> {
        Ok(AtFile {
            file: crate::format::open_nonblocking(path)?,
            direct: Direct::default(),
        })
    }

    pub(crate) fn metadata(&self) -> io::Result<std::fs::Metadata> {
        self.file.metadata()
    }

    /// Fill `buf` from the file at `off`.
    pub(crate) fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let len = buf.len() as u64;
        let direct = match self.direct.get(&self.file) {
            Some(d) if !all_cached(&self.file, off, len) => d,
            _ => return self.file.read_exact_at(buf, off),
        };
        let page = PageBuf::ALIGN as u64;
        let at = off - off % page;
        let need = ((off + len).div_ceil(page) * page - at) as usize;
        let skip = (off - at) as usize;
        let read = BOUNCE.with_borrow_mut(|b| {
            let b = match b {
                Some(b) if b.cap() >= need => b,
                _ => b.insert(PageBuf::new(need)),
            };
            let mut got = 0;
            while got < need {
                match direct.read_at(&mut b.bytes_mut()[got..need], at + got as u64)? {
                    0 => break,
                    n => got += n,
                }
                if got % PageBuf::ALIGN != 0 {
                    break; // the file's end
                }
            }
            if got < skip + buf.len() {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            buf.copy_from_slice(&b.bytes()[skip..skip + buf.len()]);
            Ok(())
        });
        match read {
            // A direct read refused (an alignment the device wants bigger
            // than a page): this one buffered.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.file.read_exact_at(buf, off),
            r => r,
        }
    }
}

/// Whether the page cache holds every page of `len` bytes at `at` (up
/// to the file's end), asked with `cachestat(2)` (Linux 6.5), which reads
/// nothing and starts no read-ahead. Where the kernel cannot tell, yes:
/// then the file is read as before, buffered.
#[cfg(target_os = "linux")]
fn all_cached(file: &File, at: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    /// `__NR_cachestat`, the same on every architecture.
    const SYS_CACHESTAT: libc::c_long = 451;
    let Ok(size) = file.metadata().map(|m| m.len()) else {
        return true;
    };
    let len = len.min(size.saturating_sub(at));
    if len == 0 {
        return true;
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
    let page = PageBuf::ALIGN as u64;
    let pages = (at + len).div_ceil(page) - at / page;
    r != 0 || stat[0] >= pages
}

#[cfg(not(target_os = "linux"))]
fn all_cached(_: &File, _: u64, _: u64) -> bool {
    true
}

/// A file's `O_DIRECT` descriptor, opened when first wanted, through
/// `/proc/self/fd` (so it is the same file whatever happens to its path);
/// `None` where the file system refuses the flag.
#[derive(Default)]
struct Direct(std::sync::OnceLock<Option<File>>);

impl Direct {
    fn get(&self, file: &File) -> Option<&File> {
        self.0.get_or_init(|| open_direct(file).ok()).as_ref()
    }
}

#[cfg(target_os = "linux")]
fn open_direct(file: &File) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_: &File) -> io::Result<File> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// A file of `len` patterned bytes, written, synced and dropped from
    /// the page cache (so reads of it go direct where the file system
    /// takes `O_DIRECT`).
    fn uncached_file(dir: &Path, len: usize) -> (std::path::PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
        let path = dir.join(format!("f{len}"));
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        f.sync_all().unwrap();
        // SAFETY: advice on a descriptor borrowed from `f`.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        (path, data)
    }

    #[test]
    fn uncached_files_read_back_exactly_in_pieces_of_every_size() {
        let dir = tempfile::tempdir().unwrap();
        let page = PageBuf::ALIGN;
        for len in [
            0,
            1,
            page - 1,
            page + 1,
            IN_BLOCK_BYTES - 1,
            IN_BLOCK_BYTES + 3 * page + 5,
        ] {
            for piece in [SMALL_READ - 1, SMALL_READ, 1 << 20, IN_BLOCK_BYTES + 1] {
                let (path, data) = uncached_file(dir.path(), len);
                let mut f = InFile::open(&path).unwrap();
                // A header read first, as a parser does, then back to 0.
                let mut head = [0u8; 8];
                let n = f.read(&mut head).unwrap();
                assert_eq!(&head[..n], &data[..n.min(len)]);
                f.seek(SeekFrom::Start(0)).unwrap();
                let mut got = Vec::new();
                let mut buf = vec![0u8; piece];
                loop {
                    let n = f.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                assert!(got == data, "len {len}, pieces of {piece}");
                if len >= SMALL_READ && piece >= SMALL_READ && !f.refused {
                    assert!(
                        f.direct_reads > 0,
                        "len {len}: the uncached file was read direct"
                    );
                }
            }
        }
    }

    #[test]
    fn cached_files_are_read_from_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hot");
        let data: Vec<u8> = (0..3 * IN_BLOCK_BYTES).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let mut f = InFile::open(&path).unwrap();
        let mut got = vec![0u8; data.len()];
        f.read_exact(&mut got).unwrap();
        assert!(got == data);
        assert_eq!(f.direct_reads, 0);
    }

    #[test]
    fn reads_at_unaligned_offsets_of_an_uncached_file_are_exact() {
        let dir = tempfile::tempdir().unwrap();
        let len = 3 * IN_BLOCK_BYTES / 2 + 77;
        for (off, n) in [
            (0, 1),
            (1, PageBuf::ALIGN),
            (4095, 3 << 20),
            (len - 10, 10),
            (123, len - 123),
        ] {
            let (path, data) = uncached_file(dir.path(), len);
            let f = AtFile::open(&path).unwrap();
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, off as u64).unwrap();
            assert!(buf[..] == data[off..off + n], "{off}+{n}");
        }
        // Past the end: an error, not short or stale bytes.
        let (path, _) = uncached_file(dir.path(), len);
        let f = AtFile::open(&path).unwrap();
        let mut buf = vec![0u8; 100];
        assert!(f.read_exact_at(&mut buf, (len - 50) as u64).is_err());
    }
}
