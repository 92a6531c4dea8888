//! `gc --remote`: delete the packs of a remote that no remote branch needs.
//!
//! Mark: from every `refs/heads/*` of the remote, walk commits (all
//! parents), trees, manifests and chunks, and each chunk record's delta
//! base, reading the objects out of the packs that the indexes say hold
//! them; a pack holding anything reached is kept.
//!
//! Sweep, in two phases so a push running at the same time loses nothing:
//! a push uploads its new packs before it moves a ref, and it does not
//! upload objects the remote already has, so a pack that looks unreachable
//! now may be about to be referenced (a fresh upload, or an old pack whose
//! objects the push reuses). So a pack found unreachable is first recorded
//! in `gc/pending` with the time it was first seen so; only a later gc
//! that finds it still unreachable after the grace period deletes it, the
//! index first (so no pusher counts on its objects any more) and then the
//! pack. A push does not count on the objects of packs already recorded
//! there (one may be past its grace period, and a gc running during the
//! push deletes it): it sends them again. A push that takes longer than
//! the grace period between listing the remote's indexes and moving its
//! ref is the one case this does not cover; the default grace is seven
//! days.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::repo::objects::{ChunkRecord, Commit, FileManifest, Tree};
use crate::store::{ChunkId, CommitId, Hash32};

use super::layout::{check_layout, idx_key, load_index, pack_key, remote_heads, PACKS};
use super::pack::{self, Entry, Kind};
use super::{Remote, RemoteError};

/// Where gc keeps the packs it found unreachable: one line per pack,
/// `<64 hex digits> <unix seconds first seen unreachable>`.
pub const PENDING_KEY: &str = "gc/pending";
/// The largest `gc/pending` read (about 90 bytes per pack).
const MAX_PENDING: u64 = 64 << 20;
/// Packs held in memory at once during the mark.
const PACK_CACHE: usize = 2;

/// Knobs of [`gc_remote`].
#[derive(Debug, Clone)]
pub struct RemoteGcOptions {
    /// Report what would be deleted; change nothing on the remote.
    pub dry_run: bool,
    /// A pack is deleted only when a gc at least this long ago already
    /// found it unreachable.
    pub grace_secs: u64,
    /// Now, in Unix seconds (a parameter so tests can move time).
    pub now: u64,
}

/// What a remote gc found and did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RemoteGcReport {
    pub dry_run: bool,
    pub branches: usize,
    pub packs_before: usize,
    pub bytes_before: u64,
    /// Packs holding something a branch needs.
    pub reachable_packs: usize,
    /// Unreachable packs kept until their grace period has passed.
    pub pending_packs: usize,
    /// Packs deleted (or, on a dry run, that would be).
    pub deleted: Vec<Hash32>,
    pub deleted_bytes: u64,
    pub packs_after: usize,
    pub bytes_after: u64,
}

/// Mark and sweep the packs of `remote`.
pub fn gc_remote(
    remote: &dyn Remote,
    opts: &RemoteGcOptions,
) -> Result<RemoteGcReport, RemoteError> {
    check_layout(remote, false)?;
    // Packs listed before their indexes are: a pack whose index is still
    // missing then was left by a push killed between the two, or by a gc
    // killed between deleting the two (a push writes the index right after
    // its pack).
    let pack_files = pack_files(remote)?;
    let heads = remote_heads(remote)?;
    let index = load_index(remote)?;
    let orphans: Vec<Hash32> = pack_files
        .into_iter()
        .filter(|p| !index.packs.contains_key(p))
        .collect();
    let mut report = RemoteGcReport {
        dry_run: opts.dry_run,
        branches: heads.len(),
        packs_before: index.packs.len() + orphans.len(),
        bytes_before: index.packs.values().sum(),
        ..RemoteGcReport::default()
    };
    let reachable = mark(remote, &index, heads.values().copied().collect())?;
    report.reachable_packs = reachable.len();

    let old = read_pending(remote)?;
    let mut pending: BTreeMap<Hash32, u64> = BTreeMap::new();
    // No reader counts on a pack without an index: like an unreachable
    // pack, it is recorded, then deleted after the grace period.
    for name in index
        .packs
        .keys()
        .filter(|p| !reachable.contains(*p))
        .chain(&orphans)
    {
        let since = old.get(name).copied().unwrap_or(opts.now);
        if opts.now.saturating_sub(since) >= opts.grace_secs {
            report.deleted.push(*name);
            report.deleted_bytes += index.packs.get(name).copied().unwrap_or(0);
        } else {
            pending.insert(*name, since);
        }
    }
    report.deleted.sort();
    report.pending_packs = pending.len();
    report.packs_after = report.packs_before - report.deleted.len();
    report.bytes_after = report.bytes_before - report.deleted_bytes;
    if opts.dry_run {
        return Ok(report);
    }
    // Record the pending packs first: a gc killed while deleting still
    // remembers since when the rest has been unreachable.
    write_pending(remote, &pending)?;
    for name in &report.deleted {
        remote.delete(&idx_key(name))?;
        remote.delete(&pack_key(name))?;
    }
    Ok(report)
}

