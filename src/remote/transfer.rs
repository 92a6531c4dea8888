//! The verbs that move commits: `push`, `fetch`, `pull`, `clone`.
//!
//! Push: walk what the branch needs ([`Repository::reachable`]), subtract
//! what the remote's pack indexes list, write the rest as packs (each pack,
//! then its index), and only then move the remote ref with compare-and-swap.
//! A push killed midway leaves complete packs (with an index) that the next
//! run skips, perhaps one pack without an index that it rewrites, and the
//! remote ref untouched.
//!
//! Fetch: read the remote refs, walk from them through objects the local
//! store lacks, downloading the packs that hold them into `.ckvc/fetch/`
//! (kept across an interrupted fetch; each verified against its name before
//! use), verify every chunk by decoding it through its delta chain to its
//! blake3 id, write the chunks, then the objects and the remote-tracking
//! refs in one atomic batch. Pull is a fetch, then a fast-forward of the
//! local branch; clone is init + remote add + fetch + branch.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::codec;
use crate::repo::objects::{
    object_key, ChunkRecord, Commit, FileManifest, Payload, SegmentRef, Tree, KIND_COMMIT,
    KIND_MANIFEST, KIND_TREE,
};
use crate::repo::{
    branch_ref, check_branch_name, encode_record, now_secs, Config, RepoError, Repository,
    WalkOptions, DOT_DIR, HARD_MAX_CHAIN, SHALLOW,
};
use crate::store::{Batch, ChunkId, CommitId, Hash32, ObjectId, Space};

use super::config::{add_remote, tracking_ref};
use super::pack::{self, Kind, PackWriter};
use super::{open_url, Progress, Remote, RemoteError, S3Options};

/// The layout marker file at a remote's root, and its version.
pub const LAYOUT_KEY: &str = "ckvc-remote";
pub const LAYOUT_VERSION: u32 = 1;
const PACKS: &str = "packs/";
const HEADS: &str = "refs/heads/";
/// A ref file is 65 bytes; nothing longer is read.
const REF_BYTES: u64 = 256;
/// Chunk records are written to the local store in batches of about this
/// many bytes.
const BATCH_BYTES: usize = 64 << 20;

fn corrupt(what: impl Into<String>, reason: impl Into<String>) -> RemoteError {
    RemoteError::Corrupt {
        what: what.into(),
        reason: reason.into(),
    }
}

/// Check the remote's layout marker; with `create`, write it when absent.
pub(crate) fn check_layout(remote: &dyn Remote, create: bool) -> Result<(), RemoteError> {
    let marker = format!("ckvc-remote {LAYOUT_VERSION}\n");
    match remote.get_limited(LAYOUT_KEY, 64)? {
        None if create => match remote.put_if(LAYOUT_KEY, marker.into_bytes(), None) {
            Ok(()) | Err(RemoteError::Conflict { .. }) => check_layout(remote, false),
            Err(e) => Err(e),
        },
        None => Err(RemoteError::NotARemote {
            url: remote.url(),
            reason: format!("no {LAYOUT_KEY} file: nothing was ever pushed there"),
        }),
        Some(b) => {
            let s = String::from_utf8_lossy(&b);
            let v = s.trim_end().strip_prefix("ckvc-remote ").ok_or_else(|| {
                RemoteError::NotARemote {
                    url: remote.url(),
                    reason: format!(
                        "{LAYOUT_KEY} holds {:?}",
                        s.chars().take(40).collect::<String>()
                    ),
                }
            })?;
            match v.parse::<u32>() {
                Ok(LAYOUT_VERSION) => Ok(()),
                _ => Err(RemoteError::VersionTooNew {
                    url: remote.url(),
                    found: v.chars().take(20).collect(),
                    supported: LAYOUT_VERSION,
                }),
            }
        }
    }
}

/// A ref file: 64 lowercase hex digits and a newline.
fn parse_ref(bytes: &[u8], key: &str) -> Result<CommitId, RemoteError> {
    let s = std::str::from_utf8(bytes).map_err(|_| corrupt(key, "not UTF-8"))?;
    s.strip_suffix('\n')
        .unwrap_or(s)
        .parse::<CommitId>()
        .map_err(|_| corrupt(key, "does not hold a 64-digit commit id"))
}

fn ref_file(id: &CommitId) -> Vec<u8> {
    format!("{id}\n").into_bytes()
}

/// The remote's branches: name -> commit.
pub(crate) fn remote_heads(remote: &dyn Remote) -> Result<BTreeMap<String, CommitId>, RemoteError> {
    let mut out = BTreeMap::new();
    for key in remote.list(HEADS)? {
        let branch = &key[HEADS.len()..];
        check_branch_name(branch).map_err(|_| RemoteError::BadPath {
            key: key.clone(),
            reason: "not a valid branch name".into(),
        })?;
        if let Some(b) = remote.get_limited(&key, REF_BYTES)? {
            out.insert(branch.to_string(), parse_ref(&b, &key)?);
        }
    }
    Ok(out)
}

/// Where each object on the remote is: the union of the pack indexes.
#[derive(Default)]
pub(crate) struct RemoteIndex {
    pub(crate) entries: HashMap<(Kind, [u8; 32]), Hash32>,
    pub(crate) packs: HashMap<Hash32, u64>,
}

impl RemoteIndex {
    fn has(&self, kind: Kind, id: &[u8; 32]) -> bool {
        self.entries.contains_key(&(kind, *id))
    }
}

