//! [`Store`] on RocksDB: the only code in ckvc that names RocksDB.
//!
//! One column family per [`Space`]. Writes go through the write-ahead log;
//! with [`RocksOptions::sync`] (the default) every batch is fsynced before
//! `write` returns, so a returned commit survives a crash or power loss.
//! Large values (`Space::Chunks`) live in BlobDB blob files by default: the
//! LSM tree then holds only keys and small blob references, so compaction
//! does not rewrite megabytes of chunk data (measured by
//! `examples/store_bench.rs`, numbers in `docs/format/store.md`).
//!
//! Locking: before RocksDB is touched, a read-write open takes an exclusive
//! `flock` on `<store>.lock` beside the store directory (`.ckvc/db.lock`),
//! so a second writer fails with [`StoreError::Locked`] before RocksDB
//! rotates its info log or opens anything; RocksDB's own `LOCK` file stays
//! as a second guard.
//!
//! Only a missing or empty directory is created: a directory with files but
//! no `CURRENT` is a damaged store ([`StoreError::MissingCurrent`]), and
//! letting RocksDB "create" it would delete every table and blob file.
//!
//! A full disk: RocksDB 7.8 aborts the process (an assertion in its file
//! writer) when a write-ahead-log append fails for lack of space, so every
//! write first checks the free space of the device ([`MIN_FREE`] plus what
//! the batch and the unflushed memtables will need) and refuses with
//! [`StoreError::Full`] before anything is written.
//!
//! Readers open with [`Mode::ReadOnly`], a RocksDB read-only instance: it
//! takes no lock and sees everything the writer had
//! written (WAL included) when it opened; a new handle sees later writes.
//! It keeps every table file open (`max_open_files = -1`), so the writer's
//! compactions deleting files under it cannot break a long `checkout`. Its
//! info log goes to a private temporary directory, removed on drop; nothing
//! is written to the repository by a reader. Blob files are opened when
//! first read, so a reader beside `gc` can still find one gone; that is
//! reported as [`StoreError::Rewritten`] (retry), never as corruption, when
//! a writer holds the lock or the store's manifest moved since the open.
//!
//! Page cache: the writer writes and reads its files buffered, and after
//! each [`Store::flush`] that found new blob files it drops from the page
//! cache (`posix_fadvise(DONTNEED)`) the blob files of all but its newest
//! [`Store::keep_cached`] such flushes, so the cache holds the newest
//! commits' chunks (what the next commit decodes its delta bases from)
//! and not every commit's ([`RocksStore::release_cache`]); the count
//! carries over to the next writer in `<store>.cached`.
//!
//! Not a *secondary* instance: RocksDB 7.8 (Debian's librocksdb) crashes
//! (SIGSEGV in `BlobSource::GetBlob`, computing a blob cache key) when a
//! secondary reads blob values, which `ckvc checkout` hit on the corpus.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rocksdb::{
    ColumnFamily, ColumnFamilyDescriptor, DBCompressionType, ErrorKind, Options, PrefixRange,
    ReadOptions, WriteBatch, WriteOptions, DB,
};

use super::{to_hex, Batch, ScanFn, Space, Store, StoreError};

/// How to open a [`RocksStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The single writer: creates the store if missing, takes the lock.
    ReadWrite,
    /// A reader beside a possible writer (a RocksDB read-only instance).
    ReadOnly,
}

/// Tuning knobs of [`RocksStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RocksOptions {
    /// fsync the write-ahead log on every [`Store::write`] (durable commits).
    /// Default `true`.
    pub sync: bool,
    /// Keep `Space::Chunks` values of at least [`min_blob_size`](Self::min_blob_size)
    /// in BlobDB blob files instead of the LSM tree. Default `true`.
    pub blob_files: bool,
    /// Default 4 KiB.
    pub min_blob_size: u64,
    /// Memtable size of `Space::Chunks`. Default 32 MiB (what a
    /// repository's default memory budget asks for; see
    /// [`Store::set_write_buffer`]).
    pub chunk_write_buffer: usize,
    /// Write table and blob files with `O_DIRECT` (flushes and
    /// compactions), where the store's file system accepts it (probed at
    /// a read-write open). Default `false`: buffered writes leave the
    /// newest commit's chunks in the page cache, where the next commit
    /// reads its delta bases (the writer drops older blob files from the
    /// cache, see [`RocksStore::release_cache`]). Python background delta
    /// saves of GPT-2 small + AdamW (1.39 GiB) with nothing beside them,
    /// on a disk that served about 190 MB/s of mixed reads and writes:
    /// durable in 5.8-7.3 s against 8.0-15.2 s with `O_DIRECT` writes and
    /// reads (alternating runs), for about 1.5 CPU-s more each. (`true`
    /// was the default while copying into the page cache cost more CPU
    /// than the rest of a commit, measured on an earlier VM whose disk
    /// read 1.1 GB/s.)
    pub direct_writes: bool,
    /// Read table and blob files with `O_DIRECT` (where the file system
    /// accepts it, probed on the store's `CURRENT` file). Default `false`:
    /// for a reader that reads far more than the page cache would usefully
    /// keep, such as a checkout of many gigabytes, or for a writer with
    /// [`direct_writes`](Self::direct_writes), whose reads (a delta's
    /// bases) the page cache then does not hold. On these VMs a page-cache
    /// page the guest has not touched for a while costs ~10 us to fault
    /// in, so buffered reads of a 10 GiB checkout's blobs spent 12-17 s in
    /// the kernel, direct reads 1.5-1.9 s. Reads the page cache already
    /// holds are faster buffered: the repository asks for this for
    /// checkouts of many gigabytes only.
    pub direct_reads: bool,
}

