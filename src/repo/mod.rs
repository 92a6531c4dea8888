//! The repository: the user's verbs on top of the store, one file each
//! (`commit`, `checkout`, `log`, `branch`, `show`, `diff`, `gc`, `fsck`,
//! `watch`, ...).
//!
//! Owns the object model (chunk records, file manifests, trees, commits:
//! [`objects`], specified in `docs/format/objects.md`), refs (`HEAD`,
//! branches), revision syntax, and the rules that keep a repository
//! consistent: a commit writes its chunks, then its objects and the branch
//! move in one atomic batch that checks the branch still points where it
//! did; every chunk read back is decoded through a bounded delta chain and
//! verified against its blake3 id before a byte of it is used.
//!
//! Must not: print (the CLI does), name RocksDB (the store does), or know
//! codec or file-format internals beyond their public APIs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::codec::{self, DecodeError};
use crate::format::FormatError;
use crate::store::{
    ChunkId, CommitId, Mode, ObjectId, RocksStore, Space, Store, StoreError, StoreExt,
};

mod bases;
mod branch;
mod chain;
mod checkout;
mod commit;
mod damage;
mod diff;
mod exchange;
mod fsck;
mod gc;
mod infile;
mod log;
mod mirror;
pub mod objects;
mod outfile;
mod pause;
mod pool;
mod priority;
mod progress;
pub mod provenance;
mod reach;
mod read;
mod reflog;
mod remotes;
mod save;
mod show;
mod status;
mod watch;

pub use crate::store::ErrorClass;
pub use bases::SharedBases;
pub use checkout::{CheckoutOptions, CheckoutReport, BULK_READ_BYTES};
pub use commit::{CommitOptions, CommitReport, RunItem, StepSource};
pub use damage::{CorruptReason, ObjectRef, Place, Site};
pub use diff::{DiffReport, ElementDiff, FileDiff, FileStatus, TensorChange, TensorDiff};
pub use exchange::{Import, ImportBase, ObjectKind};
pub use fsck::{Damage, FsckReport};
pub use gc::{parse_duration, BestBy, Dropped, GcOptions, GcReport, KeepPolicy, RepoCounts};
pub use log::LogEntry;
use objects::{corrupt, object_key, ChunkHeader, ChunkRecord, Commit, FileManifest, Tree};
pub use objects::{ObjectDecodeError, PathError, PathProblem, RefLogEntry};
pub use pause::Pause;
pub use priority::lower_thread_priority;
pub use progress::{NoProgress, Progress};
pub use reach::{ChunkUse, Reachable, TensorPlace, WalkOptions};
pub use remotes::{tracking_ref, RemoteConfigs};
pub use show::{FileShow, SegmentShow, ShowReport, Storage, TensorShow};
pub use status::{dir_size, Status};
pub use watch::{watch, RunLayout, WatchEvent, WatchOptions, WatchReport};

/// The directory under a repository's root that holds its data.
pub const DOT_DIR: &str = ".ckvc";
/// Repository layout version, in `Meta/format`. 2 added chunk heads
/// (`Index` space, [`objects::chunk_head_key`]), which every writer keeps
/// beside its chunk records; a version-1 repository is read as it is and
/// marked version 2 by its first read-write open (its old chunks simply
/// have no head), so a build that knows nothing of heads cannot delete a
/// chunk and leave its head behind.
pub const REPO_FORMAT: u8 = 2;
/// The oldest layout this build opens (see [`REPO_FORMAT`]).
const OLDEST_REPO_FORMAT: u8 = 1;
/// No delta chain is ever followed further than this, whatever the
/// settings say: a cycle or an absurd chain is corruption, not a hang.
pub const HARD_MAX_CHAIN: u16 = 1000;

