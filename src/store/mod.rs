//! The object database: ordered key-value spaces behind a small trait.
//!
//! This module owns persistence: five key spaces ([`Space`], RocksDB column
//! families on disk), atomic multi-space write batches with optional
//! compare-and-swap preconditions ([`Batch`]), durability (WAL, synced
//! writes, [`Store::flush`]) and locking (one writer per repository; readers
//! while a writer works). [`RocksStore`] is the only code in ckvc that names
//! RocksDB; [`MemStore`] is the in-memory twin for tests. Both pass one
//! conformance suite (`src/store/tests.rs`).
//!
//! It must not know what the bytes mean: no codec, no checkpoint formats, no
//! commit or ref semantics. Keys and values are opaque; the key schema the
//! repository builds on top is proposed in `docs/format/store.md`.
//!
//! The trait follows gitoxide's habits: a lookup writes into a buffer the
//! caller owns and reports "not found" as `Ok(false)`, never as an error.
//!
//! ```
//! use ckvc::store::{Batch, MemStore, Space, Store};
//! let store = MemStore::new();
//! let mut batch = Batch::new();
//! batch.put(Space::Refs, b"refs/heads/main", [7u8; 32].to_vec());
//! batch.expect(Space::Refs, b"refs/heads/main", None); // compare-and-swap: must be new
//! store.write(batch).unwrap();
//! let mut buf = Vec::new();
//! assert!(store.get(Space::Refs, b"refs/heads/main", &mut buf).unwrap());
//! assert_eq!(buf, [7u8; 32]);
//! assert!(!store.get(Space::Refs, b"refs/heads/dev", &mut buf).unwrap());
//! ```

use std::fmt;
use std::path::PathBuf;

mod crc;
mod id;
mod mem;
mod rocks;
#[cfg(test)]
mod tests;

pub use crc::calls as rocksdb_crc_calls;
pub use id::{to_hex, ChunkId, CommitId, Hash32, ObjectId, ParseIdError};
pub use mem::MemStore;
pub use rocks::{Mode, RocksOptions, RocksStore};

/// Raises this process's soft limit on open files to its hard limit.
///
/// The store keeps every blob file it has read open (RocksDB's file cache
/// is unbounded for a reader, which must keep its table files open), and
/// a blob file holds about one chunk memtable (32 MiB by default) of
/// chunks: an `fsck`, `gc` or old-step checkout of a store of 30 GB or
/// more would meet a soft limit of 1024 (a common default) as "Too many
/// open files". The hard limit is what the administrator allows; the soft
/// one only a default (the JVM raises it the same way). Called by the CLI
/// at start and by the Python package when it opens a repository; failure
/// leaves the limit as it was. A no-op where there are no such limits.
pub fn raise_open_file_limit() {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid rlimit for the calls to read and write.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
    }
}

/// A key space. Each is a RocksDB column family, so each can be tuned for
/// its values (large encoded chunks vs small objects) and scanned alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Space {
    /// Encoded chunks, keyed by [`ChunkId`]. Large values.
    Chunks = 0,
    /// File manifests, trees, commits.
    Objects = 1,
    /// Branches, tags, `HEAD`.
    Refs = 2,
    /// Derived lookups (e.g. step -> commit per branch).
    Index = 3,
    /// Repository format version and settings.
    Meta = 4,
}

impl Space {
    /// Every space, in a fixed order.
    pub const ALL: [Space; 5] = [
        Space::Chunks,
        Space::Objects,
        Space::Refs,
        Space::Index,
        Space::Meta,
    ];

