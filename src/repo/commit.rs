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
use std::time::{SystemTime, UNIX_EPOCH};

use rayon::prelude::*;

use crate::codec::{self, DType, Options, Scratch};
use crate::format::{self, Segment};
use crate::store::{Batch, ChunkId, CommitId, ObjectId, Space};

use super::objects::{
    check_path, object_key, ChunkRecord, Commit, CommitStats, FileManifest, Payload, SegmentRef,
    Tree, KIND_COMMIT, KIND_MANIFEST, KIND_TREE,
};
use super::{branch_ref, check_branch_name, RepoError, Repository};

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
}

impl StepSource {
    pub fn describe(self) -> &'static str {
        match self {
            StepSource::Given => "given",
            StepSource::TrainerState => "from trainer_state.json",
            StepSource::DirName => "from the directory name",
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

/// An opaque file this large is named in [`CommitReport::large_opaque`].
pub const LARGE_OPAQUE: u64 = 1 << 20;

/// No chunk is cut larger than this, whatever `Config::chunk_bytes` says.
pub const MAX_CHUNK_BYTES: u64 = 64 << 20;

/// Raw bytes of chunks waiting to be encoded, flushed at this size.
const PENDING_BYTES: usize = 64 << 20;

/// A chunk ready to store: id, encoded record, delta depth.
type Encoded = (ChunkId, Vec<u8>, u16);

/// A chunk read from the checkpoint, not yet in the store.
struct Job {
    id: ChunkId,
    raw: Vec<u8>,
    /// `None` for opaque bytes (zstd).
    dtype: Option<DType>,
    base: Option<ChunkId>,
}

impl Repository {
    /// Commit the checkpoint directory `dir`.
    pub fn commit(&self, dir: &Path, opts: &CommitOptions) -> Result<CommitReport, RepoError> {
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
        let parent_tree = match &parent {
            Some(p) => Some(self.tree(&self.commit_object(p)?.tree)?),
            None => None,
        };
        let files = list_files(dir)?;
        let ctx = format::DirContext::read(files.iter().map(|(r, p)| (r.as_str(), p.as_path())));
        let (step, step_source) = match opts.step {
            Some(s) => (s, StepSource::Given),
            None => detect_step(dir)?,
        };
        let mut metrics = trainer_metrics(dir);
        for (k, v) in &opts.metrics {
            let v = serde_json::Number::from_f64(*v).ok_or_else(|| RepoError::BadInput {
                path: dir.to_path_buf(),
                reason: format!("metric {k}={v} is not a finite number"),
            })?;
            metrics.insert(k.clone(), serde_json::Value::Number(v));
        }

        let mut w = Writer {
            repo: self,
            pending: Vec::new(),
            pending_bytes: 0,
            seen: HashSet::new(),
            stats: CommitStats::default(),
        };
        // The parent's manifests: a tensor's delta base is the tensor of
        // the same name in the file of the same path, else in any file of
        // the parent (a checkpoint re-sharded into other files, a DCP
        // save with another world size where shards line up).
        let mut parent_files = HashMap::new();
        for (rel, mid) in parent_tree.iter().flat_map(|t| &t.entries) {
            parent_files.insert(rel.clone(), self.manifest(mid, rel)?);
        }
        let mut anywhere: HashMap<&str, &SegmentRef> = HashMap::new();
        for m in parent_files.values() {
            for seg in &m.segments {
                if let SegmentRef::Tensor { name, .. } = seg {
                    anywhere.entry(name.as_str()).or_insert(seg);
                }
            }
        }
        let mut entries = Vec::new();
        let mut objects = Batch::new();
        let (mut tensor_bytes, mut large_opaque) = (0u64, Vec::new());
        for (rel, path) in &files {
            let manifest = w.file(path, rel, &ctx, parent_files.get(rel), &anywhere)?;
            let bytes = manifest.encode();
            let id = ObjectId::digest(&bytes);
            let key = object_key(KIND_MANIFEST, &id);
            if !self.store.contains(Space::Objects, &key)? {
                w.stats.stored_bytes += bytes.len() as u64;
                objects.put(Space::Objects, &key, bytes);
            }
            entries.push((rel.clone(), id));
            w.stats.files += 1;
            w.stats.logical_bytes += manifest.len;
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
        w.flush()?;
        // The chunk batches skipped the WAL: make them durable before the
        // batch that references them moves the branch.
        self.store.flush()?;
        let tree = Tree { entries };
        let tree_bytes = tree.encode();
        let tree_id = ObjectId::digest(&tree_bytes);
        let mut stats = w.stats;
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
                    opaque_bytes: w.stats.logical_bytes - tensor_bytes,
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
/// pays. Written now.
pub(crate) fn encode_record(
    raw: &[u8],
    dtype: Option<DType>,
    base: Option<(ChunkId, &[u8], u16)>,
    zstd_level: i32,
    scratch: &mut Scratch,
) -> Result<ChunkRecord, RepoError> {
    let written = now_secs();
    let Some(dtype) = dtype else {
        return Ok(ChunkRecord {
            payload: Payload::Zstd,
            raw_len: raw.len() as u64,
            base: None,
            depth: 0,
            written,
            data: zstd::bulk::compress(raw, zstd_level).map_err(|e| RepoError::Corrupt {
                what: "zstd".into(),
                reason: e.to_string(),
            })?,
        });
    };
    let mut frame = Vec::new();
    codec::encode_into(
        raw,
        base.map(|b| b.1),
        dtype,
        &Options::default(),
        &mut frame,
        scratch,
    );
    let uses_base = codec::FrameInfo::parse(&frame)
        .map(|i| i.needs_base())
        .unwrap_or(false);
    let (base, depth) = match base {
        Some((b, _, d)) if uses_base => (Some(b), d + 1),
        _ => (None, 0),
    };
    Ok(ChunkRecord {
        payload: Payload::Codec,
        raw_len: raw.len() as u64,
        base,
        depth,
        written,
        data: frame,
    })
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Streams files into chunks and chunks into the store.
struct Writer<'a> {
    repo: &'a Repository,
    pending: Vec<Job>,
    pending_bytes: usize,
    /// Chunks of this commit already queued or stored.
    seen: HashSet<ChunkId>,
    stats: CommitStats,
}

impl Writer<'_> {
    /// Read one file, queue its new chunks, return its manifest.
    fn file(
        &mut self,
        path: &Path,
        rel: &str,
        ctx: &format::DirContext,
        parent: Option<&FileManifest>,
        anywhere: &HashMap<&str, &SegmentRef>,
    ) -> Result<FileManifest, RepoError> {
        let io = |source| RepoError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let meta = f.metadata().map_err(io)?;
        let len = meta.len();
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
        let parent_tensors: HashMap<&str, &SegmentRef> = parent
            .map(|m| {
                m.segments
                    .iter()
                    .filter_map(|s| match s {
                        SegmentRef::Tensor { name, .. } => Some((name.as_str(), s)),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut hasher = blake3::Hasher::new();
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
            let base_chunks: &[ChunkId] = match seg {
                Segment::Tensor(t) => match parent_tensors
                    .get(t.name.as_str())
                    .or_else(|| anywhere.get(t.name.as_str()))
                {
                    Some(SegmentRef::Tensor {
                        dtype,
                        shape,
                        len,
                        chunks,
                        ..
                    }) if *dtype == t.dtype && *shape == t.shape && *len == t.len => chunks,
                    _ => &[],
                },
                Segment::Opaque { .. } => &[],
            };
            let mut chunks = Vec::new();
            let mut left = seg_len;
            while left > 0 {
                let n = left.min(piece as u64) as usize;
                let mut raw = vec![0u8; n];
                f.read_exact(&mut raw).map_err(|e| RepoError::BadInput {
                    path: path.to_path_buf(),
                    reason: format!("file changed or could not be read while committing: {e}"),
                })?;
                hasher.update(&raw);
                let id = ChunkId::digest(&raw);
                chunks.push(id);
                self.stats.chunks += 1;
                left -= n as u64;
                if self.seen.insert(id)
                    && !self.repo.store.contains(Space::Chunks, id.as_bytes())?
                {
                    let base = base_chunks
                        .get(chunks.len() - 1)
                        .copied()
                        .filter(|b| *b != id);
                    self.pending_bytes += n;
                    self.pending.push(Job {
                        id,
                        raw,
                        dtype,
                        base,
                    });
                    if self.pending_bytes >= PENDING_BYTES {
                        self.flush()?;
                    }
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
        if f.read(&mut probe).map_err(io)? != 0 {
            return Err(RepoError::BadInput {
                path: path.to_path_buf(),
                reason: "file grew while being committed".into(),
            });
        }
        Ok(FileManifest {
            kind: layout.kind,
            len,
            hash: *hasher.finalize().as_bytes(),
            mode: file_mode(&meta),
            segments,
        })
    }

    /// Encode the queued chunks in parallel and write them in one batch.
    fn flush(&mut self) -> Result<(), RepoError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let repo = self.repo;
        let max_chain = repo.config.max_chain;
        let level = repo.config.zstd_level;
        let jobs = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        let records: Vec<Result<Encoded, RepoError>> = jobs
            .into_par_iter()
            .map_init(Scratch::default, |scratch, job| {
                // The base must be readable and its chain short enough.
                let base = match (job.dtype, job.base) {
                    (Some(_), Some(b)) => match repo.read_base(&b, max_chain, job.raw.len()) {
                        Ok(base) => base.map(|(raw, depth)| (b, raw, depth)),
                        Err(e) if e.is_corruption() => None,
                        Err(e) => return Err(e),
                    },
                    _ => None,
                };
                let rec = encode_record(
                    &job.raw,
                    job.dtype,
                    base.as_ref().map(|(b, raw, d)| (*b, raw.as_slice(), *d)),
                    level,
                    scratch,
                )?;
                Ok((job.id, rec.encode(), rec.depth))
            })
            .collect();
        let mut batch = Batch::new();
        batch.unlogged();
        for r in records {
            let (id, bytes, depth) = r?;
            self.stats.new_chunks += 1;
            self.stats.stored_bytes += bytes.len() as u64;
            self.stats.max_depth = self.stats.max_depth.max(depth);
            batch.put(Space::Chunks, id.as_bytes(), bytes);
        }
        repo.store.write(batch)?;
        Ok(())
    }
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
    let meta = std::fs::metadata(dir).map_err(|source| RepoError::Io {
        path: dir.to_path_buf(),
        source,
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
            check_path(&rel).map_err(|reason| RepoError::BadInput {
                path: path.clone(),
                reason,
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

fn read_trainer_state(dir: &Path) -> Option<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(dir.join("trainer_state.json")).ok()?;
    match serde_json::from_str(&text).ok()? {
        serde_json::Value::Object(m) => Some(m),
        _ => None,
    }
}

/// `trainer_state.json`'s `global_step`, else the directory name's number.
fn detect_step(dir: &Path) -> Result<(u64, StepSource), RepoError> {
    if let Some(s) =
        read_trainer_state(dir).and_then(|m| m.get("global_step").and_then(|v| v.as_u64()))
    {
        return Ok((s, StepSource::TrainerState));
    }
    let name = std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    format::step_of_dir_name(&name)
        .map(|s| (s, StepSource::DirName))
        .ok_or(RepoError::NoStep {
            dir: dir.to_path_buf(),
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

/// Whether a `trainer_state.json` / `log_history` key is a metric worth
/// keeping with the commit (for `log` and `gc --keep best=`).
fn is_metric(k: &str) -> bool {
    matches!(
        k,
        "loss" | "train_loss" | "learning_rate" | "grad_norm" | "epoch" | "global_step"
    ) || k.starts_with("eval_")
}

/// The metrics of the checkpoint's own step from `trainer_state.json`: the
/// numeric metric keys at its top level, then, for each metric key, its
/// value in the last `log_history` entry at or before `global_step` (where
/// HF Trainer keeps `loss` and `eval_*`).
pub(crate) fn trainer_metrics(dir: &Path) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    let Some(m) = read_trainer_state(dir) else {
        return out;
    };
    for (k, v) in &m {
        if is_metric(k) && v.is_number() {
            out.insert(k.clone(), v.clone());
        }
    }
    let upto = m
        .get("global_step")
        .and_then(|v| v.as_u64())
        .unwrap_or(u64::MAX);
    if let Some(history) = m.get("log_history").and_then(|h| h.as_array()) {
        for entry in history.iter().filter_map(|e| e.as_object()) {
            if entry
                .get("step")
                .and_then(|s| s.as_u64())
                .is_some_and(|s| s > upto)
            {
                continue;
            }
            for (k, v) in entry {
                if is_metric(k) && v.is_number() && k != "global_step" {
                    out.insert(k.clone(), v.clone());
                }
            }
        }
    }
    out
}