/// Errors of the repository layer, with what the user needs to act on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RepoError {
    #[error("not a ckvc repository (or any parent up to /): {path}")]
    NotARepository { path: PathBuf },
    #[error("a ckvc repository already exists at {path}")]
    AlreadyExists { path: PathBuf },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{path}: {source}")]
    Format {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadInput { path: PathBuf, reason: String },
    /// Encoding data to store failed (a compressor's error: out of memory,
    /// a bad level). Nothing stored is damaged.
    #[error("could not encode {what}: {reason}")]
    Encode { what: String, reason: String },
    #[error("no step number for {dir}: pass --step, or add trainer_state.json (global_step), or name the directory like checkpoint-500")]
    NoStep { dir: PathBuf },
    #[error("{}", describe_unknown(rev, kind, suggestions))]
    UnknownRevision {
        rev: String,
        /// What the revision was taken for.
        kind: RevKind,
        /// The nearest steps, or similarly named branches and tags.
        suggestions: Vec<String>,
    },
    #[error("revision {rev:?} is ambiguous")]
    AmbiguousRevision { rev: String },
    #[error("{path} exists and is not empty (use --force to write into it)")]
    OutputNotEmpty { path: PathBuf },
    #[error("branch {name:?} already exists")]
    BranchExists { name: String },
    #[error("no branch {name:?}")]
    NoSuchBranch { name: String },
    #[error("tag {name:?} already exists")]
    TagExists { name: String },
    #[error("invalid branch name {name:?}")]
    InvalidBranchName { name: String },
    #[error("cannot delete the current branch {name:?}")]
    CurrentBranch { name: String },
    #[error("the repository has no commits yet")]
    Empty,
    /// Stored data that is inconsistent (a hash that does not match, a
    /// delta chain that loops, a file that does not reassemble); `site`
    /// says what and where, as fields.
    #[error("{site} is corrupt: {reason}")]
    Corrupt { site: Box<Site>, reason: String },
    /// A stored object (chunk record, manifest, tree, commit, ref log
    /// entry) that does not decode; `source` says why, in fields.
    #[error("{site} is corrupt: {source}")]
    BadObject {
        site: Box<Site>,
        #[source]
        source: objects::ObjectDecodeError,
    },
    /// A chunk whose codec payload does not decode.
    #[error("{site} is damaged: {source}")]
    Decode {
        site: Box<Site>,
        #[source]
        source: DecodeError,
    },
    #[error("{site} is missing from the store")]
    Missing { site: Box<Site> },
    /// A stage of a commit or checkout pipeline ended before the others
    /// (the stage's own error is the one returned; this is what the
    /// others see).
    #[error("the {stage} stopped")]
    Stopped { stage: &'static str },
    /// Data received from elsewhere (a fetch, a clone) is damaged or
    /// malformed: refused before any of it was stored (the inner error
    /// names the object).
    #[error(transparent)]
    Received(Box<RepoError>),
    #[error("the repository is damaged ({count} problems; first: {first}); run `ckvc fsck` and repair before gc")]
    Damaged { count: usize, first: String },
    /// `gc --keep best=N:METRIC` on a branch where commits lack the metric.
    #[error("{} commit(s) have no value of {metric:?} (step {}); best= cannot rank them", commits.len(), commits.iter().map(|c| c.1.to_string()).collect::<Vec<_>>().join(", "))]
    MissingMetric {
        metric: String,
        /// (commit, step) of each commit without it.
        commits: Vec<(CommitId, u64)>,
    },
    /// A commit whose step is not after the branch head's.
    #[error("step {step} is not after the head of branch {branch:?} (step {head_step})")]
    StepOrder {
        branch: String,
        step: u64,
        head_step: u64,
    },
}

/// What an unknown revision was looked up as.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RevKind {
    /// A step on a branch (`25`, `main@25`); a bare number was also tried
    /// as a commit id prefix.
    Step { branch: String, step: u64 },
    /// A branch, a tag or a commit id prefix.
    Name,
    /// `REV~N` reaching back past the first commit of that line.
    Ancestor { back: usize, depth: usize },
}

fn describe_unknown(rev: &str, kind: &RevKind, suggestions: &[String]) -> String {
    let mut s = match kind {
        RevKind::Step { branch, step } => {
            format!("no commit at step {step} on branch {branch:?} (and no commit id starting with {rev:?})")
        }
        RevKind::Name => format!("no branch, tag or commit id {rev:?}"),
        RevKind::Ancestor { back, depth } => {
            format!("{rev:?} goes back {back} commits, past the first commit ({depth} back)")
        }
    };
    if !suggestions.is_empty() {
        let what = match kind {
            RevKind::Step { .. } => "nearest steps",
            _ => "did you mean",
        };
        s.push_str(&format!("; {what}: {}", suggestions.join(", ")));
    }
    s
}

/// Levenshtein distance, for "did you mean" (short names only).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

impl RepoError {
    /// An I/O error at `at`, unless it is of `kind`: then the caller's bad
    /// input `input` (`reason`), as a file where a directory must be, or a
    /// directory that is not there.
    pub(crate) fn io_or_bad_input(
        source: std::io::Error,
        at: &Path,
        kind: std::io::ErrorKind,
        input: &Path,
        reason: &str,
    ) -> RepoError {
        if source.kind() == kind {
            RepoError::BadInput {
                path: input.to_path_buf(),
                reason: reason.into(),
            }
        } else {
            RepoError::Io {
                path: at.to_path_buf(),
                source,
            }
        }
    }

    /// The site of damage (`None` for errors that are not damage to one
    /// site: other errors, and received data, whose site is inside).
    pub fn site(&self) -> Option<&Site> {
        match self {
            RepoError::Corrupt { site, .. }
            | RepoError::BadObject { site, .. }
            | RepoError::Decode { site, .. }
            | RepoError::Missing { site } => Some(site),
            _ => None,
        }
    }

    /// Name where damaged data is used: the fields of `place` not known
    /// yet are filled in (what is known was learnt closer to the damage).
    /// Damage the storage engine found in a chunk's record becomes
    /// [`RepoError::Corrupt`] with that chunk as its object; other errors
    /// pass through unchanged.
    pub fn placed(self, place: &Place) -> RepoError {
        match self {
            RepoError::Corrupt { mut site, reason } => {
                site.place.fill(place);
                RepoError::Corrupt { site, reason }
            }
            RepoError::BadObject { mut site, source } => {
                site.place.fill(place);
                RepoError::BadObject { site, source }
            }
            RepoError::Decode { mut site, source } => {
                site.place.fill(place);
                RepoError::Decode { site, source }
            }
            RepoError::Missing { mut site } => {
                site.place.fill(place);
                RepoError::Missing { site }
            }
            RepoError::Store(StoreError::Corrupt {
                space,
                key_hex,
                reason,
            }) => {
                let object = match space {
                    Space::Chunks => key_hex.parse().ok().map(|id| ObjectRef::Chunk { id }),
                    _ => None,
                };
                RepoError::Corrupt {
                    site: Box::new(Site {
                        object,
                        place: place.clone(),
                        from: None,
                    }),
                    reason: format!("{space} store (key {key_hex}): {reason}"),
                }
            }
            e => e,
        }
    }