pub(crate) fn load_index(remote: &dyn Remote) -> Result<RemoteIndex, RemoteError> {
    let mut ix = RemoteIndex::default();
    for key in remote.list(PACKS)? {
        let Some(stem) = key[PACKS.len()..].strip_suffix(".idx") else {
            continue;
        };
        let name: Hash32 = stem.parse().map_err(|_| RemoteError::BadPath {
            key: key.clone(),
            reason: "a pack index must be named by 64 hex digits".into(),
        })?;
        let Some(bytes) = remote.get_limited(&key, pack::MAX_INDEX_BYTES)? else {
            continue; // removed meanwhile
        };
        let idx = pack::decode_index(&bytes, &format!("pack index {key}"))?;
        if idx.pack != name {
            return Err(corrupt(
                format!("pack index {key}"),
                "describes a different pack than its name says",
            ));
        }
        if idx.pack_len > pack::MAX_PACK_BYTES {
            return Err(corrupt(
                format!("pack index {key}"),
                format!("pack of {} bytes is larger than the limit", idx.pack_len),
            ));
        }
        for e in &idx.entries {
            ix.entries.insert((e.kind, e.id), name);
        }
        ix.packs.insert(name, idx.pack_len);
    }
    Ok(ix)
}

pub(crate) fn pack_key(name: &Hash32) -> String {
    format!("{PACKS}{name}.pack")
}

pub(crate) fn idx_key(name: &Hash32) -> String {
    format!("{PACKS}{name}.idx")
}

/// Whether `a` is `b` or an ancestor of `b` (walking every parent, stopping
/// at a shallow clone's boundary).
pub fn is_ancestor(repo: &Repository, a: &CommitId, b: &CommitId) -> Result<bool, RemoteError> {
    let shallow = repo.shallow()?;
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([*b]);
    while let Some(c) = queue.pop_front() {
        if c == *a {
            return Ok(true);
        }
        if !seen.insert(c) || shallow.contains(&c) {
            continue;
        }
        queue.extend(repo.commit_object(&c)?.parents);
    }
    Ok(false)
}

// ---------------------------------------------------------------- push

/// How to push.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// The branch (default: the current one).
    pub branch: Option<String>,
    /// Move the remote ref even if that drops commits from it.
    pub force: bool,
    /// A pack is closed once it holds this many bytes.
    pub pack_bytes: usize,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            branch: None,
            force: false,
            // Measured: 64 MiB packs keep a push of the corpus to a few
            // PUTs while bounding memory (one pack is built at a time).
            pack_bytes: 64 << 20,
        }
    }
}

/// What a push did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PushReport {
    pub branch: String,
    /// The remote ref before (`None`: created).
    pub old: Option<CommitId>,
    pub new: CommitId,
    pub up_to_date: bool,
    pub forced: bool,
    /// Commits the remote did not have.
    pub commits: u64,
    /// Their checkpoints' size (what `cp -r` would copy).
    pub logical_bytes: u64,
    /// Objects (chunks, manifests, trees, commits) sent, and already there.
    pub objects_sent: u64,
    pub objects_present: u64,
    pub packs_sent: u64,
    /// Bytes of packs and indexes uploaded.
    pub bytes_sent: u64,
}

