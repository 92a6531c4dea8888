//! `commit`: store a checkpoint directory as a new commit on a branch.
//!
//! Files are read through the format layer and streamed segment by segment;
//! tensor data is cut into element-aligned chunks, each new chunk encoded
//! (in parallel) against the same tensor's chunk in the parent commit when
//! the delta chain allows, and written in bounded batches. The manifests,
//! tree, commit and branch move go in one final batch that only applies if
//! the branch still points at the parent: a failure anywhere before leaves
//! the branch where it was (at worst with unreferenced chunks for gc).

use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rayon::prelude::*;

use crate::codec::{self, DType, Options, Scratch};
use crate::format::{self, Segment};
use crate::store::{Batch, ChunkId, CommitId, ObjectId, Space, StoreExt};

use super::infile::{AtFile, InFile};
use super::mirror::{self, Mirror};
use super::objects::{
    check_path, chunk_head_key, corrupt, object_key, stored_head, ChunkRecord, Commit, CommitStats,
    FileManifest, Payload, SegmentRef, Tree, KIND_COMMIT, KIND_MANIFEST, KIND_TREE,
};
use super::pause::Pause;
use super::pool::{with_scratch, BufPool};
use super::{branch_ref, chain, check_branch_name, RepoError, Repository, Site};

/// What to commit besides the directory.
#[derive(Debug, Clone, Default)]
pub struct CommitOptions {
    /// The step; else `trainer_state.json`'s `global_step`, else the
    /// directory name's trailing number.
    pub step: Option<u64>,
    pub message: String,
    /// The branch to commit on; default the current branch. It must exist
    /// unless `new_branch`.
    pub branch: Option<String>,
    /// Create `branch`, starting at the current branch's head (a commit on
    /// a new branch continues the history it was forked from).
    pub new_branch: bool,
    /// Accept a step that is not after the branch head's step (by default
    /// that is [`RepoError::StepOrder`]: two commits with one step make
    /// `checkout STEP` ambiguous).
    pub allow_step_order: bool,
    /// Where the training code is (a directory inside its git repository);
    /// default the current directory. Outside a git repository the commit
    /// records no provenance.
    pub code: Option<PathBuf>,
    /// Metrics to record beside (and over) those of `trainer_state.json`,
    /// for trainers that write none.
    pub metrics: Vec<(String, f64)>,
    /// Where a new chunk's parent bytes are not at hand (neither kept from
    /// an earlier commit nor in the parent's directory), code it against
    /// the nearest chunk down the parent's delta chain that is, else
    /// against the chain's keyframe, instead of decoding the parent's
    /// chain: at most one record (a whole chunk) is decoded per base,
    /// whatever the depth. The deltas are then against an older tensor
    /// and a little larger; after `max_chain` delta commits the next
    /// commit is a keyframe. For commits whose bases are rarely at hand
    /// (the Python package's background saves).
    pub shallow_bases: bool,
    /// Held by another thread while the job beside the commit needs the
    /// machine: the commit's readers and coders wait before their next
    /// chunk (the Python package's background saves, held for each
    /// `optimizer.step()`).
    pub pause: Option<Arc<Pause>>,
}

/// Where a commit's step number came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepSource {
    /// [`CommitOptions::step`] (`--step`).
    Given,
    /// `trainer_state.json`'s `global_step`.
    TrainerState,
    /// The trailing number of the directory name.
    DirName,
    /// The number of accelerate's `checkpoint_<N>` directory (a
    /// `save_state` layout: `random_states_*.pkl` beside the weights).
    /// accelerate numbers its saves, not training steps, and none of its
    /// files records the global step, so the commit line says so.
    AccelerateSaveIndex,
}

impl StepSource {
    pub fn describe(self) -> &'static str {
        match self {
            StepSource::Given => "given",
            StepSource::TrainerState => "from trainer_state.json",
            StepSource::DirName => "from the directory name",
            StepSource::AccelerateSaveIndex => {
                "from accelerate's checkpoint_N, which counts saves, not training steps \
                 (no accelerate file records the step): pass --step to commit the real one"
            }
        }
    }
}

/// One checkpoint directory of a [`Repository::commit_run`].
#[derive(Debug, Clone, serde::Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RunItem {
    Committed {
        dir: PathBuf,
        report: CommitReport,
    },
    /// The branch already has this step.
    Skipped {
        dir: PathBuf,
        step: u64,
    },
}

/// What a commit did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CommitReport {
    pub id: CommitId,
    pub step: u64,
    pub step_source: StepSource,
    pub branch: String,
    pub stats: CommitStats,
    /// The branch head already held exactly this checkpoint at this step
    /// (a retry of a commit whose report was lost, e.g. to a kill after its
    /// last write): nothing was written and `id` is that commit.
    pub already_committed: bool,
    /// Bytes of the checkpoint read as tensors (delta- and float-coded).
    pub tensor_bytes: u64,
    /// Bytes kept opaque (headers, pickles, files of no known format).
    pub opaque_bytes: u64,
    /// Files of at least [`LARGE_OPAQUE`] bytes held entirely as opaque
    /// bytes (path, length): no tensor was seen in them.
    pub large_opaque: Vec<(String, u64)>,
}

/// Where a commit goes: the branch, whether it exists yet, and the parent
/// (the branch head, or for a new branch the head it is forked from).
pub(super) struct CommitTarget {
    branch: String,
    exists: bool,
    parent: Option<CommitId>,
}

/// Where the bytes of one file being committed come from.
pub(super) enum Source<'a> {
    /// A file on disk, opened when its turn comes.
    Path(PathBuf),
    /// Bytes in memory, the file being their concatenation (mode 0o644).
    Bytes(Parts<'a>),
}

/// A file in memory as the concatenation of slices (a header and each
/// tensor where it lives: nothing copied to commit them). A chunk inside
/// one slice is handed on as a slice of it; one across slices is copied.
/// With a [`Mirror`], the chunks are read as it says instead.
#[derive(Clone)]
pub(super) struct Parts<'a> {
    parts: Vec<&'a [u8]>,
    /// Where each part starts in the file (`parts.len() + 1` entries).
    starts: Vec<u64>,
    mirror: Option<&'a Mirror<'a>>,
}

impl<'a> Parts<'a> {
    pub(super) fn new(parts: Vec<&'a [u8]>) -> Parts<'a> {
        let parts: Vec<&[u8]> = parts.into_iter().filter(|p| !p.is_empty()).collect();
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut at = 0u64;
        starts.push(0);
        for p in &parts {
            at += p.len() as u64;
            starts.push(at);
        }
        Parts {
            parts,
            starts,
            mirror: None,
        }
    }

    /// These parts, their chunks read through `mirror` (a mirror of them).
    pub(super) fn mirrored(mut self, mirror: &'a Mirror<'a>) -> Parts<'a> {
        self.mirror = Some(mirror);
        self
    }

