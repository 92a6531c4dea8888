//! A remote in a directory, typically on a shared filesystem (NFS, Lustre,
//! a mounted bucket). Files are written to a hidden temporary name in the
//! same directory, synced, and renamed into place, so readers see the old
//! file or the whole new one. Compare-and-swap takes an `O_EXCL` lock file
//! (`.<name>.lock` beside the ref) for the few microseconds of
//! read-compare-rename, the way git locks refs: atomic on local filesystems
//! and on NFSv3+ (exclusive create is part of the protocol).
//!
//! `object_store`'s `LocalFileSystem` would serve plain files, but it has
//! no conditional update (`PutMode::Update`), so ref compare-and-swap would
//! need this code anyway; everything above the [`Remote`] trait (packs,
//! protocol, verification) is shared with S3.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{check_key, Remote, RemoteError, Version};

/// How long a compare-and-swap waits for another writer's lock file before
/// reporting [`RemoteError::Locked`] (a lock is held for microseconds; one
/// this old was left by a killed process).
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// No file of a directory remote is read if larger than this (the largest
/// pack a reader accepts, `pack::MAX_PACK_BYTES`).
const MAX_FILE: u64 = super::pack::MAX_PACK_BYTES;

/// Directories below `refs/heads` a branch name makes at most (200 bytes,
/// a `/` between parts): how deep `clean_stale` looks for temporary files.
const MAX_REF_NESTING: usize = 100;

/// A remote in a directory.
#[derive(Debug, Clone)]
pub struct DirRemote {
    root: PathBuf,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl DirRemote {
    /// The remote at `root` (created on the first write).
    pub fn new(root: PathBuf) -> Self {
        DirRemote { root }
    }

    fn path(&self, key: &str) -> Result<PathBuf, RemoteError> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    fn io(what: &Path) -> impl FnOnce(std::io::Error) -> RemoteError + '_ {
        move |source| RemoteError::Io {
            what: what.display().to_string(),
            source,
        }
    }

    /// Reads the file at `path` (named `key`), at most `max` bytes. Only a
    /// regular file is read: the last component is opened without
    /// following a symbolic link and without blocking (a FIFO would block
    /// an open forever), then checked with fstat, and its length is checked
    /// before anything is read.
    fn read(path: &Path, key: &str, max: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        let Some((f, len)) = Self::open_regular(path, key)? else {
            return Ok(None);
        };
        if len > max {
            return Err(RemoteError::TooLarge {
                key: key.into(),
                len,
                limit: max,
            });
        }
        let mut buf = Vec::with_capacity(len as usize);
        // Bounded even if the file grows while being read.
        std::io::Read::read_to_end(&mut std::io::Read::take(&f, max + 1), &mut buf)
            .map_err(Self::io(path))?;
        if buf.len() as u64 > max {
            return Err(RemoteError::TooLarge {
                key: key.into(),
                len: buf.len() as u64,
                limit: max,
            });
        }
        Ok(Some(buf))
    }