/// Push a branch to `remote` (named `remote_name` locally, for its
/// tracking ref).
pub fn push(
    repo: &Repository,
    remote_name: &str,
    remote: &dyn Remote,
    opts: &PushOptions,
    progress: &dyn Progress,
) -> Result<PushReport, RemoteError> {
    let branch = match &opts.branch {
        Some(b) => b.clone(),
        None => repo.current_branch()?,
    };
    check_branch_name(&branch)?;
    let head = repo
        .branch_head(&branch)?
        .ok_or_else(|| RepoError::NoSuchBranch {
            name: branch.clone(),
        })?;
    check_layout(remote, true)?;
    // Temporary files of pushes killed more than an hour ago (a push in
    // progress writes fresh ones); failing to remove them fails nothing.
    let _ = remote.clean_stale(std::time::Duration::from_secs(3600));
    let key = format!("{HEADS}{branch}");
    let old = match remote.get_versioned(&key)? {
        Some((b, v)) => Some((parse_ref(&b, &key)?, v)),
        None => None,
    };
    let mut report = PushReport {
        branch: branch.clone(),
        old: old.as_ref().map(|o| o.0),
        new: head,
        ..Default::default()
    };
    if old.as_ref().is_some_and(|o| o.0 == head) {
        report.up_to_date = true;
        set_tracking(repo, remote_name, &branch, &head, "push")?;
        return Ok(report);
    }
    if let Some((o, _)) = &old {
        let ff = repo.has_commit(o)? && is_ancestor(repo, o, &head)?;
        if !ff {
            if !opts.force {
                return Err(RemoteError::NonFastForward {
                    branch,
                    remote: o.short(12),
                    local: head.short(12),
                });
            }
            report.forced = true;
        }
    }

    let ix = load_index(remote)?;
    let reach = repo.reachable(
        &[head],
        WalkOptions {
            chunk_headers: true,
            frame_headers: false,
            depth: None,
        },
    )?;
    if let Some(e) = reach.damage.first() {
        return Err(RemoteError::Refused {
            reason: format!("refusing to push a damaged history ({e}); run `ckvc fsck`"),
        });
    }
    // A shallow clone can push only on top of history the remote has.
    for s in repo.shallow()? {
        if reach.commits.contains(&s) {
            for p in repo.commit_object(&s)?.parents {
                if !ix.has(Kind::Commit, p.as_bytes()) {
                    return Err(RemoteError::Refused {
                        reason: format!(
                            "this shallow clone lacks the history before commit {}, and the remote does not have it either; push from a full clone",
                            s.short(12)
                        ),
                    });
                }
            }
        }
    }

    // What to send: chunks first, then manifests, trees, commits (parents
    // first), so a pack never holds an object whose content it precedes.
    let mut todo: Vec<(Kind, [u8; 32])> = Vec::new();
    let mut chunk_ids: Vec<ChunkId> = reach.all_chunks().copied().collect();
    chunk_ids.sort();
    for c in chunk_ids {
        todo.push((Kind::Chunk, *c.as_bytes()));
    }
    let mut manifests: Vec<ObjectId> = reach.manifests.keys().copied().collect();
    manifests.sort();
    todo.extend(manifests.iter().map(|m| (Kind::Manifest, *m.as_bytes())));
    let mut trees: Vec<ObjectId> = reach.trees.iter().copied().collect();
    trees.sort();
    todo.extend(trees.iter().map(|t| (Kind::Tree, *t.as_bytes())));
    todo.extend(reach.commits.iter().map(|c| (Kind::Commit, *c.as_bytes())));
    let total = todo.len() as u64;
    todo.retain(|(k, id)| !ix.has(*k, id));
    report.objects_present = total - todo.len() as u64;
    for (k, id) in &todo {
        if *k == Kind::Commit {
            report.commits += 1;
            let c = repo.commit_object(&CommitId::from_bytes(*id))?;
            report.logical_bytes = report.logical_bytes.saturating_add(c.stats.logical_bytes);
        }
    }

    progress.start("upload", 0, todo.len() as u64);
    let mut w = PackWriter::new();
    let mut buf = Vec::new();
    for (kind, id) in &todo {
        let (space, key) = match kind {
            Kind::Chunk => (Space::Chunks, id.to_vec()),
            Kind::Manifest => (
                Space::Objects,
                object_key(KIND_MANIFEST, &ObjectId::from_bytes(*id)).to_vec(),
            ),
            Kind::Tree => (
                Space::Objects,
                object_key(KIND_TREE, &ObjectId::from_bytes(*id)).to_vec(),
            ),
            Kind::Commit => (
                Space::Objects,
                object_key(KIND_COMMIT, &ObjectId::from_bytes(*id)).to_vec(),
            ),
        };
        if !repo
            .store()
            .get(space, &key, &mut buf)
            .map_err(RepoError::from)?
        {
            return Err(RepoError::Missing {
                what: format!("{} {}", kind.name(), crate::store::to_hex(&id[..6])),
            }
            .into());
        }
        w.add(*kind, *id, &buf);
        if w.len() >= opts.pack_bytes {
            send_pack(remote, std::mem::take(&mut w), &mut report, progress)?;
            w = PackWriter::new();
        }
    }
    if !w.is_empty() {
        send_pack(remote, w, &mut report, progress)?;
    }
    progress.finish();

    // Every object is on the remote: now, and only now, move the ref.
    let expected = old.as_ref().map(|o| &o.1);
    match remote.put_if(&key, ref_file(&head), expected) {
        Ok(()) => {}
        Err(RemoteError::Conflict { .. }) => {
            let now = remote
                .get_limited(&key, REF_BYTES)?
                .and_then(|b| parse_ref(&b, &key).ok())
                .map(|c| c.short(12))
                .unwrap_or_else(|| "(deleted)".into());
            return Err(RemoteError::NonFastForward {
                branch,
                remote: format!("{now}, pushed by someone else meanwhile,"),
                local: head.short(12),
            });
        }
        Err(e) => return Err(e),
    }
    set_tracking(repo, remote_name, &branch, &head, "push")?;
    Ok(report)
}

fn send_pack(
    remote: &dyn Remote,
    w: PackWriter,
    report: &mut PushReport,
    progress: &dyn Progress,
) -> Result<(), RemoteError> {
    let count = w.count() as u64;
    let (bytes, name, idx) = w.finish();
    let n = (bytes.len() + idx.len()) as u64;
    // The pack before its index: an index always names a complete pack.
    remote.put(&pack_key(&name), bytes)?;
    remote.put(&idx_key(&name), idx)?;
    report.packs_sent += 1;
    report.objects_sent += count;
    report.bytes_sent += n;
    progress.advance(n, count);
    Ok(())
}

/// Point `refs/remotes/<remote>/<branch>` at `to` (logged).
fn set_tracking(
    repo: &Repository,
    remote_name: &str,
    branch: &str,
    to: &CommitId,
    op: &str,
) -> Result<(), RemoteError> {
    let old = repo.remote_ref(remote_name, branch)?;
    if old.as_ref() == Some(to) {
        return Ok(());
    }
    let mut b = Batch::new();
    repo.move_ref(
        &mut b,
        &tracking_ref(remote_name, branch),
        old.as_ref(),
        Some(to),
        op,
    );
    repo.store().write(b).map_err(RepoError::from)?;
    repo.store().flush().map_err(RepoError::from)?;
    Ok(())
}

// ---------------------------------------------------------------- fetch

/// What to fetch.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// Only these branches (default: all).
    pub branches: Option<Vec<String>>,
    /// Only the newest `n` commits of each branch (a shallow fetch): chunks
    /// whose delta bases are left behind are stored as full snapshots.
    pub depth: Option<usize>,
}

/// One remote branch a fetch moved.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RefUpdate {
    pub branch: String,
    pub old: Option<CommitId>,
    pub new: CommitId,
}

/// What a fetch did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FetchReport {
    pub updated: Vec<RefUpdate>,
    pub commits: u64,
    /// The new commits' checkpoints' size.
    pub logical_bytes: u64,
    /// Objects written to the local store.
    pub objects: u64,
    /// Packs downloaded (or found complete from an interrupted fetch).
    pub packs: u64,
    pub bytes_received: u64,
    /// Chunks stored as full snapshots because their delta base was left
    /// behind (shallow fetch).
    pub reencoded: u64,
    /// Commits whose parents were left behind (shallow fetch).
    pub shallow: Vec<CommitId>,
    /// The most decoded delta bases held in memory at once while verifying
    /// (chunks are verified chain by chain, so about the chains' depth).
    pub bases_held_peak: u64,
}