    /// Bytes `at..at + n` of the file, for the reader of its chunks (in
    /// order): a slice where one part holds them (unless mirrored), else a
    /// copy in a buffer of `pool`; an error (the reason) when they run
    /// past the file's end.
    fn chunk(&self, at: u64, n: usize, pool: &BufPool) -> Result<Raw<'a>, String> {
        if let Some(m) = self.mirror {
            return m.chunk(self, at, n, pool);
        }
        if let Some(s) = self.slice(at, n) {
            return Ok(Raw::Borrowed(s));
        }
        let mut raw = pool.get(n);
        if self.copy_to(at, &mut raw) != n {
            pool.put(raw);
            return Err(mirror::PAST_END.into());
        }
        Ok(Raw::Owned(raw))
    }

    pub(super) fn len(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The part holding byte `at` and where in it (`None` at or past the end).
    fn locate(&self, at: u64) -> Option<(usize, usize)> {
        if at >= self.len() {
            return None;
        }
        let i = self.starts.partition_point(|&s| s <= at) - 1;
        Some((i, (at - self.starts[i]) as usize))
    }

    /// Bytes `at..at + n` when one part holds them all.
    fn slice(&self, at: u64, n: usize) -> Option<&'a [u8]> {
        let (i, off) = self.locate(at)?;
        self.parts[i].get(off..off + n)
    }

    /// Copies bytes from `at` into `out` (as many as fit and exist);
    /// returns how many.
    pub(super) fn copy_to(&self, at: u64, out: &mut [u8]) -> usize {
        let mut done = 0;
        while done < out.len() {
            let Some((i, off)) = self.locate(at + done as u64) else {
                break;
            };
            let src = &self.parts[i][off..];
            let n = src.len().min(out.len() - done);
            out[done..done + n].copy_from_slice(&src[..n]);
            done += n;
        }
        done
    }
}

/// [`Parts`] read as a file (the format parsers read headers through it).
struct PartsReader<'p, 'a> {
    parts: &'p Parts<'a>,
    pos: u64,
}

impl Read for PartsReader<'_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.parts.copy_to(self.pos, buf);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for PartsReader<'_, '_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.parts.len().checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

/// Adds `extra` metrics (`--metric`) to `metrics`, over what is there;
/// a value that is not a finite number is an error naming `at`.
pub(super) fn add_metrics(
    metrics: &mut serde_json::Map<String, serde_json::Value>,
    extra: &[(String, f64)],
    at: &Path,
) -> Result<(), RepoError> {
    for (k, v) in extra {
        let v = serde_json::Number::from_f64(*v).ok_or_else(|| RepoError::BadInput {
            path: at.to_path_buf(),
            reason: format!("metric {k}={v} is not a finite number"),
        })?;
        metrics.insert(k.clone(), serde_json::Value::Number(v));
    }
    Ok(())
}

/// An opaque file this large is named in [`CommitReport::large_opaque`].
pub const LARGE_OPAQUE: u64 = 1 << 20;

/// No chunk is cut larger than this, whatever `Config::chunk_bytes` says.
pub const MAX_CHUNK_BYTES: u64 = 64 << 20;

/// A chunk ready to store: id, encoded record, delta depth.
type Encoded = (ChunkId, Vec<u8>, u16);

/// A chunk's raw bytes in the pipeline.
pub(super) enum Raw<'d> {
    /// Read from a file into a pooled buffer.
    Owned(Vec<u8>),
    /// A slice of an in-memory file ([`Source::Bytes`]): not copied.
    Borrowed(&'d [u8]),
}

impl std::ops::Deref for Raw<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Raw::Owned(v) => v,
            Raw::Borrowed(b) => b,
        }
    }
}

/// A chunk read from the checkpoint, not yet in the store.
struct Job<'d> {
    id: ChunkId,
    raw: Raw<'d>,
    /// `None` for opaque bytes (zstd).
    dtype: Option<DType>,
    /// Where the chunk lies in its tensor's rows (2-D and wider tensors).
    rows: Option<codec::Rows>,
    base: Option<BaseRef>,
}

/// Where a new chunk's delta base is: the parent's chunk `id`, and, when
/// the parent's checkpoint directory is still on disk, the file and offset
/// where its bytes should be (used only if they hash to `id`).
struct BaseRef {
    id: ChunkId,
    file: Option<(Arc<AtFile>, u64)>,
}

/// What a commit asks of a delta base before using it
/// ([`Repository::base_header`]).
struct BaseHead {
    depth: u16,
    raw_len: u64,
    base: Option<ChunkId>,
}

/// How a commit finds its new chunks' delta bases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BaseMode {
    /// The parent's chunk, decoded through its chain when not at hand.
    Parent,
    /// The parent's chunk when at hand, else the nearest chunk down its
    /// chain that is, else the chain's keyframe
    /// ([`CommitOptions::shallow_bases`]).
    Shallow,
    /// None: `max_chain` delta commits of shallow bases came since the
    /// last keyframe commit.
    Keyframe,
}

/// `Meta/commit-source`: the last commit made by `commit` in this
/// repository (32-byte id) followed by the canonical path of the directory
/// it was made from (UTF-8). The next commit on top of it reads its delta
/// bases from that directory when the bytes there still hash to the
/// parent's chunk ids, instead of decoding the parent's chains.
const COMMIT_SOURCE: &[u8] = b"commit-source";

/// The pipeline's queue length (chunks between reader and encoder, and
/// between encoder and writer) and store batch bytes for a memory budget.
/// Alive at once: the queued chunks and records, one chunk, base and frame
/// per encoding thread, one chunk per reading thread, the batch being
/// gathered and the decoded bases kept for the next commit; the store's
/// memtables come on top (see `docs/format/store.md`).
fn pipeline_sizes(budget: u64, chunk_bytes: u64, readers: usize) -> (usize, usize) {
    let threads = rayon::current_num_threads() as u64;
    let chunk = chunk_bytes.clamp(64, MAX_CHUNK_BYTES);
    let free = budget
        .saturating_sub(super::base_cache_bytes(budget))
        .saturating_sub((3 * threads + readers as u64) * chunk);
    // The reader outruns the encoders, so a short queue keeps them fed.
    let queue = (free / 8 / chunk).clamp(1, 4) as usize;
    // Unlogged batches cost little each; small ones keep the copies short.
    let batch = (free / 16).clamp(64 << 10, BATCH_BYTES as u64) as usize;
    (queue, batch)
}

/// The most bytes of encoded chunks a commit gathers in one store batch.
/// RocksDB's write batch is one string that doubles as it grows, into
/// fresh pages each time: 16 MiB batches took 15.7 K page faults for a
/// delta commit of an 11 MiB gpt-small step, 1 MiB ones 12.5 K; 11 CLI
/// commits of the corpus 1.27-1.34 s against 1.15-1.19 s (256 KiB:
/// 1.12-1.18 s), and a delta commit of a 1.42 GiB large-run step peaked at
/// 278-282 MiB RSS against 343-360 MiB, in 4.1-5.1 s against 4.8-5.0 s.
const BATCH_BYTES: usize = 1 << 20;

/// How many threads read the files of a commit: one per core, at most
/// one per file. Each parses, hashes and cuts a whole file, so a
/// checkpoint of several files (ranks, shards, model + optimizer) keeps
/// every core busy even when reading, not encoding, is the slow stage.
fn reader_threads(files: usize) -> usize {
    rayon::current_num_threads().clamp(1, files.max(1))
}