    /// The column family name on disk. Part of the on-disk format.
    pub const fn name(self) -> &'static str {
        match self {
            Space::Chunks => "chunks",
            Space::Objects => "objects",
            Space::Refs => "refs",
            Space::Index => "index",
            Space::Meta => "meta",
        }
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Space {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of the store layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Another process (or another handle in this one) holds the write lock.
    #[error("the store at {path} is locked by another writer (another ckvc process, or another open repository in this one)")]
    Locked { path: PathBuf },
    /// A read-only open found no store at `path`.
    #[error("no store at {path}")]
    NotFound { path: PathBuf },
    /// The store directory holds data but its `CURRENT` file (which names
    /// the live manifest) is gone: opening it would start an empty store
    /// over the old files, so nothing opens it.
    #[error(
        "the store's CURRENT file is missing at {path}; the store is damaged (nothing was changed)"
    )]
    MissingCurrent { path: PathBuf },
    /// The storage engine could not open the store: one of its files is
    /// damaged or missing.
    #[error("the store at {path} cannot be opened: {reason}")]
    Damaged { path: PathBuf, reason: String },
    /// Too little free space to write safely: the write was refused before
    /// anything was written.
    #[error("no space left on the device of {path}: {free} bytes free, ckvc needs at least {need} to write safely (nothing was changed)")]
    Full { path: PathBuf, free: u64, need: u64 },
    /// A reader met a file that a writer's compaction (gc) replaced while it
    /// read: not damage; the read can simply be run again.
    #[error("the repository is being rewritten by another ckvc process (gc); retry")]
    Rewritten,
    /// A file-system operation on `path` failed.
    #[error("I/O error at {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The backend reports damaged data while reading `key_hex` of `space`.
    #[error("corrupt entry {space}/{key_hex}: {reason}")]
    Corrupt {
        space: Space,
        key_hex: String,
        reason: String,
    },
    /// A write on a store opened with [`Mode::ReadOnly`].
    #[error("the store is open read-only")]
    ReadOnly,
    /// A [`Batch::expect`] precondition did not hold; nothing was written.
    #[error("{space}/{key_hex} changed: compare-and-swap failed")]
    Conflict { space: Space, key_hex: String },
    /// Any other error of the storage engine, with its message.
    #[error("storage engine: {0}")]
    Backend(String),
}

/// What kind of failure an error is, for callers that act on it (exit
/// codes, retries, exception classes): each error type classifies every
/// variant once, in its `class()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Stored data is damaged or missing.
    Corruption,
    /// Another process holds or rewrites the store: running again may work.
    Busy,
    /// Anything else (bad input, I/O, a full disk, ...).
    Other,
}

impl StoreError {
    /// The kind of failure; every variant is listed.
    pub fn class(&self) -> ErrorClass {
        match self {
            StoreError::Corrupt { .. }
            | StoreError::MissingCurrent { .. }
            | StoreError::Damaged { .. } => ErrorClass::Corruption,
            StoreError::Locked { .. } | StoreError::Rewritten => ErrorClass::Busy,
            StoreError::NotFound { .. }
            | StoreError::Io { .. }
            | StoreError::Full { .. }
            | StoreError::ReadOnly
            | StoreError::Conflict { .. }
            | StoreError::Backend(_) => ErrorClass::Other,
        }
    }

    /// True for damaged stored data (as opposed to a busy or full store).
    pub fn is_corruption(&self) -> bool {
        self.class() == ErrorClass::Corruption
    }

    /// True when another process holds the store or rewrites it under a
    /// reader: the operation may succeed when run again.
    pub fn is_busy(&self) -> bool {
        self.class() == ErrorClass::Busy
    }
}

/// One write of a [`Batch`]: a put (`value: Some`) or a delete (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub space: Space,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
}

/// A precondition of a [`Batch`]: the key holds `value` (`None`: is absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    pub space: Space,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
}