impl Default for RocksOptions {
    fn default() -> Self {
        Self {
            sync: true,
            blob_files: true,
            min_blob_size: 4 << 10,
            chunk_write_buffer: 32 << 20,
            direct_writes: false,
            direct_reads: false,
        }
    }
}

/// A private directory for a reader's info log, removed on drop.
#[derive(Debug)]
struct ReaderDir(PathBuf);

impl Drop for ReaderDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A [`Store`] in a RocksDB directory.
pub struct RocksStore {
    // Field order is drop order: the database closes before its reader
    // directory is removed.
    db: DB,
    _reader_dir: Option<ReaderDir>,
    /// The writer's `flock` on `<path>.lock`, released when the store drops.
    _lock: Option<std::fs::File>,
    /// What `CURRENT` and the manifest it names looked like when a reader
    /// opened: a change means a writer rewrote the store since.
    opened_as: Option<ManifestMark>,
    /// Bytes written since the last flush, not yet in table or blob files.
    unflushed: AtomicU64,
    path: PathBuf,
    mode: Mode,
    sync: bool,
    blob_files: bool,
    /// The memtable size of `Space::Chunks` (see [`Store::set_write_buffer`]).
    chunk_write_buffer: AtomicU64,
    /// Serialises writers inside this process, so a batch's preconditions are
    /// checked and its writes applied with no other write in between.
    write_lock: Mutex<()>,
    /// Which blob files a writer has dropped from the page cache.
    cache_epochs: Mutex<CacheEpochs>,
}

/// The blob files a writer keeps in the page cache: those of the newest
/// `keep` epochs, an epoch being the blob files a [`Store::flush`] found
/// new (RocksDB numbers files in creation order).
#[derive(Debug, Clone, PartialEq, Eq)]
struct CacheEpochs {
    /// Blob files numbered up to this one are dropped (or were never
    /// read by this process).
    dropped_through: u64,
    /// The highest blob file number at the end of each epoch kept, oldest
    /// first.
    ends: std::collections::VecDeque<u64>,
    /// Epochs kept, at least one.
    keep: usize,
}

impl CacheEpochs {
    /// Blob files up to `max` as one epoch, nothing dropped.
    fn fresh(max: u64) -> Self {
        Self {
            dropped_through: 0,
            ends: [max].into(),
            keep: 1,
        }
    }

    /// A writer's epochs when it opens: those the last writer left in
    /// `<store>.cached` (see [`Self::save`]), else what earlier processes
    /// wrote (blob files up to `max`) as one epoch.
    fn load(store: &Path, max: u64) -> Self {
        let fresh = Self::fresh(max);
        let Ok(text) = std::fs::read_to_string(cached_path(store)) else {
            return fresh;
        };
        let mut lines = text.lines();
        if lines.next() != Some(CACHED_MAGIC) {
            return fresh;
        }
        let numbers: Option<Vec<u64>> = lines.map(|l| l.parse().ok()).collect();
        match numbers.as_deref() {
            // Ascending, none past the store's files (else the store was
            // replaced since: start afresh).
            Some([dropped_through, ends @ ..])
                if !ends.is_empty()
                    && ends.len() <= MAX_CACHED_EPOCHS
                    && ends.iter().all(|&e| e > *dropped_through && e <= max)
                    && ends.windows(2).all(|w| w[0] < w[1]) =>
            {
                let mut epochs = Self {
                    dropped_through: *dropped_through,
                    ends: ends.iter().copied().collect(),
                    keep: 1,
                };
                // Files since the last epoch's end (a writer that did not
                // get to its flush) join the newest epoch.
                if let Some(last) = epochs.ends.back_mut() {
                    *last = max;
                }
                epochs
            }
            _ => fresh,
        }
    }

    /// Keep the newest `n` epochs: at least one, and at most what
    /// `<store>.cached` holds (a `max_chain` of thousands would otherwise
    /// leave a file the next writer refuses, and nothing would ever be
    /// dropped again).
    fn set_keep(&mut self, n: usize) {
        self.keep = n.clamp(1, MAX_CACHED_EPOCHS);
    }