/// What the reading threads of a commit share.
struct Shared<'p> {
    /// Chunks of this commit already queued or stored.
    seen: Mutex<HashSet<ChunkId>>,
    /// The index of the next file to read.
    next: AtomicUsize,
    /// A reader failed: the others stop at their next chunk.
    failed: AtomicBool,
    /// [`CommitOptions::pause`].
    pause: Option<&'p Pause>,
}

impl Repository {
    /// Commit the checkpoint directory `dir`.
    pub fn commit(&self, dir: &Path, opts: &CommitOptions) -> Result<CommitReport, RepoError> {
        self.commit_with_progress(dir, opts, &super::NoProgress)
    }

    /// [`Repository::commit`], reporting phase `"commit"` to `progress`:
    /// the bytes of the files as they are read, and each file when done.
    pub fn commit_with_progress(
        &self,
        dir: &Path,
        opts: &CommitOptions,
        progress: &dyn super::Progress,
    ) -> Result<CommitReport, RepoError> {
        let target = self.commit_target(opts)?;
        let files = list_files(dir)?;
        let ctx = format::DirContext::read(files.iter().map(|(r, p)| (r.as_str(), p.as_path())));
        // Read once for both (a long run's file is large, and the step and
        // metrics come from the same version of it), and dropped before
        // the files are read.
        let ((step, step_source), mut metrics) = {
            let state = read_trainer_state(dir);
            let step = match opts.step {
                Some(s) => (s, StepSource::Given),
                None => detect_step_with(dir, state.as_ref())?,
            };
            (step, state.map(|t| t.metrics).unwrap_or_default())
        };
        add_metrics(&mut metrics, &opts.metrics, dir)?;
        let files: Vec<(String, Source<'_>)> = files
            .into_iter()
            .map(|(rel, path)| (rel, Source::Path(path)))
            .collect();
        self.commit_sources(
            target,
            &files,
            &ctx,
            (step, step_source),
            metrics,
            opts,
            Some(dir),
            progress,
            &|| Ok(()),
        )
    }

    /// The branch a commit goes on, whether it exists, and its parent.
    pub(super) fn commit_target(&self, opts: &CommitOptions) -> Result<CommitTarget, RepoError> {
        let branch = match &opts.branch {
            Some(b) => b.clone(),
            None => self.current_branch()?,
        };
        check_branch_name(&branch)?;
        let exists = self.branches()?.iter().any(|(b, _)| *b == branch)
            || branch == self.current_branch()?;
        let parent = match (exists, opts.new_branch) {
            (true, false) => self.branch_head(&branch)?,
            (true, true) => return Err(RepoError::BranchExists { name: branch }),
            (false, true) => self.branch_head(&self.current_branch()?)?,
            (false, false) => return Err(RepoError::NoSuchBranch { name: branch }),
        };
        Ok(CommitTarget {
            branch,
            exists,
            parent,
        })
    }

    /// The commit pipeline over `files` (sorted, checked relative paths):
    /// reads, chunks, encodes against the parent's tensors, stores, then
    /// writes the objects and moves the branch in one batch. `dir` is the
    /// checkpoint directory the files came from, recorded as
    /// `Meta/commit-source` for the next commit's delta bases (`None` for
    /// files from memory). `check` runs once all of `files` is read and
    /// stored, before anything is published; its `Err(reason)` is the
    /// commit's ([`RepoError::BadInput`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn commit_sources(
        &self,
        target: CommitTarget,
        files: &[(String, Source<'_>)],
        ctx: &format::DirContext,
        (step, step_source): (u64, StepSource),
        metrics: serde_json::Map<String, serde_json::Value>,
        opts: &CommitOptions,
        dir: Option<&Path>,
        progress: &dyn super::Progress,
        check: &(dyn Fn() -> Result<(), String> + Sync),
    ) -> Result<CommitReport, RepoError> {
        let CommitTarget {
            branch,
            exists,
            parent,
        } = target;
        let parent_tree = match &parent {
            Some(p) => Some(self.tree(&self.commit_object(p)?.tree)?),
            None => None,
        };
        let source = match &parent {
            Some(p) => self.commit_source(p)?,
            None => None,
        };
        // The parent's manifests: a tensor's delta base is the tensor of
        // the same name in the file of the same path, else in any file of
        // the parent (a checkpoint re-sharded into other files, a DCP
        // save with another world size where shards line up).
        let mut parent_files = HashMap::new();
        for (rel, mid) in parent_tree.iter().flat_map(|t| &t.entries) {
            parent_files.insert(rel.clone(), self.manifest(mid, rel)?);
        }
        let parents = ParentFiles::new(&parent_files, source);
        let base_mode = match &parent {
            Some(p) if opts.shallow_bases => {
                if self.delta_commits_since_keyframe(p)? >= self.config.max_chain {
                    BaseMode::Keyframe
                } else {
                    BaseMode::Shallow
                }
            }
            _ => BaseMode::Parent,
        };
        let budget = self.config.memory_budget;
        let readers = reader_threads(files.len());
        let (queue, batch) = pipeline_sizes(budget, self.config.chunk_bytes, readers);
        let pool = &self.pool;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job<'_>>(queue);
        let (etx, erx) = std::sync::mpsc::sync_channel::<Encoded>(queue);
        let total: u64 = files
            .iter()
            .map(|(_, src)| match src {
                Source::Path(p) => std::fs::metadata(p).map_or(0, |m| m.len()),
                Source::Bytes(b) => b.len(),
            })
            .sum();
        progress.start("commit", total, files.len() as u64);
        let shared = Shared {
            seen: Mutex::new(HashSet::new()),
            next: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            pause: opts.pause.as_deref(),
        };
        let (read, encoded, written) = std::thread::scope(|s| {
            let writer = s.spawn(|| self.write_stream(erx, batch));
            let pause = shared.pause;
            let encoder = s.spawn(move || self.encode_stream(rx, etx, base_mode, pause));
            // Files are taken in order by `readers` threads, each parsing,
            // hashing and queueing one file at a time; the manifests are put
            // back in file order below, so the tree never depends on which
            // thread read what.
            let mut handles = Vec::with_capacity(readers);
            for _ in 0..readers {
                let (tx, shared, parents) = (tx.clone(), &shared, &parents);
                handles.push(s.spawn(move || {
                    let mut w = Writer {
                        repo: self,
                        shared,
                        stats: CommitStats::default(),
                        tx: Some(tx),
                        pool,
                        handles: HashMap::new(),
                        progress,
                    };
                    let mut done = Vec::new();
                    loop {
                        if shared.failed.load(Ordering::Relaxed) {
                            break;
                        }
                        let i = shared.next.fetch_add(1, Ordering::Relaxed);
                        let Some((rel, src)) = files.get(i) else {
                            break;
                        };
                        match w.read_source(rel, src, ctx, parents) {
                            Ok(m) => done.push((i, m)),
                            Err(e) => {
                                shared.failed.store(true, Ordering::Relaxed);
                                return Err((i, e));
                            }
                        }
                    }
                    Ok((done, w.stats))
                }));
            }
            // Closing the queue (every reader's sender gone) ends the
            // encoder, then the writer, once they have stored what they got.
            drop(tx);
            let read: Vec<_> = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect();
            let encoded = encoder
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            let written = writer
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (read, encoded, written)
        });
        progress.finish();
        // A stage that stopped because the next one went away reports that
        // one's error; of the readers' errors, the first in file order that
        // is not a reader stopping for another's.
        let mut manifests = Vec::with_capacity(files.len());
        let mut stats = CommitStats::default();
        let mut failed: Option<(usize, RepoError)> = None;
        for r in read {
            match r {
                Ok((done, s)) => {
                    manifests.extend(done);
                    stats.chunks += s.chunks;
                }
                Err((i, e)) => {
                    let stop = matches!(e, RepoError::Stopped { .. });
                    let better = match &failed {
                        None => true,
                        Some((j, f)) => {
                            let f_stop = matches!(f, RepoError::Stopped { .. });
                            (f_stop && !stop) || (f_stop == stop && i < *j)
                        }
                    };
                    if better {
                        failed = Some((i, e));
                    }
                }
            }
        }
        let written = written?;
        encoded?;
        if let Some((_, e)) = failed {
            return Err(e);
        }
        check().map_err(|reason| RepoError::BadInput {
            path: dir.map_or_else(|| PathBuf::from(super::save::IN_MEMORY), Path::to_path_buf),
            reason,
        })?;
        stats.new_chunks += written.new_chunks;
        stats.stored_bytes += written.stored_bytes;
        stats.max_depth = stats.max_depth.max(written.max_depth);
        manifests.sort_by_key(|(i, _)| *i);
        let mut entries = Vec::with_capacity(manifests.len());
        let mut objects = Batch::new();
        for (id, head) in written.heads {
            objects.put(Space::Index, &chunk_head_key(&id), head);
        }
        let (mut tensor_bytes, mut large_opaque) = (0u64, Vec::new());
        for (i, manifest) in manifests {
            let rel = &files[i].0;
            let bytes = manifest.encode();
            let id = ObjectId::digest(&bytes);
            let key = object_key(KIND_MANIFEST, &id);
            if !self.store.contains(Space::Objects, &key)? {
                stats.stored_bytes += bytes.len() as u64;
                objects.put(Space::Objects, &key, bytes);
            }
            entries.push((rel.clone(), id));
            stats.files += 1;
            stats.logical_bytes += manifest.len;
            let tensors: u64 = manifest
                .segments
                .iter()
                .filter(|s| matches!(s, SegmentRef::Tensor { .. }))
                .map(|s| s.len())
                .sum();
            tensor_bytes += tensors;
            if tensors == 0 && manifest.len >= LARGE_OPAQUE {
                large_opaque.push((rel.clone(), manifest.len));
            }
        }
        // The chunk batches skipped the WAL: make them durable before the
        // batch that references them moves the branch.
        self.store.flush()?;
        let tree = Tree { entries };
        let tree_bytes = tree.encode();
        let tree_id = ObjectId::digest(&tree_bytes);
        if let Some(p) = parent.as_ref().filter(|_| exists) {
            let pc = self.commit_object(p)?;
            if pc.tree == tree_id && pc.step == step {
                return Ok(CommitReport {
                    id: *p,
                    step,
                    step_source,
                    branch,
                    stats: pc.stats,
                    already_committed: true,
                    tensor_bytes,
                    opaque_bytes: stats.logical_bytes - tensor_bytes,
                    large_opaque,
                });
            }
            if step <= pc.step && !opts.allow_step_order {
                return Err(RepoError::StepOrder {
                    branch,
                    step,
                    head_step: pc.step,
                });
            }
        }
        let key = object_key(KIND_TREE, &tree_id);
        if !self.store.contains(Space::Objects, &key)? {
            stats.stored_bytes += tree_bytes.len() as u64;
            objects.put(Space::Objects, &key, tree_bytes);
        }
        let commit = Commit {
            tree: tree_id,
            parents: parent.into_iter().collect(),
            step,
            branch: branch.clone(),
            message: opts.message.clone(),
            time: now_secs(),
            metrics,
            stats,
            provenance: super::provenance::git_provenance(
                opts.code.as_deref().unwrap_or(Path::new(".")),
            ),
        };
        let bytes = commit.encode();
        let id = CommitId::digest(&bytes);
        objects.put(
            Space::Objects,
            &object_key(KIND_COMMIT, &ObjectId::from_bytes(*id.as_bytes())),
            bytes,
        );
        // A new branch's ref must not exist yet; its first commit's parent
        // is the head it was forked from.
        self.move_ref(
            &mut objects,
            &branch_ref(&branch),
            parent.as_ref().filter(|_| exists),
            Some(&id),
            if exists {
                "commit"
            } else {
                "commit (new branch)"
            },
        );
        if let Some(dir) = dir
            .and_then(|d| std::fs::canonicalize(d).ok())
            .and_then(|d| d.to_str().map(str::to_owned))
        {
            let mut v = id.as_bytes().to_vec();
            v.extend_from_slice(dir.as_bytes());
            objects.put(Space::Meta, COMMIT_SOURCE, v);
        }
        self.store.write(objects)?;
        self.store.flush()?;
        Ok(CommitReport {
            id,
            step,
            step_source,
            branch,
            stats: commit.stats,
            already_committed: false,
            tensor_bytes,
            opaque_bytes: commit.stats.logical_bytes - tensor_bytes,
            large_opaque,
        })
    }
}

/// The record storing `raw`: zstd for opaque bytes (`dtype` `None`), else a
/// codec frame, a delta against `base` (id, raw bytes, depth) when that
/// pays, knowing the chunk's `rows` in its tensor when given. Written now.
pub(crate) fn encode_record(
    raw: &[u8],
    dtype: Option<DType>,
    rows: Option<codec::Rows>,
    base: Option<(ChunkId, &[u8], u16)>,
    zstd_level: i32,
    scratch: &mut Scratch,
) -> Result<ChunkRecord, RepoError> {
    let written = now_secs();
    let mut data = Vec::new();
    let (payload, base, depth) =
        encode_payload(raw, dtype, rows, base, zstd_level, scratch, &mut data)?;
    Ok(ChunkRecord {
        payload,
        raw_len: raw.len() as u64,
        base,
        depth,
        written,
        data,
    })
}

/// [`encode_record`]'s encoding ([`ChunkRecord::encode`]) in a buffer of
/// `pool`, and the record's depth; the payload is coded into `frame`
/// first, knowing the chunk's `rows` in its tensor when given. Nothing is
/// allocated here once the pool's buffers have grown.
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_record_into(
    raw: &[u8],
    dtype: Option<DType>,
    rows: Option<codec::Rows>,
    base: Option<(ChunkId, &[u8], u16)>,
    zstd_level: i32,
    scratch: &mut Scratch,
    frame: &mut Vec<u8>,
    pool: &BufPool,
) -> Result<(Vec<u8>, u16), RepoError> {
    let written = now_secs();
    let (payload, base, depth) =
        encode_payload(raw, dtype, rows, base, zstd_level, scratch, frame)?;
    // Of the raw chunk's size class even when the frame is smaller, so
    // the buffer serves a raw chunk next.
    let mut out = pool.take(frame.len().max(raw.len()) + 53);
    ChunkRecord::encode_parts_into(
        payload,
        raw.len() as u64,
        base.as_ref(),
        depth,
        written,
        frame,
        &mut out,
    );
    Ok((out, depth))
}

thread_local! {
    /// This thread's zstd context for opaque chunks, at the level it was
    /// made for: a fresh context per chunk allocated and cleared its
    /// tables every time (~5% of a small commit's CPU in
    /// `ZSTD_createCCtx` and its first use).
    static ZSTD: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Codes `raw` into `out` (cleared first): its payload kind, delta base
/// and depth. `rows`, the chunk's rows in its tensor, lets a whole chunk
/// be a row frame.
fn encode_payload(
    raw: &[u8],
    dtype: Option<DType>,
    rows: Option<codec::Rows>,
    base: Option<(ChunkId, &[u8], u16)>,
    zstd_level: i32,
    scratch: &mut Scratch,
    out: &mut Vec<u8>,
) -> Result<(Payload, Option<ChunkId>, u16), RepoError> {
    let Some(dtype) = dtype else {
        let zstd_err = |e: std::io::Error| RepoError::Encode {
            what: "an opaque chunk (zstd)".into(),
            reason: e.to_string(),
        };
        out.clear();
        out.reserve(zstd::zstd_safe::compress_bound(raw.len()));
        ZSTD.with_borrow_mut(|z| {
            let c = match z {
                Some((level, c)) if *level == zstd_level => c,
                _ => {
                    *z = None;
                    let c = zstd::bulk::Compressor::new(zstd_level).map_err(zstd_err)?;
                    &mut z.insert((zstd_level, c)).1
                }
            };
            c.compress_to_buffer(raw, out).map_err(zstd_err)
        })?;
        return Ok((Payload::Zstd, None, 0));
    };
    codec::encode_shaped_into(
        raw,
        base.map(|b| b.1),
        dtype,
        rows,
        &Options::default(),
        out,
        scratch,
    );
    let uses_base = codec::FrameInfo::parse(out)
        .map(|i| i.needs_base())
        .unwrap_or(false);
    Ok(match base {
        Some((b, _, d)) if uses_base => (Payload::Codec, Some(b), d + 1),
        _ => (Payload::Codec, None, 0),
    })
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A file being committed, read through the format layer.
trait ReadSeek: Read + Seek {}
impl<T: Read + Seek> ReadSeek for T {}

/// The reading stage of a commit: streams files into chunks, hashes them,
/// and queues the new ones for the encoder stage
/// ([`Repository::encode_stream`]), which runs beside it.
struct Writer<'a, 'd> {
    repo: &'a Repository,
    shared: &'a Shared<'a>,
    stats: CommitStats,
    /// The queue to the encoder (bounded); `None` once closed.
    tx: Option<SyncSender<Job<'d>>>,
    pool: &'a BufPool,
    /// The parent's files opened for delta bases, by path (`None`: absent).
    handles: HashMap<String, Option<Arc<AtFile>>>,
    progress: &'a dyn super::Progress,
}

/// What the encoder stage adds to a commit's statistics.
#[derive(Debug, Default)]
struct EncodedStats {
    new_chunks: u64,
    stored_bytes: u64,
    max_depth: u16,
    /// The heads of the chunks written (`Index` space), put by the batch
    /// that moves the ref, after the store flush that made the chunks
    /// durable: a head never outlives a crash its chunk did not.
    heads: Vec<(ChunkId, Vec<u8>)>,
}

/// The parent commit's files, where a new tensor looks for its delta base.
struct ParentFiles<'a> {
    /// By path.
    manifests: &'a HashMap<String, FileManifest>,
    /// Every tensor of the parent by name (the first file in path order
    /// that has it), with its file's path and its offset in that file.
    anywhere: HashMap<&'a str, (&'a SegmentRef, &'a str, u64)>,
    /// The directory the parent was committed from, if still there.
    source: Option<PathBuf>,
}

impl<'a> ParentFiles<'a> {
    fn new(manifests: &'a HashMap<String, FileManifest>, source: Option<PathBuf>) -> Self {
        let mut paths: Vec<&String> = manifests.keys().collect();
        paths.sort();
        let mut anywhere = HashMap::new();
        for p in paths {
            for (name, (seg, at)) in tensor_offsets(&manifests[p]) {
                anywhere.entry(name).or_insert((seg, p.as_str(), at));
            }
        }
        ParentFiles {
            manifests,
            anywhere,
            source,
        }
    }
}

/// The tensors of a manifest by name, each with its offset in the file.
fn tensor_offsets(m: &FileManifest) -> HashMap<&str, (&SegmentRef, u64)> {
    let mut off = 0u64;
    m.segments
        .iter()
        .filter_map(|s| {
            let at = off;
            off += s.len();
            match s {
                SegmentRef::Tensor { name, .. } => Some((name.as_str(), (s, at))),
                SegmentRef::Opaque { .. } => None,
            }
        })
        .collect()
}

/// What [`Writer::file`] reads a file from.
enum Input<'f, 'd> {
    File(&'f mut InFile),
    /// The whole file in memory: its chunks are handed on as slices.
    Bytes(&'f Parts<'d>),
}

impl<'d> Writer<'_, 'd> {
    /// Read the file `rel` from `src` and queue its new chunks; its manifest.
    fn read_source(
        &mut self,
        rel: &str,
        src: &Source<'d>,
        ctx: &format::DirContext,
        parents: &ParentFiles<'_>,
    ) -> Result<FileManifest, RepoError> {
        let manifest = match src {
            Source::Path(path) => {
                let io = |source| RepoError::Io {
                    path: path.clone(),
                    source,
                };
                let mut f = InFile::open(path).map_err(io)?;
                let meta = f.metadata().map_err(io)?;
                // Replaced since the listing by a FIFO or a device.
                if !meta.is_file() {
                    return Err(RepoError::BadInput {
                        path: path.clone(),
                        reason: "is a special file (device, socket or pipe)".into(),
                    });
                }
                let mode = file_mode(&meta);
                let input = Input::File(&mut f);
                self.file(input, meta.len(), mode, path, rel, ctx, parents)?
            }
            Source::Bytes(b) => self.file(
                Input::Bytes(b),
                b.len(),
                0o644,
                Path::new(rel),
                rel,
                ctx,
                parents,
            )?,
        };
        self.progress.advance(0, 1);
        Ok(manifest)
    }

    /// The parent's file `rel` in the directory it was committed from,
    /// opened once, when it is still a file of the parent's length (its
    /// bytes are checked against the chunk ids before use).
    fn parent_file(&mut self, parents: &ParentFiles<'_>, rel: &str) -> Option<Arc<AtFile>> {
        if let Some(h) = self.handles.get(rel) {
            return h.clone();
        }
        let h = match (&parents.source, parents.manifests.get(rel)) {
            (Some(dir), Some(m)) => AtFile::open(&dir.join(rel))
                .ok()
                .filter(|f| {
                    f.metadata()
                        .is_ok_and(|md| md.is_file() && md.len() == m.len)
                })
                .map(Arc::new),
            _ => None,
        };
        self.handles.insert(rel.to_string(), h.clone());
        h
    }

    /// Read one file (`len` bytes from `f`, Unix permission bits `mode`;
    /// `path` names it in errors), queue its new chunks, return its
    /// manifest.
    #[allow(clippy::too_many_arguments)]
    fn file(
        &mut self,
        input: Input<'_, 'd>,
        len: u64,
        mode: u32,
        path: &Path,
        rel: &str,
        ctx: &format::DirContext,
        parents: &ParentFiles<'_>,
    ) -> Result<FileManifest, RepoError> {
        let io = |source| RepoError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut reader;
        let (mut f, whole): (&mut dyn ReadSeek, Option<&Parts<'d>>) = match input {
            Input::File(f) => (f, None),
            Input::Bytes(b) => {
                reader = PartsReader { parts: b, pos: 0 };
                (&mut reader, Some(b))
            }
        };
        let layout = ctx
            .parse(rel, &mut f, len)
            .map_err(|source| RepoError::Format {
                path: path.to_path_buf(),
                source,
            })?;
        layout.validate().map_err(|source| RepoError::Format {
            path: path.to_path_buf(),
            source,
        })?;
        f.seek(SeekFrom::Start(0)).map_err(io)?;
        // Each tensor of the parent's file of this path, with its offset.
        let parent_tensors: HashMap<&str, (&SegmentRef, u64)> = parents
            .manifests
            .get(rel)
            .map(tensor_offsets)
            .unwrap_or_default();
        let mut hasher = blake3::Hasher::new();
        // Bytes of the file not yet cut into chunks.
        let mut file_left = len;
        let mut segments = Vec::with_capacity(layout.segments.len());
        // Remotes refuse chunks of more than 64 MiB (`remote::pack::MAX_CHUNK_RAW`).
        let chunk_bytes = self.repo.config.chunk_bytes.clamp(64, MAX_CHUNK_BYTES) as usize;
        for seg in &layout.segments {
            let (dtype, seg_len) = match seg {
                Segment::Tensor(t) => (Some(t.dtype), t.len),
                Segment::Opaque { len, .. } => (None, *len),
            };
            let piece = match dtype {
                Some(d) => (chunk_bytes / d.width() * d.width()).max(d.width()),
                None => chunk_bytes,
            };
            let found = match seg {
                Segment::Tensor(t) => parent_tensors
                    .get(t.name.as_str())
                    .map(|&(s, at)| (s, rel, at))
                    .or_else(|| parents.anywhere.get(t.name.as_str()).copied()),
                Segment::Opaque { .. } => None,
            };
            let (base_chunks, base_file): (&[ChunkId], Option<(Arc<AtFile>, u64)>) =
                match (seg, found) {
                    (
                        Segment::Tensor(t),
                        Some((
                            SegmentRef::Tensor {
                                dtype,
                                shape,
                                len,
                                chunks,
                                ..
                            },
                            in_file,
                            at,
                        )),
                    ) if *dtype == t.dtype && *shape == t.shape && *len == t.len => {
                        (chunks, self.parent_file(parents, in_file).map(|f| (f, at)))
                    }
                    _ => (&[], None),
                };
            let mut chunks = Vec::new();
            let mut left = seg_len;
            while left > 0 {
                // Another reader failed: its error is the commit's.
                if self.shared.failed.load(Ordering::Relaxed) {
                    return Err(stopped("another reader"));
                }
                if let Some(p) = self.shared.pause {
                    p.wait();
                }
                let n = left.min(piece as u64) as usize;
                let raw = match whole {
                    Some(b) => b.chunk(len - file_left, n, self.pool).map_err(|reason| {
                        RepoError::BadInput {
                            path: path.to_path_buf(),
                            reason,
                        }
                    })?,
                    None => {
                        let mut raw = self.pool.get(n);
                        f.read_exact(&mut raw).map_err(|e| RepoError::BadInput {
                            path: path.to_path_buf(),
                            reason: format!(
                                "file changed or could not be read while committing: {e}"
                            ),
                        })?;
                        Raw::Owned(raw)
                    }
                };
                file_left -= n as u64;
                hasher.update(&raw);
                self.progress.advance(n as u64, 0);
                let id = ChunkId::digest(&raw);
                chunks.push(id);
                self.stats.chunks += 1;
                left -= n as u64;
                let first = self
                    .shared
                    .seen
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id);
                if first && !self.repo.has_chunk(&id)? {
                    let k = chunks.len() - 1;
                    let base = base_chunks
                        .get(k)
                        .copied()
                        .filter(|b| *b != id)
                        .map(|b| BaseRef {
                            id: b,
                            file: base_file
                                .as_ref()
                                .map(|(f, at)| (f.clone(), at + (k * piece) as u64)),
                        });
                    let rows = match seg {
                        Segment::Tensor(t) if self.repo.config.row_frames => {
                            codec::Rows::of_chunk(&t.shape, (k * piece / t.dtype.width()) as u64)
                        }
                        _ => None,
                    };
                    let job = Job {
                        id,
                        raw,
                        dtype,
                        rows,
                        base,
                    };
                    match &self.tx {
                        Some(tx) if tx.send(job).is_ok() => {}
                        _ => return Err(stopped("encoder")),
                    }
                } else if let Raw::Owned(raw) = raw {
                    self.pool.put(raw);
                }
            }
            segments.push(match seg {
                Segment::Tensor(t) => SegmentRef::Tensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    len: t.len,
                    chunks,
                },
                Segment::Opaque { len, .. } => SegmentRef::Opaque { len: *len, chunks },
            });
        }
        // The file must not have grown behind our back either.
        let mut probe = [0u8; 1];
        if whole.is_none() && f.read(&mut probe).map_err(io)? != 0 {
            return Err(RepoError::BadInput {
                path: path.to_path_buf(),
                reason: "file grew while being committed".into(),
            });
        }
        Ok(FileManifest {
            kind: layout.kind,
            len,
            hash: *hasher.finalize().as_bytes(),
            mode,
            segments,
        })
    }
}

impl Repository {
    /// The encoder stage of a commit: encodes the new chunks as they come
    /// (rayon over the queue, the thread's scratch) against their delta
    /// bases and hands the records to the writer stage. Every chunk-sized
    /// buffer comes from and goes back to the repository's pool: the chunk
    /// (kept as the next commit's base when the cache takes it), its base,
    /// the frame and the record. Ends when the queue closes.
    fn encode_stream(
        &self,
        rx: Receiver<Job<'_>>,
        out: SyncSender<Encoded>,
        mode: BaseMode,
        pause: Option<&Pause>,
    ) -> Result<(), RepoError> {
        let level = self.config.zstd_level;
        let pool = &self.pool;
        rx.into_iter().par_bridge().try_for_each(|job| {
            if let Some(p) = pause {
                p.wait();
            }
            let mut base_raw = Vec::new();
            let base = match (job.dtype, &job.base) {
                (Some(_), Some(b)) => match self.delta_base(b, mode, job.raw.len()) {
                    Ok(Some((id, raw, depth))) => {
                        base_raw = raw;
                        Some((id, depth))
                    }
                    Ok(None) => None,
                    // A damaged base: store the chunk whole.
                    Err(e) if e.is_corruption() => None,
                    Err(e) => return Err(e),
                },
                _ => None,
            };
            let mut frame = pool.take(job.raw.len());
            let encoded = with_scratch(|scratch| {
                encode_record_into(
                    &job.raw,
                    job.dtype,
                    job.rows,
                    base.map(|(b, d)| (b, base_raw.as_slice(), d)),
                    level,
                    scratch,
                    &mut frame,
                    pool,
                )
            });
            pool.put(frame);
            pool.put(base_raw);
            let (record, depth) = encoded?;
            // The next commit's base for this chunk (in its own base's
            // place): hashed to `job.id` by the reader.
            let raw: std::borrow::Cow<'_, [u8]> = match job.raw {
                Raw::Owned(raw) => raw.into(),
                Raw::Borrowed(b) => b.into(),
            };
            self.bases
                .insert(job.id, raw, job.base.as_ref().map(|b| &b.id), pool);
            out.send((job.id, record, depth))
                .map_err(|_| stopped("writer"))
        })
    }

