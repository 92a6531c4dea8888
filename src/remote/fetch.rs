//! `fetch`: new commits from a remote into the repository, the remote's
//! branches into `refs/remotes/<remote>/`.
//!
//! Read the remote refs, walk from them through objects the local store
//! lacks (commits, trees and manifests read by range, placed by the pack
//! indexes), then bring in the chunks: a pack whose entries are mostly
//! needed is downloaded whole into `.ckvc/fetch/` (kept across an
//! interrupted fetch; verified against its name before use), otherwise
//! (a shallow fetch, a pack partly held already) only the entries needed,
//! by range reads; several requests at a time. And planning which chunks to fetch (shallow: which
//! to store whole, and the left-out base chains to read for that).
//! Everything received goes through the repository's verified import
//! ([`Repository::import`]): objects hash to their ids, every chunk is
//! decoded through its delta chain to its blake3 id before it is written,
//! and the objects and remote-tracking refs land in one atomic batch. This
//! file owns the staging of packs and the order chunks are verified in
//! (chain by chain, in parallel), not the verification itself.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::codec;
use crate::repo::objects::ChunkRecord;
use crate::repo::{Import, ImportBase, ObjectKind, Repository, TensorPlace, DOT_DIR};
use crate::store::{ChunkId, CommitId, Hash32, ObjectId};

use super::layout::{
    check_layout, corrupt, idx_key, load_index, pack_key, remote_heads, Loc, RemoteIndex,
};
use super::pack::{self, Kind};
use super::{Progress, Remote, RemoteError};

/// What to fetch.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// Only these branches (default: all).
    pub branches: Option<Vec<String>>,
    /// Only the newest `n` commits of each branch (a shallow fetch): chunks
    /// whose delta bases are left behind are stored as full snapshots
    /// (`Some(0)` is taken as 1; the CLI refuses 0).
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
    /// Packs read from, whole (downloaded, or found complete from an
    /// interrupted fetch) or in part.
    pub packs: u64,
    pub bytes_received: u64,
    /// Reads of part of a pack (a shallow fetch reads the entries it needs
    /// by range where that is less than the whole pack).
    pub range_reads: u64,
    /// Chunks stored as full snapshots because their delta base was left
    /// behind (shallow fetch).
    pub reencoded: u64,
    /// Commits whose parents were left behind (shallow fetch).
    pub shallow: Vec<CommitId>,
    /// The most decoded delta bases held in memory at once while verifying
    /// (chunks are verified chain by chain, so about the chains' depth).
    pub bases_held_peak: u64,
}

/// A range read reaches over a gap of unneeded bytes up to this long
/// between two needed entries (one request instead of two).
const MERGE_GAP: u64 = 64 << 10;

/// A pack whose needed entries add up to at least this share of it
/// (numerator / 8) is downloaded whole (and verified by its name).
const WHOLE_EIGHTHS: u64 = 7;

/// Requests of a fetch in flight at once.
const FETCH_PARALLEL: usize = 4;

/// Bytes one wave of parallel requests may bring into memory (a single
/// larger pack is downloaded alone).
const FETCH_WAVE_BYTES: u64 = 256 << 20;

/// An entry to read: its kind, id, and where the index places it.
type Wanted = (Kind, [u8; 32], Loc);

/// A staged pack: a file in `.ckvc/fetch/` and where each entry it holds
/// is in it (offset, length). A whole pack was downloaded entire and
/// verified against its name; a partial one (`<name>.part`, sparse) holds
/// only the entries read by range, at their offsets in the pack.
struct StagedPack {
    file: fs::File,
    map: HashMap<(Kind, [u8; 32]), (u64, u64)>,
    whole: bool,
}

/// Downloaded packs and pack entries, kept in `.ckvc/fetch/` until the
/// fetch completes.
struct Stage<'a> {
    dir: PathBuf,
    remote: &'a dyn Remote,
    index: &'a RemoteIndex,
    loaded: HashMap<Hash32, StagedPack>,
    bytes_received: u64,
    /// Requests that read part of a pack.
    range_reads: u64,
    progress: &'a dyn Progress,
}