    /// The kind of failure; every variant is listed, so a new one must be
    /// classified here.
    pub fn class(&self) -> ErrorClass {
        match self {
            RepoError::Corrupt { .. }
            | RepoError::BadObject { .. }
            | RepoError::Decode { .. }
            | RepoError::Missing { .. }
            | RepoError::Received(_)
            | RepoError::Damaged { .. } => ErrorClass::Corruption,
            RepoError::Store(e) => e.class(),
            RepoError::NotARepository { .. }
            | RepoError::AlreadyExists { .. }
            | RepoError::Format { .. }
            | RepoError::Io { .. }
            | RepoError::BadInput { .. }
            | RepoError::Encode { .. }
            | RepoError::NoStep { .. }
            | RepoError::UnknownRevision { .. }
            | RepoError::AmbiguousRevision { .. }
            | RepoError::OutputNotEmpty { .. }
            | RepoError::BranchExists { .. }
            | RepoError::NoSuchBranch { .. }
            | RepoError::TagExists { .. }
            | RepoError::InvalidBranchName { .. }
            | RepoError::CurrentBranch { .. }
            | RepoError::Empty
            | RepoError::MissingMetric { .. }
            | RepoError::StepOrder { .. }
            | RepoError::Stopped { .. } => ErrorClass::Other,
        }
    }

    /// True for damaged or missing stored data (as opposed to user error).
    pub fn is_corruption(&self) -> bool {
        self.class() == ErrorClass::Corruption
    }

    /// True when another ckvc process holds or rewrites the repository: the
    /// command may succeed when run again.
    pub fn is_busy(&self) -> bool {
        self.class() == ErrorClass::Busy
    }
}

/// Repository settings, stored in `Meta/config` (JSON).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Config {
    /// Longest delta chain a new chunk may extend; past it the chunk is
    /// stored full (a keyframe).
    pub max_chain: u16,
    /// Tensor and opaque data are cut into chunks of at most this many bytes.
    pub chunk_bytes: u64,
    /// zstd level for opaque chunks.
    pub zstd_level: i32,
    /// Longest delta chain `gc --compact` leaves.
    #[serde(default = "default_compact_chain")]
    pub compact_chain: u16,
    /// Bytes of chunk data `commit` and `checkout` keep in memory at once
    /// (read, queued, being coded, decoded bases); peak memory stays near
    /// this plus the store's write buffers, whatever the checkpoint size.
    #[serde(default = "default_memory_budget")]
    pub memory_budget: u64,
    /// Whether a commit tells the codec where its chunks lie in their
    /// tensors' rows, so that a whole chunk of alike rows (Adam's moments)
    /// may be a row frame (chunk format version 8): 4-15% smaller
    /// optimizer keyframes, which encode about 3x and decode 2x slower.
    #[serde(default = "default_row_frames")]
    pub row_frames: bool,
}

fn default_row_frames() -> bool {
    true
}

fn default_memory_budget() -> u64 {
    256 << 20
}

fn default_compact_chain() -> u16 {
    Config::default().compact_chain
}

impl Default for Config {
    fn default() -> Self {
        Config {
            // Measured on the corpus (11 steps): max_chain 16 -> 0.769 of
            // logical on disk, newest-step checkout 0.37 s; 4 -> 0.778,
            // 0.09 s; 0 (no deltas) -> 0.807, 0.05 s. Checkout time grows
            // with the chain; 4 keeps most of the delta gain.
            max_chain: 4,
            chunk_bytes: 4 << 20,
            zstd_level: 9,
            compact_chain: 2,
            memory_budget: default_memory_budget(),
            row_frames: default_row_frames(),
        }
    }
}

/// An open repository.
pub struct Repository {
    root: PathBuf,
    store: Arc<dyn Store>,
    config: Config,
    /// Decoded chunks kept as the next delta base (a share of the memory
    /// budget, see [`base_cache_bytes`]; or one shared with other
    /// handles, [`Repository::use_bases`]).
    bases: Arc<bases::BaseCache>,
    /// `bases` is shared: its cap is the one `use_bases` gave.
    bases_shared: bool,
    /// Chunk-sized buffers reused by commit and checkout (a share of the
    /// memory budget, see [`pool::pool_bytes`]).
    pool: pool::BufPool,
}

/// The store's memtable for chunks under `budget`: an eighth of it, 8 to
/// 64 MiB. Chunk batches are not logged and a commit flushes at its end,
/// so its size only sets how often the store flushes (and how large a
/// blob file is); RocksDB holds up to two. Measured on the large run
/// (4 x 1.42 GiB, budget 256 MiB, two runs each): 64 MiB gave a peak RSS
/// of 583-587 MiB in commit and 532-582 MiB in checkout, 32 MiB gave
/// 350-391 and 362-364 MiB, commit time within the noise.
pub(crate) fn chunk_memtable_bytes(budget: u64) -> usize {
    (budget / 8).clamp(8 << 20, 64 << 20) as usize
}