    /// The writer stage of a commit: gathers encoded chunks into unlogged
    /// store batches of about `batch_bytes` and writes them.
    fn write_stream(
        &self,
        rx: Receiver<Encoded>,
        batch_bytes: usize,
    ) -> Result<EncodedStats, RepoError> {
        let mut stats = EncodedStats::default();
        let mut batch = Batch::new();
        batch.unlogged();
        let mut held = 0usize;
        for (id, bytes, depth) in rx {
            stats.new_chunks += 1;
            stats.stored_bytes += bytes.len() as u64;
            stats.max_depth = stats.max_depth.max(depth);
            if let Some(head) = stored_head(&bytes).map_err(corrupt(Site::chunk(id)))? {
                stats.heads.push((id, head.to_vec()));
            }
            held += bytes.len();
            batch.put(Space::Chunks, id.as_bytes(), bytes);
            if held >= batch_bytes {
                self.write_recycled(std::mem::take(&mut batch))?;
                batch.unlogged();
                held = 0;
            }
        }
        if held > 0 {
            self.write_recycled(batch)?;
        }
        Ok(stats)
    }

    /// Writes `batch`, handing its values back to the pool.
    fn write_recycled(&self, batch: Batch) -> Result<(), RepoError> {
        let mut values = Vec::new();
        self.store.write_reclaim(batch, &mut values)?;
        for v in values {
            self.pool.put(v);
        }
        Ok(())
    }