/// A staged pack file and where each of its entries is (offset, length).
type StagedPack = (fs::File, HashMap<(Kind, [u8; 32]), (u64, u64)>);

/// Downloaded packs, kept in `.ckvc/fetch/` until the fetch completes.
struct Stage<'a> {
    dir: PathBuf,
    remote: &'a dyn Remote,
    index: &'a RemoteIndex,
    loaded: HashMap<Hash32, StagedPack>,
    bytes_received: u64,
    progress: &'a dyn Progress,
}

impl Stage<'_> {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RemoteError + '_ {
        move |source| RemoteError::Io {
            what: path.display().to_string(),
            source,
        }
    }

    /// Make sure pack `name` is staged and verified.
    fn load(&mut self, name: &Hash32) -> Result<(), RemoteError> {
        if self.loaded.contains_key(name) {
            return Ok(());
        }
        fs::create_dir_all(&self.dir).map_err(Self::io(&self.dir))?;
        let path = self.dir.join(format!("{name}.pack"));
        let what = format!("pack {}", pack_key(name));
        // A pack staged by an interrupted fetch is reused if it verifies.
        let staged = match fs::read(&path) {
            Ok(b) => pack::verify_pack(&b, name, &what).ok(),
            Err(_) => None,
        };
        let entries = match staged {
            Some(e) => e,
            None => {
                // No more than the index says the pack holds.
                let limit = self
                    .index
                    .packs
                    .get(name)
                    .copied()
                    .unwrap_or(pack::MAX_PACK_BYTES);
                let bytes = self
                    .remote
                    .get_limited(&pack_key(name), limit)?
                    .ok_or_else(|| {
                        corrupt(
                            &what,
                            "is missing (its index exists; the remote is damaged or was pruned)",
                        )
                    })?;
                if bytes.len() as u64 > pack::MAX_PACK_BYTES {
                    return Err(corrupt(&what, "larger than the pack size limit"));
                }
                let entries = pack::verify_pack(&bytes, name, &what)?;
                self.bytes_received += bytes.len() as u64;
                self.progress.advance(bytes.len() as u64, 1);
                let tmp = self.dir.join(format!(".{name}.tmp"));
                fs::write(&tmp, &bytes).map_err(Self::io(&tmp))?;
                fs::rename(&tmp, &path).map_err(Self::io(&path))?;
                entries
            }
        };
        let file = fs::File::open(&path).map_err(Self::io(&path))?;
        let map = entries
            .into_iter()
            .map(|e| ((e.kind, e.id), (e.offset, e.len)))
            .collect();
        self.loaded.insert(*name, (file, map));
        Ok(())
    }

    /// The pack the remote's index names for an object.
    fn pack_of(&self, kind: Kind, id: &[u8; 32]) -> Result<Hash32, RemoteError> {
        let what = || format!("{} {}", kind.name(), crate::store::to_hex(&id[..6]));
        self.index.entries.get(&(kind, *id)).copied().ok_or_else(|| {
            corrupt(
                what(),
                "is named by the remote's history but no pack holds it (a ref pointing at a missing pack?)",
            )
        })
    }

    /// The bytes of an object the remote holds, staging its pack first.
    fn get(&mut self, kind: Kind, id: &[u8; 32]) -> Result<Vec<u8>, RemoteError> {
        let name = self.pack_of(kind, id)?;
        self.load(&name)?;
        self.get_staged(kind, id)
    }

    /// The bytes of an object whose pack is staged already.
    fn get_staged(&self, kind: Kind, id: &[u8; 32]) -> Result<Vec<u8>, RemoteError> {
        let what = || format!("{} {}", kind.name(), crate::store::to_hex(&id[..6]));
        let name = self.pack_of(kind, id)?;
        let (file, map) = self.loaded.get(&name).ok_or_else(|| {
            corrupt(
                format!("pack {}", pack_key(&name)),
                "was not staged before verifying (a bug)",
            )
        })?;
        let &(off, len) = map.get(&(kind, *id)).ok_or_else(|| {
            corrupt(
                format!("pack index {}", idx_key(&name)),
                format!("lists {} but the pack does not hold it", what()),
            )
        })?;
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, off)
            .map_err(Self::io(&self.dir))?;
        Ok(buf)
    }

    fn cleanup(self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Decode a chunk record against its base's raw bytes and check it hashes
/// to `id`.
fn decode_verified(
    id: &ChunkId,
    rec: &ChunkRecord,
    base: Option<&[u8]>,
) -> Result<Vec<u8>, RemoteError> {
    let what = || format!("chunk {} received from the remote", id.short(12));
    // Nothing ckvc writes is larger, and every allocation below is bounded
    // by it: a crafted record cannot make a fetch allocate gigabytes.
    if rec.raw_len > pack::MAX_CHUNK_RAW {
        return Err(corrupt(
            what(),
            format!(
                "declares {} raw bytes, more than the {} a chunk may hold",
                rec.raw_len,
                pack::MAX_CHUNK_RAW
            ),
        ));
    }
    let raw = match rec.payload {
        Payload::Zstd => {
            if rec.base.is_some() {
                return Err(corrupt(what(), "a zstd chunk with a delta base"));
            }
            let limit = rec.raw_len.min(codec::HARD_MAX_RAW_LEN) as usize;
            zstd::bulk::decompress(&rec.data, limit)
                .map_err(|e| corrupt(what(), format!("zstd: {e}")))?
        }
        Payload::Codec => {
            let mut out = Vec::new();
            codec::decode_into(
                &rec.data,
                base,
                rec.raw_len,
                &mut out,
                &mut codec::Scratch::default(),
            )
            .map_err(|e| corrupt(what(), format!("codec: {e}")))?;
            out
        }
    };
    if raw.len() as u64 != rec.raw_len || ChunkId::digest(&raw) != *id {
        return Err(corrupt(
            what(),
            "does not decode to its id (blake3): damaged in transit or on the remote",
        ));
    }
    Ok(raw)
}

/// Verifies the fetched chunks and writes them, one walk (a root and the
/// chunks based on it, depth first) at a time; walks run in parallel and
/// share the batch being filled.
struct Verifier<'a, 'b> {
    repo: &'a Repository,
    stage: &'a Stage<'b>,
    plan: &'a Plan,
    /// The fetched chunks based on each fetched chunk.
    children: &'a HashMap<ChunkId, Vec<ChunkId>>,
    /// The write time the records get.
    written: u64,
    zstd_level: i32,
    progress: &'a dyn Progress,
    /// Verified records not written yet (written at `BATCH_BYTES`).
    batch: std::sync::Mutex<Batch>,
    reencoded: AtomicU64,
    bases_held_peak: AtomicU64,
}

fn unlogged_batch() -> Batch {
    let mut b = Batch::new();
    b.unlogged();
    b
}

impl Verifier<'_, '_> {
    /// Verify the chunks of `walk` (each after its base) and put their
    /// records in the batch; a decoded base is dropped once its last
    /// fetched dependent in the walk is verified.
    fn walk(&self, walk: &[ChunkId], scratch: &mut codec::Scratch) -> Result<(), RemoteError> {
        let mut cache: HashMap<ChunkId, std::sync::Arc<Vec<u8>>> = HashMap::new();
        // Dependents of each chunk still to verify in this walk (a chunk
        // re-encoded whole reads its base by itself).
        let mut pending: HashMap<ChunkId, usize> = HashMap::new();
        for id in walk {
            let n = self.children.get(id).map_or(0, |c| {
                c.iter().filter(|c| !self.plan.reencode.contains(c)).count()
            });
            pending.insert(*id, n);
        }
        for id in walk {
            let (mut rec, n) = self.record(id)?;
            let base = match &rec.base {
                Some(b) => Some(self.raw(b, 1, &cache)?),
                None => None,
            };
            let raw = decode_verified(id, &rec, base.as_deref().map(|b| b.as_slice()))?;
            let reencode = self.plan.reencode.contains(id);
            if let (Some(b), false) = (&rec.base, reencode) {
                if let Some(d) = pending.get_mut(b) {
                    *d = d.saturating_sub(1);
                    if *d == 0 {
                        cache.remove(b);
                    }
                }
            }
            let bytes = if reencode {
                let dtype = match rec.payload {
                    Payload::Codec => Some(
                        codec::FrameInfo::parse(&rec.data)
                            .map_err(|e| corrupt(format!("chunk {}", id.short(12)), e.to_string()))?
                            .dtype,
                    ),
                    Payload::Zstd => None,
                };
                self.reencoded.fetch_add(1, Ordering::Relaxed);
                encode_record(&raw, dtype, None, self.zstd_level, scratch)?.encode()
            } else {
                // Stamped now, so gc's grace period covers the records until
                // the final batch references them.
                rec.written = self.written;
                rec.encode()
            };
            if pending.get(id).is_some_and(|&d| d > 0) {
                cache.insert(*id, std::sync::Arc::new(raw));
                self.bases_held_peak
                    .fetch_max(cache.len() as u64, Ordering::Relaxed);
            }
            let full = {
                let mut b = self.batch.lock().unwrap_or_else(|e| e.into_inner());
                b.put(Space::Chunks, id.as_bytes(), bytes);
                (b.payload_bytes() >= BATCH_BYTES)
                    .then(|| std::mem::replace(&mut *b, unlogged_batch()))
            };
            if let Some(full) = full {
                self.repo.store().write(full).map_err(RepoError::from)?;
            }
            self.progress.advance(n as u64, 1);
        }
        Ok(())
    }

    /// Raw bytes of a chunk: from this walk's decoded bases, the local
    /// store (verified on read) or the staged packs (decoded and verified
    /// here, through its chain).
    fn raw(
        &self,
        id: &ChunkId,
        hops: u16,
        cache: &HashMap<ChunkId, std::sync::Arc<Vec<u8>>>,
    ) -> Result<std::sync::Arc<Vec<u8>>, RemoteError> {
        if let Some(r) = cache.get(id) {
            return Ok(r.clone());
        }
        if hops > HARD_MAX_CHAIN {
            return Err(corrupt(
                format!("chunk {}", id.short(12)),
                format!("delta chain longer than {HARD_MAX_CHAIN} (a cycle?)"),
            ));
        }
        if self
            .repo
            .store()
            .contains(Space::Chunks, id.as_bytes())
            .map_err(RepoError::from)?
        {
            return Ok(std::sync::Arc::new(self.repo.read_chunk(id)?));
        }
        let (rec, _) = self.record(id)?;
        let base = match &rec.base {
            Some(b) => Some(self.raw(b, hops + 1, cache)?),
            None => None,
        };
        Ok(std::sync::Arc::new(decode_verified(
            id,
            &rec,
            base.as_deref().map(|v| v.as_slice()),
        )?))
    }

    fn record(&self, id: &ChunkId) -> Result<(ChunkRecord, usize), RemoteError> {
        let bytes = self.stage.get_staged(Kind::Chunk, id.as_bytes())?;
        let n = bytes.len();
        let rec = ChunkRecord::decode(&bytes).map_err(|r| {
            corrupt(
                format!("chunk {} received from the remote", id.short(12)),
                r,
            )
        })?;
        Ok((rec, n))
    }
}

/// Fetch from `remote` (named `remote_name` locally): new objects into the
/// store, remote branches into `refs/remotes/<remote_name>/`.
pub fn fetch(
    repo: &Repository,
    remote_name: &str,
    remote: &dyn Remote,
    opts: &FetchOptions,
    progress: &dyn Progress,
) -> Result<FetchReport, RemoteError> {
    check_layout(remote, false)?;
    let mut heads = remote_heads(remote)?;
    if let Some(want) = &opts.branches {
        for b in want {
            if !heads.contains_key(b) {
                return Err(RemoteError::NoSuchRemoteBranch { branch: b.clone() });
            }
        }
        heads.retain(|b, _| want.contains(b));
    }
    let mut report = FetchReport::default();
    let mut roots = Vec::new();
    for c in heads.values() {
        if !repo.has_commit(c)? && !roots.contains(c) {
            roots.push(*c);
        }
    }
    let mut final_batch = Batch::new();
    if !roots.is_empty() {
        let ix = load_index(remote)?;
        let mut stage = Stage {
            dir: repo.root().join(DOT_DIR).join("fetch"),
            remote,
            index: &ix,
            loaded: HashMap::new(),
            bytes_received: 0,
            progress,
        };
        progress.start("download", 0, ix.packs.len() as u64);
        let plan = plan_fetch(repo, &mut stage, &roots, opts.depth)?;
        progress.finish();
        report.commits = plan.commits;
        report.logical_bytes = plan.logical_bytes;
        report.shallow = plan.boundary.clone();

        // Verify every chunk (bases first) and write it; nothing unverified
        // reaches the store.
        let mut order: Vec<(u16, ChunkId)> = plan.chunks.iter().map(|(id, c)| (c.0, *id)).collect();
        order.sort();
        // Chain by chain: each chunk right after its base, in a depth-first
        // walk from each chunk whose base is not fetched (a root), so that
        // only the bases along a walk are held decoded, not every base of a
        // depth (a clone of many keyframes would hold them all). The walks
        // are independent and verified in parallel. Chunks no walk reaches
        // (a cycle of bases) come last, so their decoding names the damage.
        let fetched_base = |id: &ChunkId| plan.chunks[id].1.filter(|b| plan.chunks.contains_key(b));
        let mut children: HashMap<ChunkId, Vec<ChunkId>> = HashMap::new();
        for (_, id) in &order {
            if let Some(b) = fetched_base(id) {
                children.entry(b).or_default().push(*id);
            }
        }
        let mut walks: Vec<Vec<ChunkId>> = Vec::new();
        let mut seen = HashSet::with_capacity(order.len());
        for (_, root) in order.iter().filter(|(_, id)| fetched_base(id).is_none()) {
            let mut walk = Vec::new();
            let mut stack = vec![*root];
            while let Some(id) = stack.pop() {
                if seen.insert(id) {
                    walk.push(id);
                    stack.extend(children.get(&id).into_iter().flatten().rev());
                }
            }
            walks.push(walk);
        }
        let rest: Vec<ChunkId> = order
            .iter()
            .map(|(_, id)| *id)
            .filter(|id| !seen.contains(id))
            .collect();
        if !rest.is_empty() {
            walks.push(rest);
        }
        // Every pack the walks read is staged now (planning read their
        // headers), so the walks only read the stage.
        for (_, id) in &order {
            let pack = stage.pack_of(Kind::Chunk, id.as_bytes())?;
            stage.load(&pack)?;
        }
        progress.start("verify", 0, order.len() as u64);
        let v = Verifier {
            repo,
            stage: &stage,
            plan: &plan,
            children: &children,
            written: now_secs(),
            zstd_level: repo.config().zstd_level,
            progress,
            batch: std::sync::Mutex::new(unlogged_batch()),
            reencoded: AtomicU64::new(0),
            bases_held_peak: AtomicU64::new(0),
        };
        walks
            .par_iter()
            .try_for_each_init(codec::Scratch::default, |scratch, walk| {
                v.walk(walk, scratch)
            })?;
        report.objects += order.len() as u64;
        report.reencoded += v.reencoded.into_inner();
        report.bases_held_peak = v.bases_held_peak.into_inner();
        let batch = v.batch.into_inner().unwrap_or_else(|e| e.into_inner());
        if !batch.is_empty() {
            repo.store().write(batch).map_err(RepoError::from)?;
        }
        progress.finish();
        repo.store().flush().map_err(RepoError::from)?;
        report.packs = stage.loaded.len() as u64;
        report.bytes_received = stage.bytes_received;
        for (key, bytes) in plan.objects {
            final_batch.put(Space::Objects, &key, bytes);
            report.objects += 1;
        }
        if !plan.boundary.is_empty() {
            let mut all: Vec<CommitId> = repo.shallow()?.into_iter().collect();
            all.extend(plan.boundary.iter().copied());
            all.sort();
            all.dedup();
            final_batch.put(
                Space::Meta,
                SHALLOW,
                all.iter().flat_map(|c| c.0).collect::<Vec<u8>>(),
            );
        }
        stage_cleanup_after(
            stage,
            repo,
            heads.clone(),
            remote_name,
            &mut final_batch,
            &mut report,
        )?;
    } else {
        add_tracking_moves(repo, &heads, remote_name, &mut final_batch, &mut report)?;
        repo.store().write(final_batch).map_err(RepoError::from)?;
        repo.store().flush().map_err(RepoError::from)?;
    }
    Ok(report)
}

fn stage_cleanup_after(
    stage: Stage<'_>,
    repo: &Repository,
    heads: BTreeMap<String, CommitId>,
    remote_name: &str,
    final_batch: &mut Batch,
    report: &mut FetchReport,
) -> Result<(), RemoteError> {
    add_tracking_moves(repo, &heads, remote_name, final_batch, report)?;
    repo.store()
        .write(std::mem::take(final_batch))
        .map_err(RepoError::from)?;
    repo.store().flush().map_err(RepoError::from)?;
    stage.cleanup();
    Ok(())
}

fn add_tracking_moves(
    repo: &Repository,
    heads: &BTreeMap<String, CommitId>,
    remote_name: &str,
    batch: &mut Batch,
    report: &mut FetchReport,
) -> Result<(), RemoteError> {
    for (branch, id) in heads {
        let old = repo.remote_ref(remote_name, branch)?;
        if old.as_ref() != Some(id) {
            repo.move_ref(
                batch,
                &tracking_ref(remote_name, branch),
                old.as_ref(),
                Some(id),
                "fetch",
            );
            report.updated.push(RefUpdate {
                branch: branch.clone(),
                old,
                new: *id,
            });
        }
    }
    Ok(())
}

/// What a fetch will store.
struct Plan {
    /// Verified objects: store key -> bytes.
    objects: Vec<(Vec<u8>, Vec<u8>)>,
    /// Chunks to fetch: claimed depth, base, and whether they are named by
    /// a manifest.
    chunks: HashMap<ChunkId, (u16, Option<ChunkId>, bool)>,
    /// Chunks to store as full snapshots (their base is left behind).
    reencode: HashSet<ChunkId>,
    boundary: Vec<CommitId>,
    commits: u64,
    logical_bytes: u64,
}

fn has_object(repo: &Repository, kind: u8, id: &ObjectId) -> Result<bool, RemoteError> {
    Ok(repo
        .store()
        .contains(Space::Objects, &object_key(kind, id))
        .map_err(RepoError::from)?)
}

fn plan_fetch(
    repo: &Repository,
    stage: &mut Stage<'_>,
    roots: &[CommitId],
    depth: Option<usize>,
) -> Result<Plan, RemoteError> {
    let mut plan = Plan {
        objects: Vec::new(),
        chunks: HashMap::new(),
        reencode: HashSet::new(),
        boundary: Vec::new(),
        commits: 0,
        logical_bytes: 0,
    };
    let mut seen_commits = HashSet::new();
    let mut seen_objects: HashSet<ObjectId> = HashSet::new();
    let mut named_chunks: Vec<ChunkId> = Vec::new();
    let mut queue: VecDeque<(CommitId, usize)> = roots.iter().map(|&c| (c, 0)).collect();
    while let Some((id, gen)) = queue.pop_front() {
        if !seen_commits.insert(id) || repo.has_commit(&id)? {
            continue;
        }
        let bytes = stage.get(Kind::Commit, id.as_bytes())?;
        let what = format!("commit {} received from the remote", id.short(12));
        let commit = Commit::decode(&bytes).map_err(|r| corrupt(&what, r))?;
        plan.commits += 1;
        // Saturating: the number comes from the remote (display only).
        plan.logical_bytes = plan
            .logical_bytes
            .saturating_add(commit.stats.logical_bytes);
        plan.objects.push((
            object_key(KIND_COMMIT, &ObjectId::from_bytes(id.0)).to_vec(),
            bytes,
        ));
        let mut cut = false;
        for p in &commit.parents {
            if repo.has_commit(p)? {
                continue;
            }
            if depth.is_some_and(|d| gen + 1 >= d) {
                cut = true;
            } else {
                queue.push_back((*p, gen + 1));
            }
        }
        if cut {
            plan.boundary.push(id);
        }
        if has_object(repo, KIND_TREE, &commit.tree)? || !seen_objects.insert(commit.tree) {
            continue;
        }
        let bytes = stage.get(Kind::Tree, commit.tree.as_bytes())?;
        let tree = Tree::decode(&bytes).map_err(|r| corrupt(format!("tree of {what}"), r))?;
        plan.objects
            .push((object_key(KIND_TREE, &commit.tree).to_vec(), bytes));
        for (path, mid) in &tree.entries {
            if has_object(repo, KIND_MANIFEST, mid)? || !seen_objects.insert(*mid) {
                continue;
            }
            let bytes = stage.get(Kind::Manifest, mid.as_bytes())?;
            let m = FileManifest::decode(&bytes)
                .map_err(|r| corrupt(format!("manifest of {path} in {what}"), r))?;
            plan.objects
                .push((object_key(KIND_MANIFEST, mid).to_vec(), bytes));
            for seg in &m.segments {
                let chunks = match seg {
                    SegmentRef::Tensor { chunks, .. } | SegmentRef::Opaque { chunks, .. } => chunks,
                };
                named_chunks.extend(chunks.iter().copied());
            }
        }
    }
    // Chunks the local store lacks, and their delta bases.
    let mut work: Vec<(ChunkId, bool)> = Vec::new();
    for c in named_chunks {
        if !plan.chunks.contains_key(&c)
            && !repo
                .store()
                .contains(Space::Chunks, c.as_bytes())
                .map_err(RepoError::from)?
        {
            plan.chunks.insert(c, (0, None, true));
            work.push((c, true));
        }
    }
    let mut headers = HashMap::new();
    while let Some((c, named)) = work.pop() {
        let bytes = stage.get(Kind::Chunk, c.as_bytes())?;
        let h = ChunkRecord::decode_header(&bytes)
            .map_err(|r| corrupt(format!("chunk {} received from the remote", c.short(12)), r))?;
        plan.chunks.insert(c, (h.depth, h.base, named));
        headers.insert(c, h);
        if let Some(b) = h.base {
            let local = repo
                .store()
                .contains(Space::Chunks, b.as_bytes())
                .map_err(RepoError::from)?;
            if local || plan.chunks.contains_key(&b) {
                continue;
            }
            if depth.is_some() {
                plan.reencode.insert(c);
            } else {
                plan.chunks.insert(b, (0, None, false));
                work.push((b, false));
            }
        }
    }
    Ok(plan)
}

// ---------------------------------------------------------------- pull

/// What a pull did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PullReport {
    pub fetch: FetchReport,
    pub branch: String,
    pub old: Option<CommitId>,
    pub new: Option<CommitId>,
    /// The local branch already had (or was ahead of) the remote's.
    pub up_to_date: bool,
}