/// The names of the `.pack` files of the remote.
fn pack_files(remote: &dyn Remote) -> Result<Vec<Hash32>, RemoteError> {
    Ok(remote
        .list(PACKS)?
        .iter()
        .filter_map(|k| k[PACKS.len()..].strip_suffix(".pack")?.parse().ok())
        .collect())
}

/// The packs holding everything reachable from `roots`.
fn mark(
    remote: &dyn Remote,
    index: &super::layout::RemoteIndex,
    roots: Vec<CommitId>,
) -> Result<HashSet<Hash32>, RemoteError> {
    let mut reader = PackReader {
        remote,
        limits: &index.packs,
        cache: Vec::new(),
    };
    let mut reachable = HashSet::new();
    let mut read = |kind: Kind, id: &[u8; 32]| -> Result<Option<Vec<u8>>, RemoteError> {
        let Some(super::layout::Loc { pack: name, .. }) = index.entries.get(&(kind, *id)) else {
            return Ok(None); // not on the remote (a shallow history's edge)
        };
        reachable.insert(*name);
        reader.object(name, kind, id).map(Some)
    };
    let mut commits: Vec<CommitId> = roots;
    let mut seen_commits = HashSet::new();
    let mut seen_objects: HashSet<[u8; 32]> = HashSet::new();
    let mut chunks: Vec<ChunkId> = Vec::new();
    while let Some(c) = commits.pop() {
        if !seen_commits.insert(c) {
            continue;
        }
        let Some(bytes) = read(Kind::Commit, c.as_bytes())? else {
            continue;
        };
        let what = format!("commit {} on the remote", c.short(12));
        let commit = Commit::decode(&bytes).map_err(|r| corrupt(&what, r.to_string()))?;
        commits.extend(commit.parents.iter().copied());
        if !seen_objects.insert(*commit.tree.as_bytes()) {
            continue;
        }
        let Some(bytes) = read(Kind::Tree, commit.tree.as_bytes())? else {
            continue;
        };
        let tree =
            Tree::decode(&bytes).map_err(|r| corrupt(format!("tree of {what}"), r.to_string()))?;
        for (path, mid) in &tree.entries {
            if !seen_objects.insert(*mid.as_bytes()) {
                continue;
            }
            let Some(bytes) = read(Kind::Manifest, mid.as_bytes())? else {
                continue;
            };
            let m = FileManifest::decode(&bytes)
                .map_err(|r| corrupt(format!("manifest of {path} in {what}"), r.to_string()))?;
            chunks.extend(m.segments.iter().flat_map(|s| s.chunks()).copied());
        }
    }
    // Chunks, and the delta bases their records name.
    let mut seen_chunks = HashSet::new();
    while let Some(id) = chunks.pop() {
        if !seen_chunks.insert(id) {
            continue;
        }
        let Some(bytes) = read(Kind::Chunk, id.as_bytes())? else {
            continue;
        };
        let h = ChunkRecord::decode_header(&bytes).map_err(|r| {
            corrupt(
                format!("chunk {} on the remote", id.short(12)),
                r.to_string(),
            )
        })?;
        chunks.extend(h.base);
    }
    Ok(reachable)
}

/// A pack in memory: its name, bytes and entries by (kind, id).
type CachedPack = (Hash32, Vec<u8>, HashMap<(Kind, [u8; 32]), Entry>);