    /// A new chunk's delta base: its id, raw bytes and stored depth, or
    /// `None` when its chain is `max_chain` deep already, its length is
    /// not `raw_len` or `mode` is [`BaseMode::Keyframe`]. The base is the
    /// parent's chunk `b`, its bytes kept from an earlier commit, else
    /// from the parent's file when they are still there and hash to its
    /// id, else ([`BaseMode::Shallow`]) [`Repository::shallow_base`], else
    /// from decoding its chain.
    fn delta_base(
        &self,
        b: &BaseRef,
        mode: BaseMode,
        raw_len: usize,
    ) -> Result<Option<(ChunkId, Vec<u8>, u16)>, RepoError> {
        if mode == BaseMode::Keyframe {
            return Ok(None);
        }
        let pool = &self.pool;
        let (h, rec) = self.base_header(&b.id)?;
        if h.depth >= self.config.max_chain || h.raw_len != raw_len as u64 {
            self.give_back(rec);
            return Ok(None);
        }
        if let Some(buf) = self.kept_copy(&b.id) {
            self.give_back(rec);
            return Ok(Some((b.id, buf, h.depth)));
        }
        if let Some((file, off)) = &b.file {
            let mut buf = pool.get(raw_len);
            if file.read_exact_at(&mut buf, *off).is_ok() && ChunkId::digest(&buf) == b.id {
                self.give_back(rec);
                return Ok(Some((b.id, buf, h.depth)));
            }
            pool.put(buf);
        }
        if let (BaseMode::Shallow, Some(below)) = (mode, h.base) {
            self.give_back(rec);
            return self.shallow_base(below, raw_len);
        }
        let rec = match rec {
            Some(rec) => rec,
            None => self.chunk_record(&b.id)?,
        };
        // The record, not the head, says how deep the bytes decoded are.
        self.decode_record(&b.id, rec, None)
            .map(|(raw, depth)| Some((b.id, raw, depth)))
    }