impl Stage<'_> {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RemoteError + '_ {
        move |source| RemoteError::Io {
            what: path.display().to_string(),
            source,
        }
    }

    /// Stage pack `name` from an interrupted fetch's copy in `.ckvc/fetch/`
    /// if there is one and it verifies against its name; false otherwise.
    fn reuse(&mut self, name: &Hash32) -> Result<bool, RemoteError> {
        let path = self.dir.join(format!("{name}.pack"));
        let what = format!("pack {}", pack_key(name));
        let entries = match fs::read(&path) {
            Ok(b) => match pack::verify_pack(&b, name, &what) {
                Ok(e) => e,
                Err(_) => return Ok(false),
            },
            Err(_) => return Ok(false),
        };
        self.stage_whole(name, &path, entries)?;
        Ok(true)
    }

    /// Stage a pack downloaded and verified by [`download_pack`], written
    /// to `.ckvc/fetch/<name>.pack` (through a temporary file, so an
    /// interrupted fetch leaves only whole packs under that name).
    fn install(
        &mut self,
        name: &Hash32,
        bytes: &[u8],
        entries: Vec<pack::Entry>,
    ) -> Result<(), RemoteError> {
        fs::create_dir_all(&self.dir).map_err(Self::io(&self.dir))?;
        let path = self.dir.join(format!("{name}.pack"));
        self.bytes_received += bytes.len() as u64;
        self.progress.advance(bytes.len() as u64, 1);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        fs::write(&tmp, bytes).map_err(Self::io(&tmp))?;
        fs::rename(&tmp, &path).map_err(Self::io(&path))?;
        self.stage_whole(name, &path, entries)
    }

    fn stage_whole(
        &mut self,
        name: &Hash32,
        path: &Path,
        entries: Vec<pack::Entry>,
    ) -> Result<(), RemoteError> {
        let file = fs::File::open(path).map_err(Self::io(path))?;
        let map = entries
            .into_iter()
            .map(|e| ((e.kind, e.id), (e.offset, e.len)))
            .collect();
        self.loaded.insert(
            *name,
            StagedPack {
                file,
                map,
                whole: true,
            },
        );
        // Entries read by range before are in the whole pack too.
        let _ = fs::remove_file(self.dir.join(format!("{name}.part")));
        Ok(())
    }

    /// Where the remote's index says an object is.
    fn loc(&self, kind: Kind, id: &[u8; 32]) -> Result<Loc, RemoteError> {
        let what = || format!("{} {}", kind.name(), crate::store::to_hex(&id[..6]));
        self.index.entries.get(&(kind, *id)).copied().ok_or_else(|| {
            corrupt(
                what(),
                "is named by the remote's history but no pack holds it (a ref pointing at a missing pack?)",
            )
        })
    }

    fn is_staged(&self, kind: Kind, id: &[u8; 32]) -> Result<bool, RemoteError> {
        let loc = self.loc(kind, id)?;
        Ok(self
            .loaded
            .get(&loc.pack)
            .is_some_and(|p| p.whole || p.map.contains_key(&(kind, *id))))
    }

    /// Stage every object of `want`, pack by pack: a whole pack when the
    /// wanted entries make up most of it, else the wanted entries by range
    /// reads (neighbours a short gap apart in one read); the requests run
    /// several at a time ([`run_jobs`]).
    fn ensure(
        &mut self,
        want: impl IntoIterator<Item = (Kind, [u8; 32])>,
    ) -> Result<(), RemoteError> {
        let mut by_pack: BTreeMap<Hash32, Vec<Wanted>> = BTreeMap::new();
        for (kind, id) in want {
            if !self.is_staged(kind, &id)? {
                let loc = self.loc(kind, &id)?;
                by_pack.entry(loc.pack).or_default().push((kind, id, loc));
            }
        }
        let mut jobs = Vec::new();
        for (name, mut entries) in by_pack {
            entries.sort_by_key(|e| e.2.offset);
            entries.dedup_by_key(|e| (e.0, e.1));
            let what = format!("pack index {}", idx_key(&name));
            // Each read spans entry headers and bytes: start, end, entries.
            let mut reads: Vec<(u64, u64, Vec<Wanted>)> = Vec::new();
            for e in entries {
                let start =
                    e.2.offset
                        .checked_sub(pack::ENTRY_HEADER as u64)
                        .filter(|&s| s >= pack::PACK_HEADER as u64)
                        .ok_or_else(|| corrupt(&what, "an entry overlaps the pack header"))?;
                let end = e.2.offset + e.2.len; // checked against the pack's length on load
                match reads.last_mut() {
                    Some(r) if start <= r.1.saturating_add(MERGE_GAP) => {
                        r.1 = r.1.max(end);
                        r.2.push(e);
                    }
                    _ => reads.push((start, end, vec![e])),
                }
            }
            let total: u64 = reads.iter().map(|r| r.1 - r.0).sum();
            let pack_len = self.index.packs.get(&name).copied().unwrap_or(0);
            if total.saturating_mul(8) >= pack_len.saturating_mul(WHOLE_EIGHTHS) {
                if !self.reuse(&name)? {
                    jobs.push(Job::Whole(name));
                }
            } else {
                for (start, end, entries) in reads {
                    jobs.push(Job::Range(name, start, end, entries));
                }
            }
        }
        let (remote, index) = (self.remote, self.index);
        run_jobs(remote, index, jobs, |job, got| match (job, got) {
            (Job::Whole(name), Got::Whole(bytes, entries)) => self.install(&name, &bytes, entries),
            (Job::Range(name, start, end, entries), Got::Range(bytes)) => {
                self.stage_range(&name, start, end, &entries, &bytes)
            }
            _ => Err(corrupt("a download", "got another kind of result (a bug)")),
        })
    }

    /// Stage bytes `start..end` of pack `name`, read by range, and the
    /// entries in them, each checked against its index entry (the pack's
    /// own header for it names the same kind, id and length). The content
    /// itself is verified as every received object is: by its hash.
    fn stage_range(
        &mut self,
        name: &Hash32,
        start: u64,
        end: u64,
        entries: &[Wanted],
        bytes: &[u8],
    ) -> Result<(), RemoteError> {
        let what = format!("pack {}", pack_key(name));
        debug_assert_eq!(bytes.len() as u64, end - start);
        self.bytes_received += bytes.len() as u64;
        self.range_reads += 1;
        self.progress.advance(bytes.len() as u64, 0);
        for (kind, id, loc) in entries {
            let h = (loc.offset - start) as usize - pack::ENTRY_HEADER;
            let header = &bytes[h..h + pack::ENTRY_HEADER];
            if header[0] != *kind as u8
                || header[1..33] != id[..]
                || header[33..41] != loc.len.to_le_bytes()
            {
                return Err(corrupt(
                    &what,
                    format!(
                        "holds something else at offset {} than its index lists ({} {})",
                        loc.offset,
                        kind.name(),
                        crate::store::to_hex(&id[..6])
                    ),
                ));
            }
        }
        if !self.loaded.contains_key(name) {
            fs::create_dir_all(&self.dir).map_err(Self::io(&self.dir))?;
            let path = self.dir.join(format!("{name}.part"));
            // Never reused: only entries read by this fetch are trusted.
            let file = fs::File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(Self::io(&path))?;
            self.loaded.insert(
                *name,
                StagedPack {
                    file,
                    map: HashMap::new(),
                    whole: false,
                },
            );
        }
        let staged = self
            .loaded
            .get_mut(name)
            .ok_or_else(|| corrupt(&what, "was not staged (a bug)"))?;
        staged
            .file
            .write_all_at(bytes, start)
            .map_err(Self::io(&self.dir))?;
        for (kind, id, loc) in entries {
            staged.map.insert((*kind, *id), (loc.offset, loc.len));
        }
        Ok(())
    }

    /// The bytes of an object the remote holds, staging it first (a
    /// commit, tree or manifest brings every such object of its pack: the
    /// walk will want its neighbours next).
    fn get(&mut self, kind: Kind, id: &[u8; 32]) -> Result<Vec<u8>, RemoteError> {
        if !self.is_staged(kind, id)? {
            let loc = self.loc(kind, id)?;
            if kind == Kind::Chunk {
                self.ensure([(kind, *id)])?;
            } else {
                let objects: Vec<(Kind, [u8; 32])> = self
                    .index
                    .contents
                    .get(&loc.pack)
                    .into_iter()
                    .flatten()
                    .filter(|e| e.kind != Kind::Chunk)
                    .map(|e| (e.kind, e.id))
                    .collect();
                self.ensure(objects)?;
            }
        }
        self.get_staged(kind, id)
    }

    /// The bytes of an object that is staged already.
    fn get_staged(&self, kind: Kind, id: &[u8; 32]) -> Result<Vec<u8>, RemoteError> {
        let what = || format!("{} {}", kind.name(), crate::store::to_hex(&id[..6]));
        let name = self.loc(kind, id)?.pack;
        let staged = self.loaded.get(&name).ok_or_else(|| {
            corrupt(
                format!("pack {}", pack_key(&name)),
                "was not staged before verifying (a bug)",
            )
        })?;
        let &(off, len) = match staged.map.get(&(kind, *id)) {
            Some(e) => e,
            None if staged.whole => {
                return Err(corrupt(
                    format!("pack index {}", idx_key(&name)),
                    format!("lists {} but the pack does not hold it", what()),
                ))
            }
            None => {
                return Err(corrupt(
                    format!("{} of pack {}", what(), pack_key(&name)),
                    "was not staged before verifying (a bug)",
                ))
            }
        };
        let mut buf = vec![0u8; len as usize];
        staged
            .file
            .read_exact_at(&mut buf, off)
            .map_err(Self::io(&self.dir))?;
        Ok(buf)
    }

    fn cleanup(self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn missing_pack(what: &str) -> RemoteError {
    corrupt(
        what,
        "is missing (its index exists; the remote is damaged or was pruned)",
    )
}

/// Download pack `name` (no more than the index says it holds) and verify
/// it against its name: its bytes and entries.
fn download_pack(
    remote: &dyn Remote,
    index: &RemoteIndex,
    name: &Hash32,
) -> Result<(Vec<u8>, Vec<pack::Entry>), RemoteError> {
    let what = format!("pack {}", pack_key(name));
    let limit = index
        .packs
        .get(name)
        .copied()
        .unwrap_or(pack::MAX_PACK_BYTES);
    let bytes = remote
        .get_limited(&pack_key(name), limit)?
        .ok_or_else(|| missing_pack(&what))?;
    if bytes.len() as u64 > pack::MAX_PACK_BYTES {
        return Err(corrupt(&what, "larger than the pack size limit"));
    }
    let entries = pack::verify_pack(&bytes, name, &what)?;
    Ok((bytes, entries))
}

/// One request of a fetch: a whole pack, or bytes `start..end` of a pack
/// holding the listed entries.
enum Job {
    Whole(Hash32),
    Range(Hash32, u64, u64, Vec<Wanted>),
}

impl Job {
    /// The most bytes it brings into memory.
    fn bytes(&self, index: &RemoteIndex) -> u64 {
        match self {
            Job::Whole(name) => index
                .packs
                .get(name)
                .copied()
                .unwrap_or(pack::MAX_PACK_BYTES),
            Job::Range(_, start, end, _) => end - start,
        }
    }
}

/// What a job brought: a verified whole pack, or a range's bytes.
enum Got {
    Whole(Vec<u8>, Vec<pack::Entry>),
    Range(Vec<u8>),
}

/// Run `jobs`' requests, up to [`FETCH_PARALLEL`] at once (a remote's
/// latency, not its bandwidth, bounds one request at a time), in waves of at
/// most [`FETCH_WAVE_BYTES`] (one larger job runs alone); `stage` takes each
/// wave's results in job order, so what is staged does not depend on
/// timing.
fn run_jobs(
    remote: &dyn Remote,
    index: &RemoteIndex,
    jobs: Vec<Job>,
    mut stage: impl FnMut(Job, Got) -> Result<(), RemoteError>,
) -> Result<(), RemoteError> {
    let mut jobs = jobs.into_iter().peekable();
    while jobs.peek().is_some() {
        let mut wave = Vec::new();
        let mut bytes = 0u64;
        while let Some(j) = jobs.peek() {
            let b = j.bytes(index);
            if !wave.is_empty()
                && (wave.len() >= FETCH_PARALLEL || bytes.saturating_add(b) > FETCH_WAVE_BYTES)
            {
                break;
            }
            bytes = bytes.saturating_add(b);
            wave.extend(jobs.next());
        }
        let got: Vec<Result<Got, RemoteError>> = if wave.len() == 1 {
            vec![run_job(remote, index, &wave[0])]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = wave
                    .iter()
                    .map(|j| s.spawn(move || run_job(remote, index, j)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(corrupt("a download", "its thread panicked (a bug)"))
                        })
                    })
                    .collect()
            })
        };
        for (job, got) in wave.into_iter().zip(got) {
            stage(job, got?)?;
        }
    }
    Ok(())
}