/// Reads objects out of packs, keeping the last few packs in memory.
struct PackReader<'a> {
    remote: &'a dyn Remote,
    /// Each pack's length as its index says (no more is read).
    limits: &'a HashMap<Hash32, u64>,
    cache: Vec<CachedPack>,
}

impl PackReader<'_> {
    fn object(&mut self, name: &Hash32, kind: Kind, id: &[u8; 32]) -> Result<Vec<u8>, RemoteError> {
        if let Some(i) = self.cache.iter().position(|(n, ..)| n == name) {
            let hit = self.cache.remove(i);
            self.cache.push(hit);
        } else {
            let key = pack_key(name);
            let bytes = self
                .remote
                .get_limited(
                    &key,
                    self.limits
                        .get(name)
                        .copied()
                        .unwrap_or(pack::MAX_PACK_BYTES),
                )?
                .ok_or_else(|| corrupt(&key, "listed by its index but missing"))?;
            let entries = pack::verify_pack(&bytes, name, &format!("pack {key}"))?;
            let by_id = entries.into_iter().map(|e| ((e.kind, e.id), e)).collect();
            if self.cache.len() >= PACK_CACHE {
                self.cache.remove(0);
            }
            self.cache.push((*name, bytes, by_id));
        }
        let (_, bytes, by_id) = self.cache.last().expect("just pushed");
        let e = by_id
            .get(&(kind, *id))
            .ok_or_else(|| corrupt(format!("pack {name}"), "its index lists an entry it lacks"))?;
        Ok(bytes[e.offset as usize..(e.offset + e.len) as usize].to_vec())
    }
}

pub(crate) fn read_pending(remote: &dyn Remote) -> Result<HashMap<Hash32, u64>, RemoteError> {
    let Some(bytes) = remote.get_limited(PENDING_KEY, MAX_PENDING)? else {
        return Ok(HashMap::new());
    };
    let text = std::str::from_utf8(&bytes).map_err(|_| corrupt(PENDING_KEY, "not UTF-8"))?;
    let mut out = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (name, since) = line
            .split_once(' ')
            .ok_or_else(|| corrupt(PENDING_KEY, format!("bad line {line:?}")))?;
        let name: Hash32 = name
            .parse()
            .map_err(|_| corrupt(PENDING_KEY, format!("bad pack name in {line:?}")))?;
        let since: u64 = since
            .parse()
            .map_err(|_| corrupt(PENDING_KEY, format!("bad time in {line:?}")))?;
        out.insert(name, since);
    }
    Ok(out)
}

fn write_pending(remote: &dyn Remote, pending: &BTreeMap<Hash32, u64>) -> Result<(), RemoteError> {
    let text: String = pending.iter().map(|(n, t)| format!("{n} {t}\n")).collect();
    if text.is_empty() {
        return remote.delete(PENDING_KEY);
    }
    remote.put(PENDING_KEY, text.into_bytes())
}

fn corrupt(what: impl Into<String>, reason: impl Into<String>) -> RemoteError {
    RemoteError::Corrupt {
        what: what.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remote::pack::PackWriter;
    use crate::remote::MemRemote;

    #[test]
    fn a_pack_left_without_its_index_is_deleted_after_the_grace_period() {
        let r = MemRemote::new();
        check_layout(&r, true).unwrap();
        // A push killed between its pack and its index (or a gc killed
        // between deleting the two) leaves a pack no index names.
        let mut w = PackWriter::new();
        let obj = b"a tree".to_vec();
        w.add(Kind::Tree, *blake3::hash(&obj).as_bytes(), &obj);
        let (bytes, name, _) = w.finish();
        r.put(&pack_key(&name), bytes).unwrap();
        let gc = |now| {
            let opts = RemoteGcOptions {
                dry_run: false,
                grace_secs: 100,
                now,
            };
            gc_remote(&r, &opts).unwrap()
        };
        let first = gc(1000);
        assert!(first.deleted.is_empty(), "{first:?}");
        assert_eq!(first.pending_packs, 1, "{first:?}");
        assert!(r.get(&pack_key(&name)).unwrap().is_some());
        let second = gc(2000);
        assert_eq!(second.deleted, vec![name], "{second:?}");
        assert_eq!(r.get(&pack_key(&name)).unwrap(), None);
        assert_eq!(second.packs_after, 0, "{second:?}");
    }
}