/// Fetch `branch` (default: the current branch) and fast-forward the local
/// branch to it; a diverged branch is an error and changes nothing.
pub fn pull(
    repo: &Repository,
    remote_name: &str,
    remote: &dyn Remote,
    branch: Option<&str>,
    progress: &dyn Progress,
) -> Result<PullReport, RemoteError> {
    let branch = match branch {
        Some(b) => b.to_string(),
        None => repo.current_branch()?,
    };
    check_branch_name(&branch)?;
    let fetch_report = fetch(
        repo,
        remote_name,
        remote,
        &FetchOptions {
            branches: Some(vec![branch.clone()]),
            depth: None,
        },
        progress,
    )?;
    let theirs =
        repo.remote_ref(remote_name, &branch)?
            .ok_or_else(|| RemoteError::NoSuchRemoteBranch {
                branch: branch.clone(),
            })?;
    let ours = repo.branch_head(&branch)?;
    let mut report = PullReport {
        fetch: fetch_report,
        branch: branch.clone(),
        old: ours,
        new: ours,
        up_to_date: false,
    };
    match ours {
        Some(o) if o == theirs || is_ancestor(repo, &theirs, &o)? => {
            report.up_to_date = true;
            return Ok(report);
        }
        Some(o) if !is_ancestor(repo, &o, &theirs)? => {
            return Err(RemoteError::Diverged {
                branch,
                local: o.short(12),
                remote: theirs.short(12),
            });
        }
        _ => {}
    }
    let mut b = Batch::new();
    repo.move_ref(
        &mut b,
        &branch_ref(&branch),
        ours.as_ref(),
        Some(&theirs),
        "pull",
    );
    repo.store().write(b).map_err(RepoError::from)?;
    repo.store().flush().map_err(RepoError::from)?;
    report.new = Some(theirs);
    Ok(report)
}

