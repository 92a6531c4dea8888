//! Shared storage: moving commits between a repository and a remote (a
//! directory on a shared filesystem, or an S3-compatible bucket prefix).
//!
//! This module owns the transport and the remote layout
//! (`docs/format/remote.md`):
//!
//! - [`Remote`], a small trait over a flat key space of immutable files and
//!   compare-and-swap ref files, with three implementations: [`MemRemote`]
//!   (tests), [`DirRemote`] (a directory; atomic rename for files, an
//!   `O_EXCL` lock file for compare-and-swap) and [`S3Remote`] (the
//!   `object_store` crate; conditional `If-Match` / `If-None-Match` writes).
//!   One conformance suite ([`conformance`]) runs against all three.
//! - packs ([`pack`]): many chunk records and objects in one immutable file
//!   named by its blake3, plus a small index file, verified on receive;
//! - `gc --remote` ([`gc`]): mark from the remote's branches, delete
//!   unreachable packs in two phases (a grace period) so a racing push
//!   loses nothing;
//! - the remote layout (`layout.rs`: the marker, ref files, pack and
//!   index keys, reading the branches and the pack indexes);
//! - the verbs, one file each: `push.rs`, `fetch.rs` (with the staging of
//!   downloaded packs), `pull.rs`, `clone.rs`; and the remote
//!   configuration ([`config`]), kept by the repository (`Meta/remotes`)
//!   with the remote-tracking refs `refs/remotes/<remote>/<branch>`.
//!
//! It sits above `repo` and reaches the repository only through its API:
//! the reachability walk, the export of stored encodings
//! ([`Repository::object_bytes`](crate::repo::Repository::object_bytes)),
//! the verified import ([`Repository::import`](crate::repo::Repository::import):
//! nothing it has not verified reaches the local store) and ref moves; it
//! never names the store. It must not print: progress goes through the
//! [`Progress`] trait, which the CLI implements with progress bars. It never
//! moves a remote ref before every object the ref needs is on the remote.

use std::path::PathBuf;

mod aws_files;
mod clone;
pub mod config;
/// Test support: the suite every [`Remote`] must pass.
#[cfg(any(test, feature = "testing"))]
pub mod conformance;
mod dir;
mod fetch;
pub mod gc;
mod layout;
mod mem;
pub mod pack;
mod pull;
mod push;
mod s3;

pub use clone::{clone, CloneOptions, CloneReport};
pub use config::RemoteConfig;
pub use dir::DirRemote;
pub use fetch::{fetch, FetchOptions, FetchReport, RefUpdate};
pub use gc::{gc_remote, RemoteGcOptions, RemoteGcReport};
pub use mem::MemRemote;
pub use pull::{pull, PullReport};
pub use push::{push, PushOptions, PushReport};
pub use s3::{S3Options, S3Remote};

use crate::repo::RepoError;
use crate::store::CommitId;

/// A remote's version of a ref file, for compare-and-swap: an S3 ETag, or a
/// content hash on a filesystem. Opaque to callers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version(pub String);

/// Errors of the remote layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    #[error("bad remote URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("bad remote path {key:?}: {reason}")]
    BadPath { key: String, reason: String },
    /// A compare-and-swap write found the file changed (or, for a create,
    /// present); nothing was written.
    #[error("{key} on the remote changed meanwhile: compare-and-swap failed")]
    Conflict { key: String },
    #[error("{key} on the remote is locked by {lock} (another push is updating it; if none is running, remove the lock file)")]
    Locked { key: String, lock: PathBuf },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {reason}")]
    Backend { what: String, reason: String },
    /// Data read from the remote is damaged or malformed.
    #[error("remote {what} is corrupt: {reason}")]
    Corrupt { what: String, reason: String },
    /// A remote file is larger than anything ckvc writes there (or than
    /// its index says): refused before it is read.
    #[error("remote {key} is {len} bytes, more than the {limit} allowed for it")]
    TooLarge { key: String, len: u64, limit: u64 },
    /// A remote path is not a regular file (a FIFO, a device, a socket, a
    /// symbolic link): never opened for reading, so it cannot hang or feed
    /// endless bytes.
    #[error("remote {key} is not a regular file ({kind})")]
    NotRegularFile { key: String, kind: &'static str },
    #[error("{url} is not a ckvc remote ({reason})")]
    NotARemote { url: String, reason: String },
    #[error("remote {url} has layout version {found}; this build reads {supported}")]
    VersionTooNew {
        url: String,
        found: String,
        supported: u32,
    },
    #[error(
        "push to {branch} rejected: the remote has {}{}, which is not an ancestor of {} (non-fast-forward; fetch and merge first, or push --force)",
        remote.map_or_else(|| "(deleted)".into(), |c| c.short(12)),
        if *raced { ", pushed by someone else meanwhile" } else { "" },
        local.short(12)
    )]
    NonFastForward {
        branch: String,
        /// What the remote branch holds (`None`: deleted meanwhile).
        remote: Option<CommitId>,
        local: CommitId,
        /// The remote ref moved between the push's check and its
        /// compare-and-swap (another push won the race).
        raced: bool,
    },
    #[error("pull of {branch} rejected: the local branch ({}) and the remote's ({}) have diverged (not a fast-forward)", local.short(12), remote.short(12))]
    Diverged {
        branch: String,
        local: CommitId,
        remote: CommitId,
    },
    #[error("no remote named {name:?}")]
    NoSuchRemote { name: String },
    #[error("remote {name:?} already exists")]
    RemoteExists { name: String },
    #[error("invalid remote name {name:?}")]
    InvalidRemoteName { name: String },
    #[error("the remote has no branch {branch:?}")]
    NoSuchRemoteBranch { branch: String },
    #[error("{reason}")]
    Refused { reason: String },
    #[error(transparent)]
    Repo(#[from] RepoError),
}