    /// Leaves the epochs in `<store>.cached` for the next writer (a
    /// Python save opens the repository anew each time): a line
    /// `ckvc-cached 1`, then `dropped_through`, then each epoch's end,
    /// oldest first, in decimal. Advice only: a failed write is ignored,
    /// and a missing or unreadable file starts afresh.
    fn save(&self, store: &Path) {
        let mut text = format!("{CACHED_MAGIC}\n{}\n", self.dropped_through);
        for e in &self.ends {
            text.push_str(&format!("{e}\n"));
        }
        let path = cached_path(store);
        let tmp = path.with_extension("cached.tmp");
        if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, &path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    /// Ends an epoch if `max`, the highest blob file number now, is new:
    /// returns the numbers of the blob files to drop (those of the epochs
    /// past the newest `keep`), or `None` when nothing is to be dropped.
    fn end(&mut self, max: u64) -> Option<std::ops::RangeInclusive<u64>> {
        let newest = self.ends.back().copied().unwrap_or(self.dropped_through);
        if max > newest {
            self.ends.push_back(max);
        }
        let mut through = self.dropped_through;
        while self.ends.len() > self.keep {
            through = self.ends.pop_front().unwrap_or(through);
        }
        if through <= self.dropped_through {
            return None;
        }
        let drop = self.dropped_through + 1..=through;
        self.dropped_through = through;
        Some(drop)
    }
}

/// The first line of `<store>.cached`.
const CACHED_MAGIC: &str = "ckvc-cached 1";

/// Most epochs `<store>.cached` holds (a repository keeps `max_chain + 1`).
const MAX_CACHED_EPOCHS: usize = 1024;

/// `<store>.cached`, beside the store directory (`.ckvc/db.cached`).
fn cached_path(path: &Path) -> PathBuf {
    beside(path, ".cached")
}

/// The number of a RocksDB blob file (`000123.blob`).
fn blob_number(name: &std::ffi::OsStr) -> Option<u64> {
    name.to_str()?.strip_suffix(".blob")?.parse().ok()
}

/// The blob files of a store directory, with their numbers (in no order).
pub(super) fn blob_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let e = e.ok()?;
            Some((blob_number(&e.file_name())?, e.path()))
        })
        .collect()
}

/// Asks the kernel to drop `path`'s pages from the page cache (clean pages
/// go at once; the blob files this is asked for were synced by the flush
/// that closed them). Advice only: a failure changes nothing.
#[cfg(target_os = "linux")]
fn drop_cached(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::File::open(path) {
        // SAFETY: `f` is an open file descriptor for the whole call;
        // posix_fadvise reads nothing from memory.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}

#[cfg(not(target_os = "linux"))]
fn drop_cached(_: &Path) {}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.path)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

fn backend(e: rocksdb::Error) -> StoreError {
    StoreError::Backend(e.into_string())
}

fn io(path: &Path, source: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Free space every write leaves on the device, beyond what the write
/// itself needs: room for RocksDB's manifest, options and log files.
pub const MIN_FREE: u64 = 8 << 20;

/// Bytes free for an unprivileged writer on the device holding `path`.
#[cfg(unix)]
fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable
    // memory of the size statvfs fills; nothing is read before it returns 0.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u32 on some 32-bit ones).
    #[allow(clippy::useless_conversion)]
    let (avail, frsize) = (u64::from(st.f_bavail), u64::from(st.f_frsize));
    Ok(avail.saturating_mul(frsize))
}

#[cfg(not(unix))]
fn free_bytes(_path: &Path) -> std::io::Result<u64> {
    Ok(u64::MAX)
}

/// Refuses with [`StoreError::Full`] unless `need` bytes are free at `path`.
fn ensure_free(path: &Path, need: u64) -> Result<(), StoreError> {
    let free = free_bytes(path).map_err(|e| io(path, e))?;
    if free < need {
        return Err(StoreError::Full {
            path: path.to_path_buf(),
            free,
            need,
        });
    }
    Ok(())
}

/// True when RocksDB's message says a device is full.
fn is_enospc(e: &rocksdb::Error) -> bool {
    let m = e.as_ref();
    m.contains("No space left on device") || m.contains("NoSpace")
}

/// A storage-engine error of a write: a full device keeps its meaning.
fn write_error(path: &Path, e: rocksdb::Error) -> StoreError {
    if is_enospc(&e) {
        StoreError::Full {
            path: path.to_path_buf(),
            free: free_bytes(path).unwrap_or(0),
            need: MIN_FREE,
        }
    } else {
        backend(e)
    }
}

/// True when RocksDB's message says a file of the store is gone or
/// unreadable (a deleted blob or table file).
fn is_missing_file(e: &rocksdb::Error) -> bool {
    // RocksDB says it as an IOError, or (a table file listed in the
    // manifest but gone at open) as "Corruption: Can't access ...".
    let m = e.as_ref();
    m.contains("No such file")
        || (e.kind() == ErrorKind::IOError && m.contains("while open a file"))
}

/// Opens a read-only instance; a table file that a concurrent writer's
/// compaction deleted between RocksDB reading the manifest and opening the
/// file is no damage: the open is tried again (a few times, then
/// [`StoreError::Rewritten`]).
fn open_read_only(
    path: &Path,
    db_opts: &Options,
    options: &RocksOptions,
) -> Result<DB, (rocksdb::Error, bool)> {
    let mut tries = 0;
    loop {
        let mark = ManifestMark::read(path);
        match DB::open_cf_descriptors_read_only(db_opts, path, column_families(options), false) {
            Ok(db) => return Ok(db),
            Err(e) if is_missing_file(&e) => {
                let moved = writer_active(path) || ManifestMark::read(path) != mark;
                tries += 1;
                if !moved || tries >= 5 {
                    return Err((e, moved));
                }
                std::thread::sleep(std::time::Duration::from_millis(20 << tries));
            }
            Err(e) => return Err((e, false)),
        }
    }
}

/// `CURRENT`'s content and the size of the manifest it names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ManifestMark {
    current: Vec<u8>,
    manifest_len: u64,
}