    /// The base [`BaseMode::Shallow`] takes for a chunk whose parent is a
    /// delta against `below`: the first chunk down `below`'s chain (walked
    /// by [`chain::base_chain`]) whose bytes are kept, else the chain's
    /// keyframe, decoded (one whole record). `None` where a chunk of the
    /// chain has another length.
    fn shallow_base(
        &self,
        below: ChunkId,
        raw_len: usize,
    ) -> Result<Option<(ChunkId, Vec<u8>, u16)>, RepoError> {
        // The base of the chunk the walk yielded last, read with its head.
        let next = std::cell::Cell::new(None);
        for id in chain::base_chain(below, |_| Ok(next.get())) {
            let id = id?;
            let (h, rec) = self.base_header(&id)?;
            if h.raw_len != raw_len as u64 {
                self.give_back(rec);
                return Ok(None);
            }
            if let Some(buf) = self.kept_copy(&id) {
                self.give_back(rec);
                return Ok(Some((id, buf, h.depth)));
            }
            if h.depth == 0 || h.base.is_none() {
                let rec = match rec {
                    Some(rec) => rec,
                    None => self.chunk_record(&id)?,
                };
                let (raw, depth) = self.decode_record(&id, rec, None)?;
                return Ok(Some((id, raw, depth)));
            }
            self.give_back(rec);
            next.set(h.base);
        }
        Ok(None)
    }