impl RemoteError {
    /// True for damaged or missing data (remote or local).
    /// Every variant is listed: a new one must be classified here.
    pub fn is_corruption(&self) -> bool {
        match self {
            RemoteError::Corrupt { .. }
            | RemoteError::TooLarge { .. }
            | RemoteError::NotRegularFile { .. } => true,
            RemoteError::Repo(e) => e.is_corruption(),
            RemoteError::BadUrl { .. }
            | RemoteError::BadPath { .. }
            | RemoteError::Conflict { .. }
            | RemoteError::Locked { .. }
            | RemoteError::Io { .. }
            | RemoteError::Backend { .. }
            | RemoteError::NotARemote { .. }
            | RemoteError::VersionTooNew { .. }
            | RemoteError::NonFastForward { .. }
            | RemoteError::Diverged { .. }
            | RemoteError::NoSuchRemote { .. }
            | RemoteError::RemoteExists { .. }
            | RemoteError::InvalidRemoteName { .. }
            | RemoteError::NoSuchRemoteBranch { .. }
            | RemoteError::Refused { .. } => false,
        }
    }
}

/// Transport to shared storage: a flat space of files named by `/`-separated
/// keys (checked by [`check_key`]). Packs are written once with
/// [`Remote::put`]; ref files change only through [`Remote::put_if`].
///
/// Every write is atomic: a reader sees the old file or the whole new one.
pub trait Remote: Send + Sync {
    /// Where the remote is, for messages.
    fn url(&self) -> String;

    /// The file's bytes, or `None` if it does not exist.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RemoteError>;

    /// The file's bytes, or `None` if it does not exist; a file of more
    /// than `max` bytes is [`RemoteError::TooLarge`], refused without
    /// reading it (so a hostile remote cannot make a reader allocate more
    /// than the caller expects). The default reads and then checks.
    fn get_limited(&self, key: &str, max: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        match self.get(key)? {
            Some(b) if b.len() as u64 > max => Err(RemoteError::TooLarge {
                key: key.into(),
                len: b.len() as u64,
                limit: max,
            }),
            r => Ok(r),
        }
    }