/// The share of a memory budget held by decoded delta bases between the
/// chunks of this process's commits and checkouts.
pub(crate) fn base_cache_bytes(budget: u64) -> u64 {
    // Measured on a 3-step DCP run (152 MiB a step, budget 256 MiB): a
    // quarter of the budget added 60-100 MiB to peak RSS for no CPU time
    // saved that the noise of a loaded machine let us see; an eighth keeps
    // the prefix of each chain that a walk in step order reuses.
    budget / 8
}

impl std::fmt::Debug for Repository {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Repository")
            .field("root", &self.root)
            .finish()
    }
}

const HEAD: &[u8] = b"HEAD";
const HEADS: &str = "refs/heads/";
const TAGS: &str = "refs/tags/";
/// Remote-tracking refs: `refs/remotes/<remote>/<branch>` (written by
/// fetch, pull, push and clone; roots for gc, never branches).
pub const REMOTES: &str = "refs/remotes/";
/// `Meta/shallow`: the commits of a shallow clone whose parents are absent
/// (32-byte ids, concatenated, sorted).
pub(crate) const SHALLOW: &[u8] = b"shallow";

/// The ref name of branch `name`: `refs/heads/<name>`.
pub(crate) fn branch_ref(name: &str) -> String {
    format!("{HEADS}{name}")
}

/// Branch names: like git's, conservatively: letters, digits, `-_./`, no
/// `..`, not starting with `-` or `/`.
pub fn check_branch_name(name: &str) -> Result<(), RepoError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with(['-', '/', '.'])
        && !name.ends_with(['/', '.'])
        && !name.contains("..")
        && !name.contains("//")
        && !name.contains('@')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && name.parse::<u64>().is_err();
    if ok {
        Ok(())
    } else {
        Err(RepoError::InvalidBranchName { name: name.into() })
    }
}

impl Repository {
    /// Create a repository in `dir` (its data in `dir/.ckvc`), with the
    /// default branch `main` and no commits.
    pub fn init(dir: &Path, config: Config) -> Result<Repository, RepoError> {
        let dot = dir.join(DOT_DIR);
        if dot.exists() {
            return Err(RepoError::AlreadyExists { path: dot });
        }
        // A file where `dir` (or a directory above it) should be is the
        // caller's input, not an I/O failure.
        std::fs::create_dir_all(&dot).map_err(|source| {
            let reason = "not a directory (a file is in the way)";
            RepoError::io_or_bad_input(source, &dot, std::io::ErrorKind::NotADirectory, dir, reason)
        })?;
        let store = RocksStore::open(dot.join("db"), Mode::ReadWrite)?;
        Self::init_store(dir.to_path_buf(), Arc::new(store), config)
    }

    /// A repository over any store (tests use [`crate::store::MemStore`]).
    pub fn init_store(
        root: PathBuf,
        store: Arc<dyn Store>,
        config: Config,
    ) -> Result<Repository, RepoError> {
        let mut b = crate::store::Batch::new();
        b.expect(Space::Meta, b"format", None);
        b.put(Space::Meta, b"format", vec![REPO_FORMAT]);
        b.put(
            Space::Meta,
            b"config",
            serde_json::to_vec(&config).expect("config serialises"),
        );
        b.put(Space::Refs, HEAD, format!("ref: {HEADS}main").into_bytes());
        store.write(b)?;
        store.flush()?;
        Self::with_store(root, store, config)
    }

    /// Find the repository containing `start` (walking up like git) and
    /// open it. `write` takes the single-writer lock; readers do not.
    pub fn discover(start: &Path, write: bool) -> Result<Repository, RepoError> {
        let start = std::fs::canonicalize(start).map_err(|source| RepoError::Io {
            path: start.to_path_buf(),
            source,
        })?;
        let mut dir = Some(start.as_path());
        while let Some(d) = dir {
            if d.join(DOT_DIR).is_dir() {
                return Self::open(d, write);
            }
            dir = d.parent();
        }
        Err(RepoError::NotARepository { path: start })
    }

    /// Open the repository whose root is `root`.
    ///
    /// A writer reads and writes its table and blob files buffered: the
    /// newest commits' chunks stay in the page cache (older ones are
    /// dropped from it, see [`crate::store::Store::keep_cached`]), so the
    /// next commit reads its delta bases from memory instead of from the
    /// disk beside its own writes (numbers at
    /// [`crate::store::RocksOptions::direct_writes`]). `O_DIRECT` reads
    /// were the writer's while its writes were `O_DIRECT` too, so that
    /// nothing it read was cached.
    pub fn open(root: &Path, write: bool) -> Result<Repository, RepoError> {
        let mode = if write {
            Mode::ReadWrite
        } else {
            Mode::ReadOnly
        };
        Self::open_rocks(root, mode, &crate::store::RocksOptions::default())
    }

    /// Open the repository whose root is `root` to read far more than
    /// the page cache would usefully keep (a checkout of gigabytes): read
    /// only, its table and blob files read with `O_DIRECT` where the file
    /// system takes it (see [`crate::store::RocksOptions::direct_reads`]).
    pub fn open_for_bulk_reads(root: &Path) -> Result<Repository, RepoError> {
        let options = crate::store::RocksOptions {
            direct_reads: true,
            ..crate::store::RocksOptions::default()
        };
        Self::open_rocks(root, Mode::ReadOnly, &options)
    }