// ---------------------------------------------------------------- clone

/// How to clone.
#[derive(Debug, Clone, Default)]
pub struct CloneOptions {
    /// The branch to check out (default `main` if the remote has it, else
    /// its first branch). Only this branch is fetched when given.
    pub branch: Option<String>,
    /// Only the newest `n` commits (shallow).
    pub depth: Option<usize>,
    pub s3: S3Options,
    pub config: Config,
}

/// What a clone did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CloneReport {
    pub fetch: FetchReport,
    /// The local branch created (`None`: the remote has no branches).
    pub branch: Option<String>,
    pub head: Option<CommitId>,
}

/// Create a repository in `dir` (absent or empty) from the remote at
/// `url`, with the remote as `origin`. On failure nothing is left behind.
pub fn clone(
    url: &str,
    dir: &Path,
    opts: &CloneOptions,
    progress: &dyn Progress,
) -> Result<(Repository, CloneReport), RemoteError> {
    let remote = open_url(url, &opts.s3)?;
    check_layout(&*remote, false)?;
    let existed = dir.exists();
    if existed
        && fs::read_dir(dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(RepoError::OutputNotEmpty {
            path: dir.to_path_buf(),
        }
        .into());
    }
    fs::create_dir_all(dir).map_err(|source| RemoteError::Io {
        what: dir.display().to_string(),
        source,
    })?;
    let result = clone_into(url, dir, &*remote, opts, progress);
    if result.is_err() {
        if existed {
            let _ = fs::remove_dir_all(dir.join(DOT_DIR));
        } else {
            let _ = fs::remove_dir_all(dir);
        }
    }
    result
}