    /// A stored chunk's depth, raw length and base: from its head when it
    /// has one, else from its record, returned too so that it is read
    /// once and decoded only when its bytes are needed.
    fn base_header(&self, id: &ChunkId) -> Result<(BaseHead, Option<ChunkRecord>), RepoError> {
        Ok(match self.chunk_head(id)? {
            Some(h) => (
                BaseHead {
                    depth: h.depth,
                    raw_len: h.raw_len,
                    base: h.base,
                },
                None,
            ),
            None => {
                let rec = self.chunk_record(id)?;
                let h = BaseHead {
                    depth: rec.depth,
                    raw_len: rec.raw_len,
                    base: rec.base,
                };
                (h, Some(rec))
            }
        })
    }

    /// A record's payload buffer back to the pool.
    fn give_back(&self, rec: Option<ChunkRecord>) {
        if let Some(rec) = rec {
            self.pool.put(rec.data);
        }
    }

    /// The kept bytes of chunk `id`, copied into a pool buffer.
    fn kept_copy(&self, id: &ChunkId) -> Option<Vec<u8>> {
        let raw = self.bases.get(id)?;
        let mut buf = self.pool.take(raw.len());
        buf.extend_from_slice(&raw);
        Some(buf)
    }

    /// Delta commits from `parent` back to the last keyframe commit (one
    /// whose new chunks are all whole), up to `max_chain`; commits that
    /// stored nothing new do not count, and a history with no keyframe
    /// within `max_chain` + 64 commits counts as `max_chain`.
    fn delta_commits_since_keyframe(&self, parent: &CommitId) -> Result<u16, RepoError> {
        let max_chain = self.config.max_chain;
        let mut age = 0;
        let mut next = Some(*parent);
        for _ in 0..usize::from(max_chain) + 64 {
            let Some(id) = next else { return Ok(age) };
            if age >= max_chain {
                return Ok(max_chain);
            }
            let c = self.commit_object(&id)?;
            if c.stats.new_chunks > 0 {
                if c.stats.max_depth == 0 {
                    return Ok(age);
                }
                age += 1;
            }
            next = c.parents.first().copied();
        }
        Ok(max_chain)
    }