fn run_job(remote: &dyn Remote, index: &RemoteIndex, job: &Job) -> Result<Got, RemoteError> {
    match job {
        Job::Whole(name) => {
            let (bytes, entries) = download_pack(remote, index, name)?;
            Ok(Got::Whole(bytes, entries))
        }
        Job::Range(name, start, end, _) => {
            let what = format!("pack {}", pack_key(name));
            let bytes = remote
                .get_range(&pack_key(name), *start, end - start)?
                .ok_or_else(|| missing_pack(&what))?;
            if bytes.len() as u64 != end - start {
                return Err(corrupt(&what, "a range read returned another length"));
            }
            Ok(Got::Range(bytes))
        }
    }
}

/// Verifies the fetched chunks through the repository's import, one walk
/// (a root and the chunks based on it, depth first) at a time; walks run in
/// parallel.
struct Verifier<'a, 'b, 'r> {
    repo: &'a Repository,
    import: &'a Import<'r>,
    stage: &'a Stage<'b>,
    plan: &'a Plan,
    /// The fetched chunks based on each fetched chunk.
    children: &'a HashMap<ChunkId, Vec<ChunkId>>,
    progress: &'a dyn Progress,
    bases_held_peak: AtomicU64,
}

impl Verifier<'_, '_, '_> {
    /// Verify and stage the chunks of `walk` (each after its base); a
    /// decoded base is dropped once its last fetched dependent in the walk
    /// is verified.
    fn walk(&self, walk: &[ChunkId], scratch: &mut codec::Scratch) -> Result<(), RemoteError> {
        let mut cache: HashMap<ChunkId, Vec<u8>> = HashMap::new();
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
            let record = self.stage.get_staged(Kind::Chunk, id.as_bytes())?;
            let reencode = self.plan.reencode.contains(id);
            let place = self.plan.places.get(id);
            let raw = self.import.add_chunk(
                id,
                &record,
                reencode,
                place,
                |b| self.base(b, &cache),
                scratch,
            )?;
            let base = self.plan.chunks.get(id).and_then(|c| c.1);
            if let (Some(b), false) = (base, reencode) {
                if let Some(d) = pending.get_mut(&b) {
                    *d = d.saturating_sub(1);
                    if *d == 0 {
                        cache.remove(&b);
                    }
                }
            }
            if pending.get(id).is_some_and(|&d| d > 0) {
                cache.insert(*id, raw);
                self.bases_held_peak
                    .fetch_max(cache.len() as u64, Ordering::Relaxed);
            }
            self.progress.advance(record.len() as u64, 1);
        }
        Ok(())
    }

    /// Where a delta base is: decoded in this walk, in the local store
    /// (`None`), or another fetched record.
    fn base<'c>(
        &self,
        id: &ChunkId,
        cache: &'c HashMap<ChunkId, Vec<u8>>,
    ) -> Result<Option<ImportBase<'c>>, RemoteError> {
        if let Some(raw) = cache.get(id) {
            return Ok(Some(ImportBase::Verified(raw)));
        }
        if self.repo.has_object(ObjectKind::Chunk, id.as_bytes())? {
            return Ok(None);
        }
        Ok(Some(ImportBase::Record(
            self.stage.get_staged(Kind::Chunk, id.as_bytes())?,
        )))
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
    let mut import = repo.import("received from the remote", pack::MAX_CHUNK_RAW);
    if !roots.is_empty() {
        let ix = load_index(remote)?;
        let mut stage = Stage {
            dir: repo.root().join(DOT_DIR).join("fetch"),
            remote,
            index: &ix,
            loaded: HashMap::new(),
            bytes_received: 0,
            range_reads: 0,
            progress,
        };
        progress.start("download", 0, ix.packs.len() as u64);
        let plan = plan_fetch(repo, &mut import, &mut stage, &roots, opts.depth)?;
        progress.finish();
        report.commits = plan.commits;
        report.logical_bytes = plan.logical_bytes;
        report.shallow = plan.boundary.clone();
        import.add_shallow(&plan.boundary);

        // Verify every chunk (bases first) and stage it; nothing unverified
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
        // Every record the walks read (the chunks, and the left-out bases
        // that re-encoded chunks are decoded through) was staged while
        // planning read its header, so the walks only read the stage.
        progress.start("verify", 0, order.len() as u64);
        let v = Verifier {
            repo,
            import: &import,
            stage: &stage,
            plan: &plan,
            children: &children,
            progress,
            bases_held_peak: AtomicU64::new(0),
        };
        walks
            .par_iter()
            .try_for_each_init(codec::Scratch::default, |scratch, walk| {
                v.walk(walk, scratch)
            })?;
        report.bases_held_peak = v.bases_held_peak.into_inner();
        progress.finish();
        report.objects = order.len() as u64 + plan.objects;
        report.reencoded = import.reencoded();
        report.packs = stage.loaded.len() as u64;
        report.bytes_received = stage.bytes_received;
        report.range_reads = stage.range_reads;
        add_tracking_moves(repo, &heads, remote_name, &mut import, &mut report)?;
        import.commit()?;
        stage.cleanup();
    } else {
        add_tracking_moves(repo, &heads, remote_name, &mut import, &mut report)?;
        import.commit()?;
    }
    Ok(report)
}