    fn open_rocks(
        root: &Path,
        mode: Mode,
        options: &crate::store::RocksOptions,
    ) -> Result<Repository, RepoError> {
        let db = root.join(DOT_DIR).join("db");
        // Only `init` creates a store: a repository whose store lost its
        // CURRENT file (or the whole directory) is damaged, not new.
        if !db.join("CURRENT").is_file() {
            return Err(StoreError::MissingCurrent { path: db }.into());
        }
        let store = RocksStore::open_with(&db, mode, options)?;
        Self::open_store(root.to_path_buf(), Arc::new(store))
    }

    /// Open a repository over an existing store.
    pub fn open_store(root: PathBuf, store: Arc<dyn Store>) -> Result<Repository, RepoError> {
        let format = store
            .get_vec(Space::Meta, b"format")?
            .ok_or(RepoError::NotARepository { path: root.clone() })?;
        match format.as_slice() {
            [REPO_FORMAT] => {}
            [v] if (OLDEST_REPO_FORMAT..REPO_FORMAT).contains(v) => {
                let mut b = crate::store::Batch::new();
                b.expect(Space::Meta, b"format", Some(&format));
                b.put(Space::Meta, b"format", vec![REPO_FORMAT]);
                match store.write(b) {
                    // A reader never writes: it reads the old layout as is.
                    Ok(()) | Err(StoreError::ReadOnly) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            _ => {
                return Err(RepoError::Corrupt {
                    site: Site::of(ObjectRef::Meta {
                        key: "format".into(),
                    }),
                    reason: format!(
                        "version {format:?}, this build reads {OLDEST_REPO_FORMAT} to {REPO_FORMAT}"
                    ),
                })
            }
        }
        let config = match store.get_vec(Space::Meta, b"config")? {
            Some(c) => serde_json::from_slice(&c).map_err(|e| RepoError::Corrupt {
                site: Site::of(ObjectRef::Meta {
                    key: "config".into(),
                }),
                reason: e.to_string(),
            })?,
            None => Config::default(),
        };
        Self::with_store(root, store, config)
    }

    /// A handle over `store` with `config`: its caches and the store's
    /// chunk memtable sized from the memory budget, the store's page cache
    /// kept for the commits a delta chain reaches back.
    fn with_store(
        root: PathBuf,
        store: Arc<dyn Store>,
        config: Config,
    ) -> Result<Repository, RepoError> {
        store.set_write_buffer(Space::Chunks, chunk_memtable_bytes(config.memory_budget))?;
        // A chunk's delta chain reaches back `max_chain` commits: the next
        // commit decodes its bases from the records of that many and the
        // keyframe's.
        store.keep_cached(usize::from(config.max_chain) + 1);
        Ok(Repository {
            root,
            store,
            bases: Arc::new(bases::BaseCache::new(base_cache_bytes(
                config.memory_budget,
            ))),
            bases_shared: false,
            pool: pool::BufPool::new(pool::pool_bytes(config.memory_budget)),
            config,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// Use `bytes` as the memory budget of this handle's commits and
    /// checkouts (the stored setting is unchanged).
    pub fn set_memory_budget(&mut self, bytes: u64) -> Result<(), RepoError> {
        self.config.memory_budget = bytes;
        if !self.bases_shared {
            self.bases.set_cap(base_cache_bytes(bytes), &self.pool);
        }
        self.pool.set_cap(pool::pool_bytes(bytes));
        self.store
            .set_write_buffer(Space::Chunks, chunk_memtable_bytes(bytes))?;
        Ok(())
    }

    /// Keep delta bases in `shared` instead of this handle's own cache:
    /// the chunks this handle's commits and reads decode or commit stay
    /// there for the next handle given the same cache. The Python package
    /// opens the repository for each save and passes the same cache, so a
    /// save's delta bases are the previous save's chunks, not a decode of
    /// their whole chain.
    ///
    /// `cap` is what the cache and this handle's own buffers may hold
    /// together: the cache keeps at most `cap` less the memory budget
    /// (which bounds a commit's buffers), and at least the budget's share.
    pub fn use_bases(&mut self, shared: &SharedBases, cap: u64) {
        let budget = self.config.memory_budget;
        let cap = cap.saturating_sub(budget).max(base_cache_bytes(budget));
        if shared.0.cap() != cap {
            shared.0.set_cap(cap, &self.pool);
        }
        self.bases = Arc::clone(&shared.0);
        self.bases_shared = true;
    }

    /// The store underneath, for tests that damage or inspect it on
    /// purpose (the `testing` feature). Everything else goes through the
    /// repository's methods: no module outside `repo` reads or writes the
    /// store's key layout.
    #[cfg(any(test, feature = "testing"))]
    pub fn store(&self) -> &dyn Store {
        &*self.store
    }
    /// Make everything written so far durable.
    pub fn flush(&self) -> Result<(), RepoError> {
        Ok(self.store.flush()?)
    }

    /// The branch `HEAD` names.
    pub fn current_branch(&self) -> Result<String, RepoError> {
        let head = self
            .store
            .get_vec(Space::Refs, HEAD)?
            .ok_or_else(|| RepoError::Missing {
                site: Site::of(ObjectRef::Ref {
                    name: "HEAD".into(),
                }),
            })?;
        let s = String::from_utf8(head).map_err(|_| RepoError::Corrupt {
            site: Site::of(ObjectRef::Ref {
                name: "HEAD".into(),
            }),
            reason: "not UTF-8".into(),
        })?;
        s.strip_prefix("ref: ")
            .and_then(|r| r.strip_prefix(HEADS))
            .map(str::to_string)
            .ok_or_else(|| RepoError::Corrupt {
                site: Site::of(ObjectRef::Ref {
                    name: "HEAD".into(),
                }),
                reason: format!("{s:?} is not a branch ref"),
            })
    }

    /// The commit a branch points at, or `None` for a branch with no commits.
    pub fn branch_head(&self, name: &str) -> Result<Option<CommitId>, RepoError> {
        self.ref_target(HEADS, name)
    }

    /// Every branch with its head, sorted by name.
    pub fn branches(&self) -> Result<Vec<(String, CommitId)>, RepoError> {
        self.refs_under(HEADS)
    }

    /// The remote-tracking refs of `remote` (`refs/remotes/<remote>/...`):
    /// branch name and commit, sorted.
    pub fn remote_refs(&self, remote: &str) -> Result<Vec<(String, CommitId)>, RepoError> {
        self.refs_under(&format!("{REMOTES}{remote}/"))
    }

    /// Every remote-tracking ref (`<remote>/<branch>` and commit), sorted.
    /// These are gc roots ([`Repository::roots`] includes them).
    pub fn all_remote_refs(&self) -> Result<Vec<(String, CommitId)>, RepoError> {
        self.refs_under(REMOTES)
    }

    /// The commit a remote-tracking ref holds.
    pub fn remote_ref(&self, remote: &str, branch: &str) -> Result<Option<CommitId>, RepoError> {
        self.ref_target(REMOTES, &format!("{remote}/{branch}"))
    }

    /// The commits of a shallow clone whose parents were left behind
    /// (empty for a full repository). History walks stop at them.
    pub fn shallow(&self) -> Result<std::collections::HashSet<CommitId>, RepoError> {
        let raw = self
            .store
            .get_vec(Space::Meta, SHALLOW)?
            .unwrap_or_default();
        if raw.len() % 32 != 0 {
            return Err(RepoError::Corrupt {
                site: Site::of(ObjectRef::Meta {
                    key: "shallow".into(),
                }),
                reason: format!("{} bytes, not a multiple of 32", raw.len()),
            });
        }
        Ok(raw
            .chunks_exact(32)
            .filter_map(CommitId::from_slice)
            .collect())
    }

    /// Whether a commit object is stored.
    pub fn has_commit(&self, id: &CommitId) -> Result<bool, RepoError> {
        Ok(self.store.contains(
            Space::Objects,
            &object_key(objects::KIND_COMMIT, &ObjectId::from_bytes(*id.as_bytes())),
        )?)
    }

    /// The commit the ref `prefix + name` holds, if it exists.
    fn ref_target(&self, prefix: &str, name: &str) -> Result<Option<CommitId>, RepoError> {
        match self
            .store
            .get_vec(Space::Refs, format!("{prefix}{name}").as_bytes())?
        {
            None => Ok(None),
            Some(v) => CommitId::from_slice(&v)
                .map(Some)
                .ok_or_else(|| RepoError::Corrupt {
                    site: Site::of(ObjectRef::Ref {
                        name: format!("{prefix}{name}"),
                    }),
                    reason: "ref is not a 32-byte id".into(),
                }),
        }
    }

    /// Every ref under `prefix` with its commit, sorted by name.
    fn refs_under(&self, prefix: &str) -> Result<Vec<(String, CommitId)>, RepoError> {
        let mut out = Vec::new();
        self.store
            .scan_prefix(Space::Refs, prefix.as_bytes(), &mut |k, v| {
                if let (Ok(name), Some(id)) = (
                    std::str::from_utf8(&k[prefix.len()..]),
                    CommitId::from_slice(v),
                ) {
                    out.push((name.to_string(), id));
                }
                Ok(true)
            })?;
        Ok(out)
    }

    pub fn commit_object(&self, id: &CommitId) -> Result<Commit, RepoError> {
        let site = || Site::of(ObjectRef::Commit { id: *id });
        let bytes = self.object(
            objects::KIND_COMMIT,
            &ObjectId::from_bytes(*id.as_bytes()),
            site,
        )?;
        Commit::decode(&bytes).map_err(corrupt(site()))
    }

    pub fn tree(&self, id: &ObjectId) -> Result<Tree, RepoError> {
        let site = || Site::of(ObjectRef::Tree { id: *id });
        Tree::decode(&self.object(objects::KIND_TREE, id, site)?).map_err(corrupt(site()))
    }

    pub fn manifest(&self, id: &ObjectId, path: &str) -> Result<FileManifest, RepoError> {
        let site = || {
            Site::of(ObjectRef::Manifest {
                id: *id,
                path: path.to_string(),
            })
        };
        FileManifest::decode(&self.object(objects::KIND_MANIFEST, id, site)?)
            .map_err(corrupt(site()))
    }

    /// An object's bytes, checked against its id.
    fn object(
        &self,
        kind: u8,
        id: &ObjectId,
        site: impl Fn() -> Box<Site>,
    ) -> Result<Vec<u8>, RepoError> {
        let bytes = self
            .store
            .get_vec(Space::Objects, &object_key(kind, id))?
            .ok_or_else(|| RepoError::Missing { site: site() })?;
        if ObjectId::digest(&bytes) != *id {
            return Err(RepoError::Corrupt {
                site: site(),
                reason: "content does not match its id".into(),
            });
        }
        Ok(bytes)
    }

    /// The header of a stored chunk from its head (`Index` space), without
    /// reading the record; `None` when the chunk has no head (written
    /// before repository format 2, or not stored).
    pub(crate) fn chunk_head(&self, id: &ChunkId) -> Result<Option<ChunkHeader>, RepoError> {
        let Some(v) = self
            .store
            .get_vec(Space::Index, &objects::chunk_head_key(id))?
        else {
            return Ok(None);
        };
        ChunkRecord::decode_header(&v)
            .map(Some)
            .map_err(corrupt(Site::chunk(*id)))
    }

    /// Whether the chunk `id` is stored. A chunk with a head is known
    /// without touching its record; one without is looked up in `Chunks`
    /// (an absent key costs an index lookup, a present one a blob read).
    pub(crate) fn has_chunk(&self, id: &ChunkId) -> Result<bool, RepoError> {
        if self
            .store
            .contains(Space::Index, &objects::chunk_head_key(id))?
        {
            return Ok(true);
        }
        Ok(self.store.contains(Space::Chunks, id.as_bytes())?)
    }

    /// A chunk's stored record (missing is an error).
    /// Its payload is a buffer of the repository's pool: hand it back
    /// ([`pool::BufPool::put`]) when done on a hot path.
    fn chunk_record(&self, id: &ChunkId) -> Result<ChunkRecord, RepoError> {
        let mut b = self.pool.take(0);
        if !self.store.get(Space::Chunks, id.as_bytes(), &mut b)? {
            self.pool.put(b);
            return Err(RepoError::Missing {
                site: Site::chunk(*id),
            });
        }
        ChunkRecord::decode_owned(b).map_err(corrupt(Site::chunk(*id)))
    }

    /// The raw bytes of a chunk, decoded through its delta chain and
    /// verified against its id.
    pub fn read_chunk(&self, id: &ChunkId) -> Result<Vec<u8>, RepoError> {
        let rec = self.chunk_record(id)?;
        self.decode_record(id, rec, None).map(|(raw, _)| raw)
    }

    /// [`read_chunk`](Self::read_chunk), decoding against `cache` when the
    /// chunk's delta base is in it (the caller verified those bytes), so a
    /// walk in history order decodes each delta once instead of its chain.
    pub(crate) fn read_chunk_cached(
        &self,
        id: &ChunkId,
        cache: &std::collections::HashMap<ChunkId, Vec<u8>>,
    ) -> Result<Vec<u8>, RepoError> {
        let rec = self.chunk_record(id)?;
        self.decode_record(id, rec, Some(cache)).map(|(raw, _)| raw)
    }

    /// Decode the record of chunk `id` through its delta chain (bases from
    /// `cache` when there, else from the store) and verify it; returns the
    /// raw bytes and the record's stored depth.
    fn decode_record(
        &self,
        id: &ChunkId,
        rec: ChunkRecord,
        cache: Option<&std::collections::HashMap<ChunkId, Vec<u8>>>,
    ) -> Result<(Vec<u8>, u16), RepoError> {
        // The base decoded last time this process read or committed it,
        // when kept (verified bytes): then the chain below is not decoded.
        // The chunk's own record is always decoded and checked, so damage
        // to it is found whatever is kept.
        let base = rec.base;
        let kept = base.and_then(|b| self.bases.get(&b).map(|raw| (b, raw)));
        let (raw, rec) = chain::decode_chain(
            id,
            rec,
            codec::HARD_MAX_RAW_LEN,
            "",
            &self.pool,
            |e| e,
            |b| match cache.and_then(|c| c.get(b)) {
                Some(raw) => Ok::<_, RepoError>(chain::Link::Raw(raw.as_slice().into())),
                None => match &kept {
                    Some((k, raw)) if k == b => Ok(chain::Link::Raw((&raw[..]).into())),
                    _ => Ok(chain::Link::Record(self.chunk_record(b)?)),
                },
            },
        )?;
        // The next step of this chain will want these bytes as its base
        // (in `kept`'s place: let go of it first, so its buffer can go
        // back to the pool).
        drop(kept);
        self.bases
            .insert(*id, raw.as_slice().into(), base.as_ref(), &self.pool);
        self.pool.put(rec.data);
        Ok((raw, rec.depth))
    }

    /// Resolve a revision: `HEAD`, `HEAD~N` (also `REV~N`), a branch, a
    /// tag, `branch@step`, a bare step number on the current branch, or a
    /// commit id (or unique prefix of at least 4 hex digits).
    pub fn resolve(&self, rev: &str) -> Result<CommitId, RepoError> {
        let unknown = |kind, suggestions| RepoError::UnknownRevision {
            rev: rev.into(),
            kind,
            suggestions,
        };
        let (base, back) = match rev.rsplit_once('~') {
            Some((b, n)) => (
                b,
                n.parse::<usize>()
                    .map_err(|_| unknown(RevKind::Name, Vec::new()))?,
            ),
            None => (rev, 0),
        };
        let on_branch = |branch: &str, step: u64| -> Result<CommitId, RepoError> {
            let head = self.branch_head(branch)?.ok_or(RepoError::Empty)?;
            if let Some(id) = self.find_step(head, step)? {
                return Ok(id);
            }
            if let Some(id) = self.by_prefix(&step.to_string())? {
                return Ok(id);
            }
            Err(unknown(
                RevKind::Step {
                    branch: branch.into(),
                    step,
                },
                self.nearest_steps(head, step)?,
            ))
        };
        let mut id = if base == "HEAD" {
            let b = self.current_branch()?;
            self.branch_head(&b)?.ok_or(RepoError::Empty)?
        } else if let Some((branch, step)) = base.split_once('@') {
            let step: u64 = step
                .parse()
                .map_err(|_| unknown(RevKind::Name, Vec::new()))?;
            if self.branch_head(branch)?.is_none() {
                return Err(RepoError::NoSuchBranch {
                    name: branch.into(),
                });
            }
            on_branch(branch, step)?
        } else if let Ok(step) = base.parse::<u64>() {
            on_branch(&self.current_branch()?, step)?
        } else if let Some(id) = self.branch_head(base)? {
            id
        } else if let Some(id) = self.tag(base)? {
            id
        } else if let Some(id) = self.by_prefix(base)? {
            id
        } else {
            let mut similar: Vec<(usize, String)> = self
                .branches()?
                .into_iter()
                .map(|(b, _)| b)
                .chain(self.tags()?.into_iter().map(|(t, _)| t))
                .map(|n| (edit_distance(base, &n), n))
                .filter(|(d, n)| *d <= 2.max(n.len() / 3))
                .collect();
            similar.sort();
            return Err(unknown(
                RevKind::Name,
                similar.into_iter().take(3).map(|(_, n)| n).collect(),
            ));
        };
        for i in 0..back {
            id = match self.commit_object(&id)?.parents.first() {
                Some(p) => *p,
                None => {
                    return Err(unknown(RevKind::Ancestor { back, depth: i }, Vec::new()));
                }
            };
        }
        Ok(id)
    }

    /// Up to two steps on either side of `step` on the line from `head`.
    fn nearest_steps(&self, head: CommitId, step: u64) -> Result<Vec<String>, RepoError> {
        let mut steps: Vec<u64> = Vec::new();
        let shallow = self.shallow()?;
        let mut cur = Some(head);
        while let Some(id) = cur {
            let c = self.commit_object(&id)?;
            steps.push(c.step);
            cur = c
                .parents
                .first()
                .copied()
                .filter(|_| !shallow.contains(&id));
        }
        steps.sort_unstable();
        steps.dedup();
        let at = steps.partition_point(|&s| s < step);
        Ok(steps[at.saturating_sub(2)..(at + 2).min(steps.len())]
            .iter()
            .map(u64::to_string)
            .collect())
    }

    /// Every commit with `step` on the first-parent line of `branch`,
    /// newest first (`checkout STEP` takes the first).
    pub fn commits_at_step(&self, branch: &str, step: u64) -> Result<Vec<CommitId>, RepoError> {
        let mut out = Vec::new();
        if self.branch_head(branch)?.is_none() {
            return Ok(out);
        }
        for e in self.log(Some(branch), None)? {
            if e.commit.step == step {
                out.push(e.id);
            }
        }
        Ok(out)
    }

    fn find_step(&self, head: CommitId, step: u64) -> Result<Option<CommitId>, RepoError> {
        let shallow = self.shallow()?;
        let mut cur = Some(head);
        while let Some(id) = cur {
            let c = self.commit_object(&id)?;
            if c.step == step {
                return Ok(Some(id));
            }
            cur = c
                .parents
                .first()
                .copied()
                .filter(|_| !shallow.contains(&id));
        }
        Ok(None)
    }

    /// A commit whose hex id starts with `prefix` (at least 4 digits).
    fn by_prefix(&self, prefix: &str) -> Result<Option<CommitId>, RepoError> {
        let p = prefix.to_ascii_lowercase();
        if p.len() < 4 || p.len() > 64 || !p.chars().all(|c| c.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let whole: Vec<u8> = (0..p.len() / 2)
            .map(|i| u8::from_str_radix(&p[2 * i..2 * i + 2], 16).expect("hex digits"))
            .collect();
        let mut key = vec![objects::KIND_COMMIT];
        key.extend_from_slice(&whole);
        let mut found = Vec::new();
        self.store.scan_prefix(Space::Objects, &key, &mut |k, _| {
            if crate::store::to_hex(&k[1..]).starts_with(&p) {
                found.push(CommitId::from_slice(&k[1..]));
            }
            Ok(found.len() < 2)
        })?;
        match found.as_slice() {
            [] => Ok(None),
            [Some(id)] => Ok(Some(*id)),
            [None] => Ok(None),
            _ => Err(RepoError::AmbiguousRevision { rev: prefix.into() }),
        }
    }
}