    /// Opens the regular file at `path` (see [`DirRemote::read`]); returns
    /// it with its length, or `None` if it does not exist.
    fn open_regular(path: &Path, key: &str) -> Result<Option<(File, u64)>, RemoteError> {
        let mut opts = OpenOptions::new();
        opts.read(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
        }
        let f = match opts.open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            // O_NOFOLLOW on a symbolic link.
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(RemoteError::NotRegularFile {
                    key: key.into(),
                    kind: "a symbolic link",
                })
            }
            Err(e) => return Err(Self::io(path)(e)),
        };
        let meta = f.metadata().map_err(Self::io(path))?;
        if !meta.is_file() {
            let ft = meta.file_type();
            return Err(RemoteError::NotRegularFile {
                key: key.into(),
                kind: if ft.is_dir() {
                    "a directory"
                } else {
                    "a FIFO, device or socket"
                },
            });
        }
        Ok(Some((f, meta.len())))
    }

    /// `.<name>.<suffix>` beside `path` (whose directory is created).
    fn hidden_sibling(path: &Path, suffix: &str) -> Result<PathBuf, RemoteError> {
        let dir = path.parent().expect("a key has a parent: the root");
        fs::create_dir_all(dir).map_err(Self::io(dir))?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(dir.join(format!(".{name}.{suffix}")))
    }

    /// Write `data` to a temporary file beside `path`, sync it, rename it
    /// over `path`, sync the directory.
    fn write_atomic(path: &Path, data: &[u8]) -> Result<(), RemoteError> {
        let tmp = Self::hidden_sibling(
            path,
            &format!(
                "tmp-{}-{}",
                std::process::id(),
                TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
            ),
        )?;
        let dir = path.parent().expect("a key has a parent: the root");
        let result = (|| {
            let mut f = File::create(&tmp).map_err(Self::io(&tmp))?;
            f.write_all(data).map_err(Self::io(&tmp))?;
            f.sync_all().map_err(Self::io(&tmp))?;
            fs::rename(&tmp, path).map_err(Self::io(path))?;
            // Make the rename itself durable.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}

/// Removes the lock file when the compare-and-swap ends, however it ends.
struct LockGuard(PathBuf);
impl Drop for LockGuard {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

fn version_of(data: &[u8]) -> Version {
    Version(blake3::hash(data).to_hex().to_string())
}

impl Remote for DirRemote {
    fn url(&self) -> String {
        self.root.display().to_string()
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        Self::read(&self.path(key)?, key, MAX_FILE)
    }

    fn get_limited(&self, key: &str, max: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        Self::read(&self.path(key)?, key, max.min(MAX_FILE))
    }

    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        let path = self.path(key)?;
        let end = super::range_end(key, start, len)?;
        let Some((f, size)) = Self::open_regular(&path, key)? else {
            return Ok(None);
        };
        if size < end {
            return Err(super::short_file(key, size, end));
        }
        if len > MAX_FILE {
            return Err(RemoteError::TooLarge {
                key: key.into(),
                len,
                limit: MAX_FILE,
            });
        }
        let mut buf = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, start).map_err(|e| {
            if e.kind() == ErrorKind::UnexpectedEof {
                super::short_file(key, size, end) // shrunk meanwhile
            } else {
                Self::io(&path)(e)
            }
        })?;
        Ok(Some(buf))
    }

    fn clean_stale(&self, older_than: Duration) -> Result<usize, RemoteError> {
        // Temporary files are `.<name>.tmp-<pid>-<n>` beside their target:
        // packs, refs (branch names with `/` nest), `gc/pending` and the
        // layout file at the root; a push in progress has fresh ones, so
        // only old ones go.
        let mut removed = 0;
        let mut dirs: Vec<(PathBuf, usize)> = vec![
            (self.root.clone(), 0),
            (self.root.join("gc"), 0),
            (self.root.join("packs"), 0),
            (self.root.join("refs/heads"), MAX_REF_NESTING),
        ];
        while let Some((d, nest)) = dirs.pop() {
            let Ok(rd) = fs::read_dir(&d) else { continue };
            for e in rd.flatten() {
                let Ok(kind) = e.file_type() else { continue };
                if kind.is_dir() && nest > 0 {
                    dirs.push((e.path(), nest - 1));
                    continue;
                }
                let name = e.file_name().to_string_lossy().into_owned();
                if !(kind.is_file() && name.starts_with('.') && name.contains(".tmp-")) {
                    continue;
                }
                let old = e
                    .metadata()
                    .ok()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age >= older_than);
                if old && fs::remove_file(e.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        self.get_versioned_limited(key, MAX_FILE)
    }

    fn get_versioned_limited(
        &self,
        key: &str,
        max: u64,
    ) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        Ok(
            Self::read(&self.path(key)?, key, max.min(MAX_FILE))?.map(|d| {
                let v = version_of(&d);
                (d, v)
            }),
        )
    }

    fn put(&self, key: &str, data: Vec<u8>) -> Result<(), RemoteError> {
        Self::write_atomic(&self.path(key)?, &data)
    }

    fn put_if(
        &self,
        key: &str,
        data: Vec<u8>,
        expected: Option<&Version>,
    ) -> Result<(), RemoteError> {
        let path = self.path(key)?;
        let lock = Self::hidden_sibling(&path, "lock")?;
        let started = Instant::now();
        let _guard = loop {
            match OpenOptions::new().write(true).create_new(true).open(&lock) {
                Ok(_) => break LockGuard(lock),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    if started.elapsed() > LOCK_WAIT {
                        return Err(RemoteError::Locked {
                            key: key.into(),
                            lock,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(Self::io(&lock)(e)),
            }
        };
        let current = Self::read(&path, key, MAX_FILE)?.map(|d| version_of(&d));
        if current.as_ref() != expected {
            return Err(RemoteError::Conflict { key: key.into() });
        }
        Self::write_atomic(&path, &data)
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>, RemoteError> {
        let base = prefix.trim_end_matches('/');
        let start = if base.is_empty() {
            self.root.clone()
        } else {
            self.path(base)?
        };
        let mut out = Vec::new();
        let mut stack = vec![start];
        while let Some(d) = stack.pop() {
            let entries = match fs::read_dir(&d) {
                Ok(e) => e,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) if e.kind() == ErrorKind::NotADirectory => continue,
                Err(e) => return Err(Self::io(&d)(e)),
            };
            for e in entries {
                let e = e.map_err(Self::io(&d))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue; // temporary and lock files
                }
                let ft = e.file_type().map_err(Self::io(&d))?;
                if ft.is_dir() {
                    stack.push(e.path());
                } else if let Ok(rel) = e.path().strip_prefix(&self.root) {
                    let key = rel.to_string_lossy().into_owned();
                    if key.starts_with(prefix) {
                        out.push(key);
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete(&self, key: &str) -> Result<(), RemoteError> {
        let p = self.path(key)?;
        match fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Self::io(&p)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killed write of `gc/pending`, of the layout file or of a branch
    /// ref whose name has a `/` left its temporary file where
    /// `clean_stale` never looked (it read `packs/` and `refs/heads/`
    /// only, not below): leaked space on the remote, forever.
    #[test]
    fn clean_stale_removes_old_temporary_files_wherever_a_write_puts_them() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let r = DirRemote::new(root.to_path_buf());
        let old = std::time::SystemTime::now() - Duration::from_secs(7200);
        let mut stale = Vec::new();
        for (dir, name) in [
            ("", ".ckvc-remote.tmp-1-0"),
            ("gc", ".pending.tmp-1-1"),
            ("packs", ".ab.pack.tmp-1-2"),
            ("refs/heads", ".main.tmp-1-3"),
            ("refs/heads/team/x", ".y.tmp-1-4"),
        ] {
            let d = root.join(dir);
            fs::create_dir_all(&d).unwrap();
            let f = File::create(d.join(name)).unwrap();
            f.set_modified(old).unwrap();
            stale.push(d.join(name));
        }
        let fresh = root.join("refs/heads/team/.z.tmp-1-5");
        File::create(&fresh).unwrap();
        let kept = root.join("refs/heads/team/x/y");
        File::create(&kept).unwrap().set_modified(old).unwrap();
        assert_eq!(
            r.clean_stale(Duration::from_secs(3600)).unwrap(),
            stale.len()
        );
        assert!(stale.iter().all(|p| !p.exists()));
        assert!(fresh.exists() && kept.exists());
    }
}