fn add_tracking_moves(
    repo: &Repository,
    heads: &BTreeMap<String, CommitId>,
    remote_name: &str,
    import: &mut Import<'_>,
    report: &mut FetchReport,
) -> Result<(), RemoteError> {
    for (branch, id) in heads {
        let old = repo.remote_ref(remote_name, branch)?;
        if old.as_ref() != Some(id) {
            import.set_remote_ref(remote_name, branch, old.as_ref(), id, "fetch");
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
    /// Objects (commits, trees, manifests) staged in the import.
    objects: u64,
    /// Chunks to fetch: claimed depth, base, and whether they are named by
    /// a manifest.
    chunks: HashMap<ChunkId, (u16, Option<ChunkId>, bool)>,
    /// Chunks to store as full snapshots (their base is left behind).
    reencode: HashSet<ChunkId>,
    /// Where the manifests put each tensor chunk (the first naming it):
    /// a chunk stored whole gets its rows from it.
    places: HashMap<ChunkId, TensorPlace>,
    boundary: Vec<CommitId>,
    commits: u64,
    logical_bytes: u64,
}

fn plan_fetch(
    repo: &Repository,
    import: &mut Import<'_>,
    stage: &mut Stage<'_>,
    roots: &[CommitId],
    depth: Option<usize>,
) -> Result<Plan, RemoteError> {
    let mut plan = Plan {
        objects: 0,
        chunks: HashMap::new(),
        reencode: HashSet::new(),
        places: HashMap::new(),
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
        let commit = import.add_commit(&id, bytes)?;
        plan.objects += 1;
        plan.commits += 1;
        // Saturating: the number comes from the remote (display only).
        plan.logical_bytes = plan
            .logical_bytes
            .saturating_add(commit.stats.logical_bytes);
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
        if repo.has_object(ObjectKind::Tree, commit.tree.as_bytes())?
            || !seen_objects.insert(commit.tree)
        {
            continue;
        }
        let bytes = stage.get(Kind::Tree, commit.tree.as_bytes())?;
        let tree = import.add_tree(&commit.tree, bytes, &id)?;
        plan.objects += 1;
        for (path, mid) in &tree.entries {
            if repo.has_object(ObjectKind::Manifest, mid.as_bytes())? || !seen_objects.insert(*mid)
            {
                continue;
            }
            let bytes = stage.get(Kind::Manifest, mid.as_bytes())?;
            let m = import.add_manifest(mid, bytes, path, &id)?;
            plan.objects += 1;
            for seg in &m.segments {
                for (index, c) in seg.chunks().iter().enumerate() {
                    if let Some(place) = TensorPlace::at(seg, index) {
                        plan.places.entry(*c).or_insert(place);
                    }
                }
                named_chunks.extend(seg.chunks().iter().copied());
            }
        }
    }
    // Chunks the local store lacks, and their delta bases, a round at a
    // time (each round's records are staged together, so a shallow fetch
    // reads each pack's needed entries in few requests). A shallow fetch
    // stores a chunk whose base is left behind whole: it is decoded
    // through its base chain, whose records are read (staged) but never
    // stored (`chain`).
    let mut round: Vec<ChunkId> = Vec::new();
    for c in named_chunks {
        if !plan.chunks.contains_key(&c) && !repo.has_object(ObjectKind::Chunk, c.as_bytes())? {
            plan.chunks.insert(c, (0, None, true));
            round.push(c);
        }
    }
    let mut chain: HashSet<ChunkId> = HashSet::new();
    while !round.is_empty() {
        stage.ensure(round.iter().map(|c| (Kind::Chunk, *c.as_bytes())))?;
        let mut next = Vec::new();
        for c in round {
            let bytes = stage.get_staged(Kind::Chunk, c.as_bytes())?;
            let h = ChunkRecord::decode_header(&bytes).map_err(|r| {
                corrupt(
                    format!("chunk {} received from the remote", c.short(12)),
                    r.to_string(),
                )
            })?;
            let in_chain = chain.contains(&c);
            if !in_chain {
                let named = plan.chunks.get(&c).is_some_and(|e| e.2);
                plan.chunks.insert(c, (h.depth, h.base, named));
            }
            let Some(b) = h.base else { continue };
            if plan.chunks.contains_key(&b) || repo.has_object(ObjectKind::Chunk, b.as_bytes())? {
                continue; // stored as received: its base is or will be here
            }
            if depth.is_some() {
                if !in_chain {
                    plan.reencode.insert(c);
                }
                if chain.insert(b) {
                    next.push(b);
                }
            } else {
                plan.chunks.insert(b, (0, None, false));
                next.push(b);
            }
        }
        round = next;
    }
    Ok(plan)
}