    /// `len` bytes of the file from byte `start` (a ranged read: a fetch
    /// takes single entries out of a pack this way), or `None` if the file
    /// does not exist. A file that ends before `start + len` is
    /// [`RemoteError::Corrupt`]. The default reads the whole file and cuts
    /// the range out.
    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        let end = range_end(key, start, len)?;
        match self.get(key)? {
            Some(b) => cut_range(key, &b, start, end).map(Some),
            None => Ok(None),
        }
    }

    /// Delete what killed writers left behind (a directory remote's
    /// temporary files older than `older_than`); returns how many. A no-op
    /// where writes leave nothing (S3's PUT is atomic).
    fn clean_stale(&self, _older_than: std::time::Duration) -> Result<usize, RemoteError> {
        Ok(0)
    }

    /// The file's bytes and version, for a later [`Remote::put_if`].
    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, Version)>, RemoteError>;

    /// [`Remote::get_versioned`] of a file of at most `max` bytes: a larger
    /// one is [`RemoteError::TooLarge`], refused without reading it (as by
    /// [`Remote::get_limited`]). The default reads and then checks.
    fn get_versioned_limited(
        &self,
        key: &str,
        max: u64,
    ) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        match self.get_versioned(key)? {
            Some((b, _)) if b.len() as u64 > max => Err(RemoteError::TooLarge {
                key: key.into(),
                len: b.len() as u64,
                limit: max,
            }),
            r => Ok(r),
        }
    }

    /// Write (or overwrite) a file atomically.
    fn put(&self, key: &str, data: Vec<u8>) -> Result<(), RemoteError>;

    /// Compare-and-swap: write only if the file is still at `expected`
    /// (`None`: does not exist), else [`RemoteError::Conflict`]. Atomic
    /// against concurrent writers on every implementation.
    fn put_if(
        &self,
        key: &str,
        data: Vec<u8>,
        expected: Option<&Version>,
    ) -> Result<(), RemoteError>;

    /// Every key starting with `prefix` (a directory, ending in `/`), sorted.
    fn list(&self, prefix: &str) -> Result<Vec<String>, RemoteError>;

    /// Remove a file (a no-op when absent).
    fn delete(&self, key: &str) -> Result<(), RemoteError>;
}

/// The end of a range read, refused when it overflows.
fn range_end(key: &str, start: u64, len: u64) -> Result<u64, RemoteError> {
    start.checked_add(len).ok_or_else(|| RemoteError::BadPath {
        key: key.into(),
        reason: format!("range {start}+{len} overflows"),
    })
}

/// Bytes `start..end` of a file read whole.
fn cut_range(key: &str, b: &[u8], start: u64, end: u64) -> Result<Vec<u8>, RemoteError> {
    match b.get(start as usize..end as usize) {
        Some(r) if end <= b.len() as u64 => Ok(r.to_vec()),
        _ => Err(short_file(key, b.len() as u64, end)),
    }
}

fn short_file(key: &str, len: u64, end: u64) -> RemoteError {
    RemoteError::Corrupt {
        what: key.into(),
        reason: format!("is {len} bytes, shorter than the {end} its index promises"),
    }
}

/// Keys are relative, `/`-separated, made of ASCII letters, digits and
/// `._-`, with no empty component and none starting with `.` (so no `.` or
/// `..`): a key can never name a file outside the remote.
pub fn check_key(key: &str) -> Result<(), RemoteError> {
    let bad = |reason: &str| RemoteError::BadPath {
        key: key.into(),
        reason: reason.into(),
    };
    if key.is_empty() || key.len() > 512 {
        return Err(bad("empty or longer than 512 bytes"));
    }
    if !key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c))
    {
        return Err(bad("only ASCII letters, digits and ._-/ are allowed"));
    }
    if key
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(bad(
            "has an empty, '.' or '..' component (it could escape the remote)",
        ));
    }
    if key.split('/').any(|c| c.starts_with('.')) {
        // Hidden names are the directory remote's temporary and lock files.
        return Err(bad("a component starts with '.'"));
    }
    Ok(())
}

/// Where a remote URL points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A directory (`/path`, `file:///path`).
    Dir(PathBuf),
    /// `s3://bucket/prefix`.
    S3 { bucket: String, prefix: String },
}