fn clone_into(
    url: &str,
    dir: &Path,
    remote: &dyn Remote,
    opts: &CloneOptions,
    progress: &dyn Progress,
) -> Result<(Repository, CloneReport), RemoteError> {
    let repo = Repository::init(dir, opts.config.clone())?;
    add_remote(&repo, "origin", url, opts.s3.clone())?;
    let fetch_report = fetch(
        &repo,
        "origin",
        remote,
        &FetchOptions {
            branches: opts.branch.clone().map(|b| vec![b]),
            depth: opts.depth,
        },
        progress,
    )?;
    let tracking = repo.remote_refs("origin")?;
    let pick = match &opts.branch {
        Some(b) => tracking.iter().find(|(n, _)| n == b),
        None => tracking
            .iter()
            .find(|(n, _)| n == "main")
            .or_else(|| tracking.first()),
    };
    let mut report = CloneReport {
        fetch: fetch_report,
        branch: None,
        head: None,
    };
    if let Some((b, id)) = pick.cloned() {
        let mut batch = Batch::new();
        repo.move_ref(&mut batch, &branch_ref(&b), None, Some(&id), "clone");
        repo.store().write(batch).map_err(RepoError::from)?;
        repo.switch_branch(&b)?;
        report.branch = Some(b);
        report.head = Some(id);
    }
    Ok((repo, report))
}