    /// The directory the commit `parent` was made from, if this repository
    /// recorded it (`Meta/commit-source`) and it is still a directory.
    fn commit_source(&self, parent: &CommitId) -> Result<Option<PathBuf>, RepoError> {
        let Some(v) = self.store.get_vec(Space::Meta, COMMIT_SOURCE)? else {
            return Ok(None);
        };
        if v.len() <= 32 || v[..32] != parent.as_bytes()[..] {
            return Ok(None);
        }
        Ok(std::str::from_utf8(&v[32..])
            .ok()
            .map(PathBuf::from)
            .filter(|p| p.is_dir()))
    }
}

/// The error a pipeline stage reports when the next stage went away (its
/// own error is the one the commit returns).
fn stopped(stage: &'static str) -> RepoError {
    RepoError::Stopped { stage }
}

#[cfg(unix)]
fn file_mode(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    // Permission bits only, as git keeps them: a setuid, setgid or sticky
    // bit is never stored, so a checkout never creates one.
    meta.permissions().mode() & 0o777
}

#[cfg(not(unix))]
fn file_mode(meta: &std::fs::Metadata) -> u32 {
    if meta.permissions().readonly() {
        0o444
    } else {
        0o644
    }
}

/// Every regular file under `dir`, as (relative `/` path, full path), sorted.
/// Symlinks and special files are errors: a checkpoint holds plain files.
fn list_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, RepoError> {
    let meta = std::fs::metadata(dir).map_err(|source| {
        RepoError::io_or_bad_input(
            source,
            dir,
            std::io::ErrorKind::NotFound,
            dir,
            "no such directory",
        )
    })?;
    if !meta.is_dir() {
        return Err(RepoError::BadInput {
            path: dir.to_path_buf(),
            reason: "not a directory".into(),
        });
    }
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), dir.to_path_buf())];
    while let Some((prefix, d)) = stack.pop() {
        let rd = std::fs::read_dir(&d).map_err(|source| RepoError::Io {
            path: d.clone(),
            source,
        })?;
        for e in rd {
            let e = e.map_err(|source| RepoError::Io {
                path: d.clone(),
                source,
            })?;
            let path = e.path();
            let name = e
                .file_name()
                .into_string()
                .map_err(|_| RepoError::BadInput {
                    path: path.clone(),
                    reason: "file name is not UTF-8".into(),
                })?;
            if name == super::DOT_DIR {
                return Err(RepoError::BadInput {
                    path,
                    reason: format!(
                        "is a ckvc repository's data directory ({}); commit the checkpoint \
                         directory, not a directory holding a repository",
                        super::DOT_DIR
                    ),
                });
            }
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            check_path(&rel).map_err(|e| RepoError::BadInput {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            let ft = e.file_type().map_err(|source| RepoError::Io {
                path: path.clone(),
                source,
            })?;
            if ft.is_symlink() {
                return Err(RepoError::BadInput {
                    path,
                    reason: "is a symbolic link; ckvc stores regular files only".into(),
                });
            } else if ft.is_dir() {
                stack.push((rel, path));
            } else if ft.is_file() {
                out.push((rel, path));
            } else {
                return Err(RepoError::BadInput {
                    path,
                    reason: "is a special file (device, socket or pipe)".into(),
                });
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `dir/trainer_state.json`, streamed in bounded memory.
fn read_trainer_state(dir: &Path) -> Option<format::TrainerState> {
    format::TrainerState::read(&dir.join("trainer_state.json"))
}

/// `trainer_state.json`'s `global_step`, else the directory name's number.
fn detect_step(dir: &Path) -> Result<(u64, StepSource), RepoError> {
    detect_step_with(dir, read_trainer_state(dir).as_ref())
}

/// [`detect_step`] with `dir`'s `trainer_state.json` read already.
fn detect_step_with(
    dir: &Path,
    state: Option<&format::TrainerState>,
) -> Result<(u64, StepSource), RepoError> {
    if let Some(s) = state.and_then(|t| t.global_step) {
        return Ok((s, StepSource::TrainerState));
    }
    let name = std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let source = if is_accelerate_save(dir, &name) {
        StepSource::AccelerateSaveIndex
    } else {
        StepSource::DirName
    };
    format::step_of_dir_name(&name)
        .map(|s| (s, source))
        .ok_or(RepoError::NoStep {
            dir: dir.to_path_buf(),
        })
}

/// Whether `dir` (named `name`) is accelerate's `save_state` output:
/// named `checkpoint_<N>` and holding `random_states_<rank>.pkl`.
fn is_accelerate_save(dir: &Path, name: &str) -> bool {
    let numbered = name
        .strip_prefix("checkpoint_")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    numbered
        && std::fs::read_dir(dir).is_ok_and(|rd| {
            rd.flatten().any(|e| {
                let f = e.file_name();
                let f = f.to_string_lossy();
                f.starts_with("random_states_") && f.ends_with(".pkl")
            })
        })
}

impl Repository {
    /// Commit every checkpoint directory of `run_dir` (its subdirectories
    /// whose step is known: `trainer_state.json`, or a number ending the
    /// name), in step order, skipping steps the branch already has.
    /// `opts.step` must be `None`; its other fields apply to every commit.
    /// `each` sees every item as it is done.
    pub fn commit_run(
        &self,
        run_dir: &Path,
        opts: &CommitOptions,
        mut each: impl FnMut(&RunItem),
    ) -> Result<Vec<RunItem>, RepoError> {
        let io = |source| RepoError::Io {
            path: run_dir.to_path_buf(),
            source,
        };
        let mut dirs = Vec::new();
        for e in std::fs::read_dir(run_dir).map_err(io)? {
            let e = e.map_err(io)?;
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !e.file_type().map_err(io)?.is_dir() {
                continue;
            }
            if let Ok((step, _)) = detect_step(&e.path()) {
                dirs.push((step, e.path()));
            }
        }
        if dirs.is_empty() {
            return Err(RepoError::BadInput {
                path: run_dir.to_path_buf(),
                reason: "no checkpoint directories (checkpoint-N/, step-N/, ...) in it".into(),
            });
        }
        dirs.sort();
        let branch = match &opts.branch {
            Some(b) => b.clone(),
            None => self.current_branch()?,
        };
        let mut have = std::collections::HashSet::new();
        if self.branch_head(&branch)?.is_some() {
            for e in self.log(Some(&branch), None)? {
                have.insert(e.commit.step);
            }
        }
        let mut items = Vec::new();
        let mut opts = opts.clone();
        opts.step = None;
        for (step, dir) in dirs {
            let item = if have.contains(&step) {
                RunItem::Skipped { dir, step }
            } else {
                let report = self.commit(&dir, &opts)?;
                // Later commits go on the branch the first one created.
                opts.new_branch = false;
                opts.branch = Some(report.branch.clone());
                have.insert(step);
                RunItem::Committed { dir, report }
            };
            each(&item);
            items.push(item);
        }
        Ok(items)
    }
}