/// Parse a remote URL: `s3://bucket[/prefix]`, `file:///abs/path`, or a
/// path (made absolute against the current directory). A `..` component is
/// refused in S3 prefixes; in paths it is resolved against the existing
/// directories.
pub fn parse_url(url: &str) -> Result<Location, RemoteError> {
    let bad = |reason: &str| RemoteError::BadUrl {
        url: url.into(),
        reason: reason.into(),
    };
    if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let ok_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
            && !bucket.starts_with(['.', '-']);
        if !ok_bucket {
            return Err(bad(
                "the bucket name must be 3-63 lowercase letters, digits, '-' or '.'",
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty() {
            check_key(prefix).map_err(|e| match e {
                RemoteError::BadPath { reason, .. } => bad(&format!("prefix {prefix:?} {reason}")),
                e => e,
            })?;
        }
        return Ok(Location::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
        });
    }
    if url.contains("://") && !url.starts_with("file://") {
        return Err(bad(
            "supported: s3://bucket/prefix, file:///path, or a path",
        ));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    if path.is_empty() {
        return Err(bad("empty path"));
    }
    if url.starts_with("file://") && !path.starts_with('/') {
        return Err(bad("a file:// URL needs an absolute path (file:///path)"));
    }
    let abs = std::path::absolute(path).map_err(|e| bad(&e.to_string()))?;
    Ok(Location::Dir(resolve_dots(&abs).map_err(|r| bad(&r))?))
}

/// Resolve `.` and `..` in an absolute path: the longest existing ancestor
/// is canonicalised (so `..` after a symlink means what the filesystem
/// says); a `..` in the part that does not exist yet is refused.
fn resolve_dots(p: &std::path::Path) -> Result<PathBuf, String> {
    use std::path::Component;
    let mut existing = p.to_path_buf();
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.file_name(), existing.parent()) {
            (Some(n), Some(parent)) => {
                rest.push(n.to_os_string());
                existing = parent.to_path_buf();
            }
            _ => break,
        }
    }
    // `file_name` is None for a trailing `..`: fall back to the components.
    if existing
        .components()
        .any(|c| matches!(c, Component::ParentDir))
        && !existing.exists()
    {
        return Err("has a '..' component in a part that does not exist".into());
    }
    let mut out = std::fs::canonicalize(&existing).map_err(|e| e.to_string())?;
    for n in rest.into_iter().rev() {
        if n == ".." || n == "." {
            return Err("has a '.' or '..' component in a part that does not exist".into());
        }
        out.push(n);
    }
    Ok(out)
}

/// Open the remote at `url` (S3 settings from `s3`, else the environment).
pub fn open_url(url: &str, s3: &S3Options) -> Result<Box<dyn Remote>, RemoteError> {
    Ok(match parse_url(url)? {
        Location::Dir(p) => Box::new(DirRemote::new(p)),
        Location::S3 { bucket, prefix } => Box::new(S3Remote::new(&bucket, &prefix, s3)?),
    })
}

/// Transfers report progress like the repository's verbs do.
pub use crate::repo::{NoProgress, Progress};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_push_race_names_both_commits_in_fields() {
        let (a, b) = (
            CommitId::from_bytes([0xaa; 32]),
            CommitId::from_bytes([0xbb; 32]),
        );
        let e = RemoteError::NonFastForward {
            branch: "main".into(),
            remote: Some(a),
            local: b,
            raced: true,
        };
        assert_eq!(
            e.to_string(),
            "push to main rejected: the remote has aaaaaaaaaaaa, pushed by someone else meanwhile, \
             which is not an ancestor of bbbbbbbbbbbb (non-fast-forward; fetch and merge first, or push --force)"
        );
        assert!(!e.is_corruption());
        let deleted = RemoteError::NonFastForward {
            branch: "main".into(),
            remote: None,
            local: b,
            raced: true,
        };
        assert!(deleted
            .to_string()
            .contains("the remote has (deleted), pushed"));
    }

    #[test]
    fn keys_that_could_escape_are_refused() {
        for bad in [
            "",
            "/abs",
            "../x",
            "a/../../b",
            "a//b",
            "./a",
            "a/.",
            "a\\b",
            "a b",
            "refs/heads/é",
        ] {
            assert!(check_key(bad).is_err(), "{bad}");
        }
        for good in [
            "ckvc-remote",
            "refs/heads/main",
            "packs/ab12.pack",
            "a.b/c..d",
        ] {
            check_key(good).unwrap();
        }
    }

    #[test]
    fn urls_parse_or_say_what_is_wrong() {
        assert_eq!(
            parse_url("s3://my-bucket/runs/gpt").unwrap(),
            Location::S3 {
                bucket: "my-bucket".into(),
                prefix: "runs/gpt".into()
            }
        );
        assert_eq!(
            parse_url("s3://my-bucket").unwrap(),
            Location::S3 {
                bucket: "my-bucket".into(),
                prefix: "".into()
            }
        );
        for bad in [
            "s3://my-bucket/a/../b",
            "s3://B/x",
            "s3://",
            "http://example.com/x",
            "file://relative",
            "",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert!(matches!(e, RemoteError::BadUrl { .. }), "{bad}: {e}");
        }
        let tmp = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(tmp.path()).unwrap();
        std::fs::create_dir(real.join("a")).unwrap();
        let via_dots = format!("{}/a/../remote", real.display());
        assert_eq!(
            parse_url(&via_dots).unwrap(),
            Location::Dir(real.join("remote"))
        );
        assert!(parse_url(&format!("{}/new/../x", real.display())).is_err());
        assert_eq!(
            parse_url(&format!("file://{}/r", real.display())).unwrap(),
            Location::Dir(real.join("r"))
        );
    }
}
