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
//! Locking: RocksDB's `LOCK` file admits one read-write process; a second
//! read-write open, from another process or this one, fails with
//! [`StoreError::Locked`]. Readers open with [`Mode::ReadOnly`], a RocksDB
//! read-only instance: it takes no lock and sees everything the writer had
//! written (WAL included) when it opened; a new handle sees later writes.
//! It keeps every table file open (`max_open_files = -1`), so the writer's
//! compactions deleting files under it cannot break a long `checkout`. Its
//! info log goes to a private temporary directory, removed on drop; nothing
//! is written to the repository by a reader.
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
    /// Memtable size of `Space::Chunks`. Default 64 MiB.
    pub chunk_write_buffer: usize,
}

impl Default for RocksOptions {
    fn default() -> Self {
        Self {
            sync: true,
            blob_files: true,
            min_blob_size: 4 << 10,
            chunk_write_buffer: 64 << 20,
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
    path: PathBuf,
    mode: Mode,
    sync: bool,
    blob_files: bool,
    /// Serialises writers inside this process, so a batch's preconditions are
    /// checked and its writes applied with no other write in between.
    write_lock: Mutex<()>,
}

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

fn read_error(e: rocksdb::Error, space: Space, key: &[u8]) -> StoreError {
    if e.kind() == ErrorKind::Corruption {
        StoreError::Corrupt {
            space,
            key_hex: to_hex(key),
            reason: e.into_string(),
        }
    } else {
        backend(e)
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
                    // Reclaims the space of deleted chunks (gc) when
                    // compaction meets the oldest blob files.
                    cf.set_enable_blob_gc(true);
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
        let cfs = column_families(options);
        let (db, reader_dir) = match mode {
            Mode::ReadWrite => {
                std::fs::create_dir_all(&path).map_err(|e| io(&path, e))?;
                db_opts.create_if_missing(true);
                db_opts.create_missing_column_families(true);
                let db = DB::open_cf_descriptors(&db_opts, &path, cfs).map_err(|e| {
                    let msg = e.to_string();
                    if e.kind() == ErrorKind::IOError && msg.contains("LOCK") {
                        StoreError::Locked { path: path.clone() }
                    } else {
                        backend(e)
                    }
                })?;
                (db, None)
            }
            Mode::ReadOnly => {
                if !path.join("CURRENT").is_file() {
                    return Err(StoreError::NotFound { path });
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
                db_opts.set_db_log_dir(&dir.0);
                let db = DB::open_cf_descriptors_read_only(&db_opts, &path, cfs, false)
                    .map_err(backend)?;
                (db, Some(dir))
            }
        };
        Ok(Self {
            db,
            _reader_dir: reader_dir,
            path,
            mode,
            sync: options.sync,
            blob_files: options.blob_files,
            write_lock: Mutex::new(()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Bytes of all files in the store directory.
    pub fn size_on_disk(&self) -> Result<u64, StoreError> {
        fn walk(dir: &Path) -> Result<u64, StoreError> {
            let mut total = 0;
            for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
                let entry = entry.map_err(|e| io(dir, e))?;
                let meta = entry.metadata().map_err(|e| io(&entry.path(), e))?;
                total += if meta.is_dir() {
                    walk(&entry.path())?
                } else {
                    meta.len()
                };
            }
            Ok(total)
        }
        walk(&self.path)
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
        match self
            .db
            .get_pinned_cf(self.cf(space)?, key)
            .map_err(|e| read_error(e, space, key))?
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
            .map_err(|e| read_error(e, space, key))?
            .is_some())
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Err(StoreError::ReadOnly);
        }
        let _guard = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        for e in &batch.expects {
            let current = self
                .db
                .get_pinned_cf(self.cf(e.space)?, &e.key)
                .map_err(|err| read_error(err, e.space, &e.key))?;
            if current.as_deref() != e.value.as_deref() {
                return Err(StoreError::Conflict {
                    space: e.space,
                    key_hex: to_hex(&e.key),
                });
            }
        }
        let unlogged = batch.is_unlogged();
        let mut wb = WriteBatch::default();
        for op in batch.ops {
            let cf = self.cf(op.space)?;
            match op.value {
                Some(v) => wb.put_cf(cf, &op.key, v),
                None => wb.delete_cf(cf, &op.key),
            }
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(self.sync && !unlogged);
        wo.disable_wal(unlogged);
        self.db.write_opt(wb, &wo).map_err(backend)
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
        it.status().map_err(|e| read_error(e, space, prefix))
    }

    fn compact(&self) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Err(StoreError::ReadOnly);
        }
        self.flush()?;
        for space in Space::ALL {
            let cf = self.cf(space)?;
            let blobs = space == Space::Chunks && self.blob_files;
            if blobs {
                // Relocate the live values of every blob file during this
                // compaction, so files holding garbage are dropped.
                self.db
                    .set_options_cf(cf, &[("blob_garbage_collection_age_cutoff", "1.0")])
                    .map_err(backend)?;
            }
            let mut co = rocksdb::CompactOptions::default();
            co.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
            self.db
                .compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &co);
            if blobs {
                self.db
                    .set_options_cf(cf, &[("blob_garbage_collection_age_cutoff", "0.25")])
                    .map_err(backend)?;
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        if self.mode == Mode::ReadOnly {
            return Ok(());
        }
        self.db.flush_wal(true).map_err(backend)?;
        for space in Space::ALL {
            self.db.flush_cf(self.cf(space)?).map_err(backend)?;
        }
        Ok(())
    }
}