impl ManifestMark {
    fn read(path: &Path) -> Option<ManifestMark> {
        let current = std::fs::read(path.join("CURRENT")).ok()?;
        let name = std::str::from_utf8(&current).ok()?.trim().to_string();
        let manifest_len = std::fs::metadata(path.join(name)).ok()?.len();
        Some(ManifestMark {
            current,
            manifest_len,
        })
    }
}

/// The lock file of the store at `path`: `<path>.lock`, beside it.
fn lock_path(path: &Path) -> PathBuf {
    beside(path, ".lock")
}

/// `<store><suffix>`: a file beside the store directory.
fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// `flock(2)` on `f` without blocking: `Ok(false)` when another open file
/// description holds a conflicting lock.
#[cfg(unix)]
fn try_flock(f: &std::fs::File, exclusive: bool) -> std::io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    // SAFETY: flock only reads the descriptor number, which `f` keeps open
    // for the duration of the call.
    let rc = unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(not(unix))]
fn try_flock(_f: &std::fs::File, _exclusive: bool) -> std::io::Result<bool> {
    Ok(true)
}

/// Takes the writer's exclusive lock of the store at `path` (released when
/// the returned file is closed, also when the process dies).
fn take_lock(path: &Path) -> Result<std::fs::File, StoreError> {
    let lp = lock_path(path);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lp)
        .map_err(|e| io(&lp, e))?;
    match try_flock(&f, true) {
        Ok(true) => Ok(f),
        Ok(false) => Err(StoreError::Locked {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(io(&lp, e)),
    }
}

/// True when a writer holds the lock of the store at `path` right now.
fn writer_active(path: &Path) -> bool {
    // A shared lock conflicts only with the writer's exclusive one; it is
    // released when `f` closes at the end of this function.
    std::fs::File::open(lock_path(path))
        .map(|f| matches!(try_flock(&f, false), Ok(false)))
        .unwrap_or(false)
}

/// Whether files in `dir` (the store's parent directory: a probe left by a
/// crash must not make the store directory look damaged) can be written
/// with `O_DIRECT`: a probe file gets one aligned block and is removed. RocksDB
/// fails a flush (and then every write) on a file system that refuses
/// direct I/O (tmpfs before Linux 6.6, some FUSE and network mounts), so
/// it is only asked for where this works.
#[cfg(target_os = "linux")]
fn direct_io_works(dir: &Path) -> bool {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join(format!("ckvc-direct-probe-{}", std::process::id()));
    let mut buf = vec![0u8; 2 * PROBE_BLOCK];
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .and_then(|mut f| f.write_all(aligned_block(&mut buf)))
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

#[cfg(not(target_os = "linux"))]
fn direct_io_works(_: &Path) -> bool {
    false
}

/// Whether the store's files can be read with `O_DIRECT`: one aligned
/// block of its `CURRENT` file is (a reader writes no probe).
#[cfg(target_os = "linux")]
pub(super) fn direct_reads_work(store: &Path) -> bool {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut buf = vec![0u8; 2 * PROBE_BLOCK];
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(store.join("CURRENT"))
        .and_then(|mut f| f.read(aligned_block(&mut buf)))
        .is_ok_and(|n| n > 0)
}

/// The block size of the direct-I/O probes.
#[cfg(target_os = "linux")]
const PROBE_BLOCK: usize = 4096;

/// An aligned [`PROBE_BLOCK`] inside `buf` (two blocks long), without an
/// aligned allocator.
#[cfg(target_os = "linux")]
fn aligned_block(buf: &mut [u8]) -> &mut [u8] {
    let skip = buf.as_ptr().align_offset(PROBE_BLOCK).min(PROBE_BLOCK);
    &mut buf[skip..skip + PROBE_BLOCK]
}

#[cfg(not(target_os = "linux"))]
pub(super) fn direct_reads_work(_: &Path) -> bool {
    false
}

/// Whether a store directory holds anything (a missing one does not).
fn has_entries(path: &Path) -> Result<bool, StoreError> {
    match std::fs::read_dir(path) {
        Ok(mut rd) => Ok(rd.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(path, e)),
    }
}

/// The error of an open that RocksDB refused.
fn open_error(path: &Path, e: rocksdb::Error) -> StoreError {
    if is_enospc(&e) {
        return write_error(path, e);
    }
    match e.kind() {
        ErrorKind::Corruption => StoreError::Damaged {
            path: path.to_path_buf(),
            reason: e.into_string(),
        },
        _ if is_missing_file(&e) => StoreError::Damaged {
            path: path.to_path_buf(),
            reason: e.into_string(),
        },
        _ => backend(e),
    }
}

fn column_families(options: &RocksOptions) -> Vec<ColumnFamilyDescriptor> {
    Space::ALL
        .iter()
        .map(|&space| {
            let mut cf = Options::default();
            if space == Space::Chunks {
                // Chunk values are codec frames: already entropy coded.
                cf.set_compression_type(DBCompressionType::None);
                cf.set_write_buffer_size(options.chunk_write_buffer);
                if options.blob_files {
                    cf.set_enable_blob_files(true);
                    cf.set_min_blob_size(options.min_blob_size);
                    cf.set_blob_compression_type(DBCompressionType::None);
                    cf.set_blob_file_size(256 << 20);
                    // Off except in `compact` (which gc runs after deleting):
                    // on, every routine compaction relocated the values of
                    // the oldest blob files, garbage or not, rewriting
                    // about 40% of a fresh commit's chunk bytes again.
                    cf.set_enable_blob_gc(false);
                }
            }
            ColumnFamilyDescriptor::new(space.name(), cf)
        })
        .collect()
}

static READER_SEQ: AtomicU64 = AtomicU64::new(0);

impl RocksStore {
    /// Opens with default options.
    pub fn open(path: impl AsRef<Path>, mode: Mode) -> Result<Self, StoreError> {
        Self::open_with(path, mode, &RocksOptions::default())
    }

    pub fn open_with(
        path: impl AsRef<Path>,
        mode: Mode,
        options: &RocksOptions,
    ) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let mut db_opts = Options::default();
        db_opts.set_max_background_jobs(2);
        db_opts.set_keep_log_file_num(4);
        db_opts.set_max_log_file_size(4 << 20);
        // Table files are opened (all of them: `max_open_files` -1) by
        // this many threads per column family; RocksDB's 16 made every
        // open start and join 80 threads for a few files each (a CLI
        // `log` 12 -> 8 ms, a small checkout 64 -> 58 ms).
        db_opts.set_max_file_opening_threads(2);
        let has_current = path.join("CURRENT").is_file();
        let (db, reader_dir, lock) = match mode {
            Mode::ReadWrite => {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
                }
                let lock = take_lock(&path)?;
                let fresh = !has_entries(&path)?;
                if !fresh && !has_current {
                    return Err(StoreError::MissingCurrent { path });
                }
                let room = if path.exists() {
                    &path
                } else {
                    path.parent().unwrap_or(&path)
                };
                ensure_free(room, MIN_FREE)?;
                std::fs::create_dir_all(&path).map_err(|e| io(&path, e))?;
                if options.direct_writes && direct_io_works(path.parent().unwrap_or(&path)) {
                    db_opts.set_use_direct_io_for_flush_and_compaction(true);
                }
                // A fresh store has no `CURRENT` to probe: its first
                // commit has no bases to read.
                if options.direct_reads && direct_reads_work(&path) {
                    db_opts.set_use_direct_reads(true);
                }
                db_opts.create_if_missing(fresh);
                db_opts.create_missing_column_families(fresh);
                let db = DB::open_cf_descriptors(&db_opts, &path, column_families(options))
                    .map_err(|e| {
                        let msg = e.to_string();
                        if e.kind() == ErrorKind::IOError && msg.contains("LOCK") {
                            StoreError::Locked { path: path.clone() }
                        } else {
                            open_error(&path, e)
                        }
                    })?;
                (db, None, Some(lock))
            }
            Mode::ReadOnly => {
                if !has_current {
                    return Err(if has_entries(&path)? {
                        StoreError::MissingCurrent { path }
                    } else {
                        StoreError::NotFound { path }
                    });
                }
                let dir = std::env::temp_dir().join(format!(
                    "ckvc-reader-{}-{}",
                    std::process::id(),
                    READER_SEQ.fetch_add(1, Ordering::Relaxed)
                ));
                // A leftover of a crashed process that had the same pid.
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
                let dir = ReaderDir(dir);
                // Table files stay readable after the writer unlinks them.
                db_opts.set_max_open_files(-1);
                if options.direct_reads && direct_reads_work(&path) {
                    db_opts.set_use_direct_reads(true);
                }
                db_opts.set_db_log_dir(&dir.0);
                let db = match open_read_only(&path, &db_opts, options) {
                    Ok(db) => db,
                    Err((_, true)) => return Err(StoreError::Rewritten),
                    Err((e, false)) if e.kind() == ErrorKind::Corruption || is_missing_file(&e) => {
                        // A damaged table file: open lazily instead, so the
                        // intact files can be read and the damage is met
                        // (and reported) per key, as fsck needs.
                        db_opts.set_max_open_files(64);
                        db_opts.set_skip_checking_sst_file_sizes_on_db_open(true);
                        db_opts.set_paranoid_checks(false);
                        DB::open_cf_descriptors_read_only(
                            &db_opts,
                            &path,
                            column_families(options),
                            false,
                        )
                        .map_err(|_| open_error(&path, e))?
                    }
                    Err((e, false)) => return Err(open_error(&path, e)),
                };
                (db, Some(dir), None)
            }
        };
        let opened_as = match mode {
            Mode::ReadOnly => ManifestMark::read(&path),
            Mode::ReadWrite => None,
        };
        let cache_epochs = match mode {
            Mode::ReadWrite => {
                let max = blob_files(&path).iter().map(|b| b.0).max().unwrap_or(0);
                CacheEpochs::load(&path, max)
            }
            Mode::ReadOnly => CacheEpochs::fresh(0),
        };
        Ok(Self {
            db,
            _reader_dir: reader_dir,
            _lock: lock,
            opened_as,
            unflushed: AtomicU64::new(0),
            path,
            mode,
            sync: options.sync,
            blob_files: options.blob_files,
            chunk_write_buffer: AtomicU64::new(options.chunk_write_buffer as u64),
            write_lock: Mutex::new(()),
            cache_epochs: Mutex::new(cache_epochs),
        })
    }

    /// A writer's page-cache policy, run after each [`Store::flush`]: when
    /// the flush found blob files newer than the last epoch's, those of
    /// the epochs past the newest [`Store::keep_cached`] ones are dropped
    /// from the page cache. A commit flushes its chunks once, at its end,
    /// so the cache keeps the newest commits' chunks, which the next
    /// commit reads to decode its delta bases, and sheds older ones, which
    /// would otherwise grow the page cache by a commit's stored bytes each
    /// commit until memory pressure (beside a page cache of many
    /// gigabytes, a training loop's fresh page faults were measured slower
    /// on the development VMs).
    fn release_cache(&self) {
        if self.mode == Mode::ReadOnly {
            return;
        }
        let blobs = blob_files(&self.path);
        let max = blobs.iter().map(|b| b.0).max().unwrap_or(0);
        let drop = {
            let mut epochs = self.cache_epochs.lock().unwrap_or_else(|e| e.into_inner());
            let before = epochs.clone();
            let drop = epochs.end(max);
            if *epochs != before {
                epochs.save(&self.path);
            }
            drop
        };
        if let Some(drop) = drop {
            for (_, path) in blobs.iter().filter(|b| drop.contains(&b.0)) {
                drop_cached(path);
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Bytes of all files in the store directory.
    ///
    /// RocksDB deletes files in the background (obsolete SSTs after a
    /// compaction, old logs): a file listed and then gone before its
    /// size is read counts as nothing, not as an error.
    pub fn size_on_disk(&self) -> Result<u64, StoreError> {
        fn walk(dir: &Path, top: bool) -> Result<u64, StoreError> {
            let mut total = 0;
            let entries = match std::fs::read_dir(dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !top => return Ok(0),
                Err(e) => return Err(io(dir, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| io(dir, e))?;
                let meta = match entry.metadata() {
                    Ok(meta) => meta,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io(&entry.path(), e)),
                };
                total += if meta.is_dir() {
                    walk(&entry.path(), false)?
                } else {
                    meta.len()
                };
            }
            Ok(total)
        }
        walk(&self.path, true)
    }

    /// The error of a failed read: damage, or (for a reader) a file a
    /// concurrent writer replaced.
    fn read_error(&self, e: rocksdb::Error, space: Space, key: &[u8]) -> StoreError {
        let missing = is_missing_file(&e);
        if missing
            && self.mode == Mode::ReadOnly
            && (writer_active(&self.path) || ManifestMark::read(&self.path) != self.opened_as)
        {
            return StoreError::Rewritten;
        }
        if e.kind() == ErrorKind::Corruption || missing {
            StoreError::Corrupt {
                space,
                key_hex: to_hex(key),
                reason: e.into_string(),
            }
        } else {
            backend(e)
        }
    }

    /// Refuses a write of `bytes` that the device might not hold: the
    /// batch (twice when logged: write-ahead log, then table files), the
    /// memtables not yet flushed, and [`MIN_FREE`].
    fn ensure_room(&self, bytes: u64, logged: bool) -> Result<(), StoreError> {
        let unflushed = self
            .unflushed
            .load(Ordering::Relaxed)
            .min(2 * self.chunk_write_buffer.load(Ordering::Relaxed));
        let need = MIN_FREE + unflushed + bytes * if logged { 2 } else { 1 };
        ensure_free(&self.path, need)
    }

    fn cf(&self, space: Space) -> Result<&ColumnFamily, StoreError> {
        self.db
            .cf_handle(space.name())
            .ok_or_else(|| StoreError::Backend(format!("column family {space} missing")))
    }
}

impl Store for RocksStore {
    fn get(&self, space: Space, key: &[u8], buf: &mut Vec<u8>) -> Result<bool, StoreError> {
        buf.clear();
        // A chunk value is checked against its blake3 id once decoded (by
        // every reader: see `repo::chain`), so RocksDB's own CRC32C of the
        // blob record is skipped for them: Debian's portable build computes
        // it in software, ~5% of a checkout's CPU time. Objects, refs and
        // metadata keep it.
        let mut ro = ReadOptions::default();
        ro.set_verify_checksums(space != Space::Chunks);
        match self
            .db
            .get_pinned_cf_opt(self.cf(space)?, key, &ro)
            .map_err(|e| self.read_error(e, space, key))?
        {
            Some(v) => {
                buf.extend_from_slice(&v);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn contains(&self, space: Space, key: &[u8]) -> Result<bool, StoreError> {
        // key_may_exist is only a hint; a pinned get does not copy the value.
        Ok(self
            .db
            .get_pinned_cf(self.cf(space)?, key)
            .map_err(|e| self.read_error(e, space, key))?
            .is_some())
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        self.write_reclaim(batch, &mut Vec::new())
    }

    fn write_reclaim(&self, batch: Batch, values: &mut Vec<Vec<u8>>) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Err(StoreError::ReadOnly);
        }
        let _guard = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        for e in &batch.expects {
            let current = self
                .db
                .get_pinned_cf(self.cf(e.space)?, &e.key)
                .map_err(|err| self.read_error(err, e.space, &e.key))?;
            if current.as_deref() != e.value.as_deref() {
                return Err(StoreError::Conflict {
                    space: e.space,
                    key_hex: to_hex(&e.key),
                });
            }
        }
        let unlogged = batch.is_unlogged();
        let bytes = batch.payload_bytes() as u64;
        self.ensure_room(bytes, !unlogged)?;
        let mut wb = WriteBatch::default();
        for op in &batch.ops {
            let cf = self.cf(op.space)?;
            match &op.value {
                Some(v) => wb.put_cf(cf, &op.key, v),
                None => wb.delete_cf(cf, &op.key),
            }
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(self.sync && !unlogged);
        wo.disable_wal(unlogged);
        self.db
            .write_opt(wb, &wo)
            .map_err(|e| write_error(&self.path, e))?;
        self.unflushed.fetch_add(bytes, Ordering::Relaxed);
        values.extend(batch.ops.into_iter().filter_map(|op| op.value));
        Ok(())
    }

    fn scan_prefix(
        &self,
        space: Space,
        prefix: &[u8],
        f: &mut ScanFn<'_>,
    ) -> Result<(), StoreError> {
        let mut ro = ReadOptions::default();
        if !prefix.is_empty() {
            // An upper bound lets RocksDB stop at the end of the prefix
            // instead of stepping over tombstones beyond it.
            ro.set_iterate_range(PrefixRange(prefix));
        }
        let mut it = self.db.raw_iterator_cf_opt(self.cf(space)?, ro);
        it.seek(prefix);
        while let Some((k, v)) = it.item() {
            if !k.starts_with(prefix) || !f(k, v)? {
                return Ok(());
            }
            it.next();
        }
        it.status().map_err(|e| self.read_error(e, space, prefix))
    }

    fn compact(&self) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Err(StoreError::ReadOnly);
        }
        self.ensure_room_to_compact()?;
        self.flush()?;
        for space in Space::ALL {
            let cf = self.cf(space)?;
            let blobs = space == Space::Chunks && self.blob_files;
            if blobs {
                // Relocate the live values of every blob file during this
                // compaction, so files holding garbage are dropped.
                self.db
                    .set_options_cf(
                        cf,
                        &[
                            ("enable_blob_garbage_collection", "true"),
                            ("blob_garbage_collection_age_cutoff", "1.0"),
                        ],
                    )
                    .map_err(backend)?;
            }
            let mut co = rocksdb::CompactOptions::default();
            co.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
            self.db
                .compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &co);
            if blobs {
                self.db
                    .set_options_cf(cf, &[("enable_blob_garbage_collection", "false")])
                    .map_err(backend)?;
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Ok(());
        }
        self.ensure_room(0, false)?;
        self.db
            .flush_wal(true)
            .map_err(|e| write_error(&self.path, e))?;
        for space in Space::ALL {
            self.db
                .flush_cf(self.cf(space)?)
                .map_err(|e| write_error(&self.path, e))?;
        }
        self.unflushed.store(0, Ordering::Relaxed);
        self.release_cache();
        Ok(())
    }

    fn keep_cached(&self, flushes: usize) {
        let mut epochs = self.cache_epochs.lock().unwrap_or_else(|e| e.into_inner());
        epochs.set_keep(flushes);
    }

    fn set_write_buffer(&self, space: Space, bytes: usize) -> Result<(), StoreError> {
        let current = (space == Space::Chunks)
            .then(|| self.chunk_write_buffer.load(Ordering::Relaxed) as usize);
        // Each change writes a new options file: none when nothing changes.
        if self.mode == Mode::ReadOnly || current == Some(bytes) {
            return Ok(());
        }
        self.db
            .set_options_cf(
                self.cf(space)?,
                &[("write_buffer_size", &bytes.to_string())],
            )
            .map_err(backend)?;
        if space == Space::Chunks {
            self.chunk_write_buffer
                .store(bytes as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    fn ensure_room_to_compact(&self) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Ok(());
        }
        // A full compaction with blob garbage collection may rewrite every
        // live value before the old files go.
        let live = self.size_on_disk()?;
        ensure_free(&self.path, MIN_FREE + live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epochs(dropped_through: u64, ends: &[u64], keep: usize) -> CacheEpochs {
        CacheEpochs {
            dropped_through,
            ends: ends.iter().copied().collect(),
            keep,
        }
    }

    #[test]
    fn cache_epochs_drop_the_files_of_epochs_past_the_newest_kept() {
        let mut e = CacheEpochs::fresh(7);
        e.keep = 2;
        // A flush with no blob file past 7 ends no epoch.
        assert_eq!(e.end(7), None);
        assert_eq!(e, epochs(0, &[7], 2));
        // Two epochs kept: the earlier processes' files, then 8-10.
        assert_eq!(e.end(10), None);
        assert_eq!(e, epochs(0, &[7, 10], 2));
        // A third epoch drops the first.
        assert_eq!(e.end(12), Some(1..=7));
        assert_eq!(e, epochs(7, &[10, 12], 2));
        assert_eq!(e.end(12), None);
        assert_eq!(e.end(13), Some(8..=10));
        assert_eq!(e, epochs(10, &[12, 13], 2));
        // Keeping fewer drops at the next flush, new files or not.
        e.keep = 1;
        assert_eq!(e.end(13), Some(11..=12));
        assert_eq!(e, epochs(12, &[13], 1));
    }

    #[test]
    fn cache_epochs_go_on_from_the_file_the_last_writer_left() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("db");
        epochs(7, &[10, 12], 2).save(&store);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("db.cached")).unwrap(),
            "ckvc-cached 1\n7\n10\n12\n"
        );
        assert_eq!(CacheEpochs::load(&store, 12), epochs(7, &[10, 12], 1));
        // Files written after the last epoch's end join it.
        assert_eq!(CacheEpochs::load(&store, 14), epochs(7, &[10, 14], 1));
        assert!(!dir.path().join("db.cached.tmp").exists());
    }

    #[test]
    fn a_max_chain_past_what_the_cached_file_holds_keeps_the_file_readable() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("db");
        let mut e = CacheEpochs::fresh(1);
        e.set_keep(usize::from(u16::MAX) + 1);
        assert_eq!(e.keep, MAX_CACHED_EPOCHS);
        for max in 2..=MAX_CACHED_EPOCHS as u64 + 10 {
            e.end(max);
        }
        assert_eq!(e.ends.len(), MAX_CACHED_EPOCHS);
        assert_eq!(e.dropped_through, 10);
        e.save(&store);
        let mut loaded = CacheEpochs::load(&store, MAX_CACHED_EPOCHS as u64 + 10);
        loaded.set_keep(usize::MAX);
        assert_eq!(loaded, e);
        e.set_keep(0);
        assert_eq!(e.keep, 1);
    }

    #[test]
    fn a_cached_file_that_does_not_fit_the_store_starts_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("db");
        assert_eq!(CacheEpochs::load(&store, 9), CacheEpochs::fresh(9));
        for text in [
            "",
            "ckvc-cached 2\n0\n5\n",
            "ckvc-cached 1\n",
            "ckvc-cached 1\n0\n",
            "ckvc-cached 1\nx\n5\n",
            "ckvc-cached 1\n0\n5\n4\n",
            "ckvc-cached 1\n5\n5\n",
            // A file past the store's newest: the store was replaced.
            "ckvc-cached 1\n0\n5\n10\n",
        ] {
            std::fs::write(dir.path().join("db.cached"), text).unwrap();
            assert_eq!(
                CacheEpochs::load(&store, 9),
                CacheEpochs::fresh(9),
                "{text:?}"
            );
        }
    }
}