/// Writes applied together or not at all, in order (a later write to the same
/// key wins), after all preconditions were checked.
///
/// A batch holds its values in memory: callers writing gigabytes should
/// write content-addressed chunks in several batches first and put only the
/// objects and the ref move in the final atomic one (an interrupted commit
/// then leaves unreferenced chunks, which gc removes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    ops: Vec<Op>,
    expects: Vec<Expect>,
    bytes: usize,
    unlogged: bool,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value` (an owned `Vec` moves in without a copy).
    pub fn put(&mut self, space: Space, key: &[u8], value: impl Into<Vec<u8>>) -> &mut Self {
        let value = value.into();
        self.bytes += key.len() + value.len();
        self.ops.push(Op {
            space,
            key: key.to_vec(),
            value: Some(value),
        });
        self
    }

    /// Removes `key` (a no-op when it is absent).
    pub fn delete(&mut self, space: Space, key: &[u8]) -> &mut Self {
        self.bytes += key.len();
        self.ops.push(Op {
            space,
            key: key.to_vec(),
            value: None,
        });
        self
    }

    /// Makes the batch conditional: it applies only if `key` currently holds
    /// `value` (`None`: is absent), else the write fails with
    /// [`StoreError::Conflict`] and changes nothing. This is the ref
    /// compare-and-swap. It is sound because a store has one writer: the
    /// RocksDB lock admits one read-write process, and inside it every write
    /// runs check-then-apply under one mutex, so no write can slip in between.
    pub fn expect(&mut self, space: Space, key: &[u8], value: Option<&[u8]>) -> &mut Self {
        self.expects.push(Expect {
            space,
            key: key.to_vec(),
            value: value.map(<[u8]>::to_vec),
        });
        self
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    pub fn expectations(&self) -> &[Expect] {
        &self.expects
    }

    /// Skip the write-ahead log: the batch is still atomic and visible at
    /// once, but survives a crash only after a later [`Store::flush`]. For
    /// content-addressed chunks that nothing references yet (a commit
    /// flushes before the batch that moves its ref): it halves the bytes
    /// written and saves an fsync per batch.
    pub fn unlogged(&mut self) -> &mut Self {
        self.unlogged = true;
        self
    }

    pub fn is_unlogged(&self) -> bool {
        self.unlogged
    }

    /// Number of writes (not counting preconditions).
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Sum of key and value lengths: what the batch holds in memory.
    pub fn payload_bytes(&self) -> usize {
        self.bytes
    }
}

/// An owned key and value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// The scan callback: gets each key and value, returns `Ok(false)` to stop.
pub type ScanFn<'a> = dyn FnMut(&[u8], &[u8]) -> Result<bool, StoreError> + 'a;

/// An ordered key-value store with atomic batches.
///
/// Implementations are shared between threads (`Send + Sync`). Readers see
/// each [`Store::write`] entirely or not at all.
pub trait Store: Send + Sync {
    /// Looks `key` up. On `Ok(true)` `buf` holds exactly the value (it is
    /// cleared first, so its capacity is reused); `Ok(false)` means not found
    /// and leaves `buf` empty.
    fn get(&self, space: Space, key: &[u8], buf: &mut Vec<u8>) -> Result<bool, StoreError>;

    /// Whether `key` exists.
    fn contains(&self, space: Space, key: &[u8]) -> Result<bool, StoreError>;

    /// Checks the batch's preconditions and applies all its writes atomically:
    /// all or nothing, also across a crash. Durable on return when the store
    /// syncs writes ([`RocksOptions::sync`], the default).
    fn write(&self, batch: Batch) -> Result<(), StoreError>;

    /// [`Store::write`], adding the batch's values to `values` afterwards
    /// when the store copied them (so a caller can reuse the buffers);
    /// by default it adds none.
    fn write_reclaim(&self, batch: Batch, values: &mut Vec<Vec<u8>>) -> Result<(), StoreError> {
        let _ = values;
        self.write(batch)
    }

    /// Calls `f` on every entry whose key starts with `prefix` (empty: every
    /// entry of the space), in ascending byte order of keys, until `f`
    /// returns `Ok(false)` or an error (which is returned). The scan sees one
    /// consistent state. `f` must not write to the same store: an
    /// implementation may hold a read lock during the scan.
    fn scan_prefix(
        &self,
        space: Space,
        prefix: &[u8],
        f: &mut ScanFn<'_>,
    ) -> Result<(), StoreError>;

    /// Makes every completed write durable (and, for RocksDB, moves it from
    /// the write-ahead log into table files). A no-op on read-only stores.
    fn flush(&self) -> Result<(), StoreError>;

    /// Gives the disk space of deleted and overwritten entries back (for
    /// RocksDB: a full compaction that also rewrites blob files holding
    /// garbage). Slow on a large store; gc calls it after a sweep. Entries
    /// are unchanged. A no-op by default.
    fn compact(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Bounds the memory holding writes to `space` not yet in table or
    /// blob files (for RocksDB: that space's memtable size; up to two are
    /// held while one is being flushed). Writes are unchanged. A no-op by
    /// default and on read-only stores.
    fn set_write_buffer(&self, space: Space, bytes: usize) -> Result<(), StoreError> {
        let _ = (space, bytes);
        Ok(())
    }

    /// Keeps in the page cache the values written since the newest
    /// `flushes` [`Store::flush`]es that wrote any (for RocksDB: their blob
    /// files), dropping the older ones after each such flush, so a writer
    /// reads the values it wrote lately from memory and the cache does not
    /// grow with every commit. Values are unchanged. A no-op by default
    /// and on read-only stores.
    fn keep_cached(&self, flushes: usize) {
        let _ = flushes;
    }

    /// Refuses with [`StoreError::Full`] when the device could not hold a
    /// [`Store::compact`] (which may rewrite every live value before the
    /// old files go), so a caller can refuse before it changes anything.
    /// Always `Ok` by default.
    fn ensure_room_to_compact(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Conveniences on top of [`Store`], for every store.
pub trait StoreExt: Store {
    /// [`Store::get`] into a fresh vector.
    fn get_vec(&self, space: Space, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let mut buf = Vec::new();
        Ok(self.get(space, key, &mut buf)?.then_some(buf))
    }

    /// All entries under `prefix`, copied out. For small spaces (refs, index).
    fn collect_prefix(&self, space: Space, prefix: &[u8]) -> Result<Vec<Entry>, StoreError> {
        let mut out = Vec::new();
        self.scan_prefix(space, prefix, &mut |k, v| {
            out.push((k.to_vec(), v.to_vec()));
            Ok(true)
        })?;
        Ok(out)
    }

    /// Writes a single put.
    fn put(&self, space: Space, key: &[u8], value: impl Into<Vec<u8>>) -> Result<(), StoreError> {
        let mut batch = Batch::new();
        batch.put(space, key, value);
        self.write(batch)
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

/// A shared store is a store (so wrappers can hold an `Arc`).
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn get(&self, space: Space, key: &[u8], buf: &mut Vec<u8>) -> Result<bool, StoreError> {
        (**self).get(space, key, buf)
    }
    fn contains(&self, space: Space, key: &[u8]) -> Result<bool, StoreError> {
        (**self).contains(space, key)
    }
    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        (**self).write(batch)
    }
    fn write_reclaim(&self, batch: Batch, values: &mut Vec<Vec<u8>>) -> Result<(), StoreError> {
        (**self).write_reclaim(batch, values)
    }
    fn scan_prefix(
        &self,
        space: Space,
        prefix: &[u8],
        f: &mut ScanFn<'_>,
    ) -> Result<(), StoreError> {
        (**self).scan_prefix(space, prefix, f)
    }
    fn flush(&self) -> Result<(), StoreError> {
        (**self).flush()
    }
    fn compact(&self) -> Result<(), StoreError> {
        (**self).compact()
    }
    fn set_write_buffer(&self, space: Space, bytes: usize) -> Result<(), StoreError> {
        (**self).set_write_buffer(space, bytes)
    }
    fn keep_cached(&self, flushes: usize) {
        (**self).keep_cached(flushes)
    }
    fn ensure_room_to_compact(&self) -> Result<(), StoreError> {
        (**self).ensure_room_to_compact()
    }
}
