//! `fsck`: prove a repository whole, or name what is damaged.
//!
//! From every branch and tag: every reachable commit, tree and manifest is
//! present and hashes to its id; every chunk (and every delta base) is
//! present and its header parses; and, unless `quick`, every file of every
//! reachable manifest is reassembled through the same verified path
//! checkout uses (each chunk decoded through its delta chain to its blake3
//! id, then the whole file against its recorded blake3). Damage is reported
//! per file, with the tensor and every commit that contains the file.

use std::collections::{BTreeMap, HashMap, HashSet};

use rayon::prelude::*;

use crate::store::{ChunkId, CommitId, ObjectId, Space};

use super::objects::{ChunkHeader, ChunkRecord, SegmentRef, KIND_CHUNK_HEAD};
use super::reach::{Reachable, WalkOptions};
use super::{CorruptReason, ObjectRef, Place, RepoError, Repository, Site};

/// Decoded chunks of a file's previous version kept per path while
/// verifying the next (bases of its deltas), at most this many bytes.
const FSCK_CACHE_BYTES: usize = 128 << 20;

/// A version of a file: (position of its first commit in history order,
/// manifest, that commit).
type Version<'a> = (usize, &'a ObjectId, &'a CommitId);

/// What fsck found.
#[derive(Debug, Default, serde::Serialize)]
pub struct FsckReport {
    pub commits: usize,
    pub manifests: usize,
    pub chunks: usize,
    /// Bytes of files reassembled and verified (0 with `quick`).
    pub verified_bytes: u64,
    /// Every problem, with the commits it affects.
    pub damage: Vec<Damage>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.damage.is_empty()
    }
}

/// One damaged object and the commits that cannot be checked out whole
/// because of it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Damage {
    /// The error as a message, naming the object (and file and tensor,
    /// when known).
    pub error: String,
    /// The damaged object: a chunk (for damage found while reassembling a
    /// file, the chunk of the file that could not be read, whose own
    /// record or a delta base's is damaged), a manifest (also when a file
    /// reassembles to the wrong hash), a tree or a commit.
    pub object: ObjectRef,
    /// Where it is used: a commit (and step), file and tensor.
    pub place: Place,
    /// Why it is unusable.
    pub reason: CorruptReason,
    /// The file affected, when the damage is inside one.
    pub path: Option<String>,
    /// (commit, step) of every reachable commit containing the damage.
    pub commits: Vec<(CommitId, u64)>,
}

/// The tensor of manifest `m` that chunk `id` holds (`None`: opaque bytes,
/// or not in `m`).
fn tensor_of(m: &super::objects::FileManifest, id: &ChunkId) -> Option<String> {
    m.segments.iter().find_map(|s| match s {
        SegmentRef::Tensor { name, chunks, .. } if chunks.contains(id) => Some(name.clone()),
        _ => None,
    })
}

/// Where chunk `id` of file `path` (manifest `m`, first named by `commit`)
/// is used.
fn chunk_place(
    reach: &Reachable,
    id: &ChunkId,
    commit: &CommitId,
    path: &str,
    m: &super::objects::FileManifest,
) -> Place {
    Place {
        commit: Some(*commit),
        step: reach.commit_info.get(commit).map(|i| i.1),
        file: Some(path.to_string()),
        tensor: tensor_of(m, id),
    }
}

impl Repository {
    /// Check everything reachable from every branch and tag.
    pub fn fsck(&self, quick: bool) -> Result<FsckReport, RepoError> {
        let roots = self.roots(u64::MAX)?;
        self.fsck_walk(&roots, None, quick, true)
    }

    /// Every chunk head (`Index` space) against its chunk's record: a head
    /// whose record is gone would let a commit take the chunk as stored,
    /// and one that disagrees would misstate its delta depth. Records are
    /// read only for chunks the walk did not reach (`reach` holds the
    /// headers it read and the damage it found).
    fn check_heads(&self, reach: &Reachable) -> Result<Vec<Damage>, RepoError> {
        let mut heads: Vec<(ChunkId, Vec<u8>)> = Vec::new();
        self.store
            .scan_prefix(Space::Index, &[KIND_CHUNK_HEAD], &mut |k, v| {
                if let Some(id) = ChunkId::from_slice(&k[1..]) {
                    heads.push((id, v.to_vec()));
                }
                Ok(true)
            })?;
        let damaged: HashSet<ChunkId> = reach.chunk_damage.iter().map(|(id, _)| *id).collect();
        let mut damage = Vec::new();
        let mut record = Vec::new();
        for (id, head) in heads {
            let found: Result<Option<ChunkHeader>, RepoError> = match reach.headers.get(&id) {
                Some(h) => Ok(Some(*h)),
                None if damaged.contains(&id) => continue, // reported by the walk
                None => match self.store.get(Space::Chunks, id.as_bytes(), &mut record) {
                    Ok(false) => Ok(None),
                    // An unreachable record that does not decode: gc's to remove.
                    Ok(true) => match ChunkRecord::decode_header(&record) {
                        Ok(h) => Ok(Some(h)),
                        Err(_) => continue,
                    },
                    Err(e) => Err(e.into()),
                },
            };
            let corrupt = |reason: &str| RepoError::Corrupt {
                site: Site::chunk(id),
                reason: reason.into(),
            };
            let e = match found {
                Ok(Some(h)) if ChunkRecord::decode_header(&head).ok() == Some(h) => continue,
                Ok(Some(_)) => corrupt("its head (index space) disagrees with its record"),
                Ok(None) => corrupt("it has a head (index space) but no record"),
                Err(e) if e.is_corruption() => e,
                Err(e) => return Err(e),
            };
            damage.push(Damage {
                error: e.to_string(),
                object: ObjectRef::Chunk { id },
                place: Place::default(),
                reason: CorruptReason::of(&e),
                path: None,
                commits: Vec::new(),
            });
        }
        Ok(damage)
    }

    /// Check the commits reachable from `roots` (only the newest `depth`
    /// generations when given).
    pub fn fsck_commits(
        &self,
        roots: &[CommitId],
        depth: Option<usize>,
        quick: bool,
    ) -> Result<FsckReport, RepoError> {
        self.fsck_walk(roots, depth, quick, false)
    }

    /// [`fsck_commits`](Self::fsck_commits), and with `heads` every chunk
    /// head checked too (a whole-repository check).
    fn fsck_walk(
        &self,
        roots: &[CommitId],
        depth: Option<usize>,
        quick: bool,
        heads: bool,
    ) -> Result<FsckReport, RepoError> {
        let reach = self.reachable(
            roots,
            WalkOptions {
                chunk_headers: true,
                frame_headers: quick,
                depth,
            },
        )?;
        let mut report = FsckReport {
            commits: reach.commits.len(),
            manifests: reach.manifests.len(),
            chunks: reach.headers.len(),
            ..FsckReport::default()
        };
        // Which commits contain which manifest, and their steps.
        let mut holders: HashMap<ObjectId, Vec<(CommitId, u64)>> = HashMap::new();
        for (c, (tree, step)) in &reach.commit_info {
            for mid in reach.tree_manifests.get(tree).into_iter().flatten() {
                holders.entry(*mid).or_default().push((*c, *step));
            }
        }
        for (object, place, e) in &reach.damage {
            report.damage.push(Damage {
                error: e.to_string(),
                object: object.clone(),
                place: place.clone(),
                reason: CorruptReason::of(e),
                path: None,
                commits: Vec::new(),
            });
        }
        // Damaged chunks (headers, and with `quick` codec frame headers):
        // with `quick` reported per file that uses them; the full check
        // finds them again while reassembling files, with the tensor named.
        let bad_chunks: HashMap<ChunkId, &RepoError> =
            reach.chunk_damage.iter().map(|(id, e)| (*id, e)).collect();
        if !quick {
            // Each path's versions in history order, so every delta's base
            // (the previous version's chunk) is usually decoded already.
            let pos: HashMap<CommitId, usize> = reach
                .commits
                .iter()
                .enumerate()
                .map(|(i, c)| (*c, i))
                .collect();
            let mut by_path: BTreeMap<&str, Vec<Version>> = BTreeMap::new();
            for (mid, (commit, path)) in &reach.manifests {
                by_path.entry(path.as_str()).or_default().push((
                    pos.get(commit).copied().unwrap_or(0),
                    mid,
                    commit,
                ));
            }
            let paths: Vec<(&str, Vec<Version>)> = by_path
                .into_iter()
                .map(|(p, mut v)| {
                    v.sort();
                    (p, v)
                })
                .collect();
            let results: Vec<Result<(u64, Vec<Damage>), RepoError>> = paths
                .par_iter()
                .map(|(path, versions)| {
                    let mut prev: HashMap<ChunkId, Vec<u8>> = HashMap::new();
                    let (mut bytes, mut damage) = (0u64, Vec::new());
                    for (_, mid, commit) in versions {
                        let m = match self.manifest(mid, path) {
                            Ok(m) => m,
                            Err(e) if e.is_corruption() => continue, // reported by the walk
                            Err(e) => return Err(e),
                        };
                        let step = reach.commit_info.get(*commit).map_or(0, |i| i.1);
                        let mut next: HashMap<ChunkId, Vec<u8>> = HashMap::new();
                        let mut kept = 0usize;
                        let mut failed: Option<ChunkId> = None;
                        let r = self.stream_file(
                            &m,
                            path,
                            commit,
                            step,
                            |id| {
                                let r = self.read_chunk_cached(id, &prev);
                                if r.is_err() {
                                    failed = Some(*id);
                                }
                                r
                            },
                            |id, raw| {
                                if kept + raw.len() <= FSCK_CACHE_BYTES {
                                    kept += raw.len();
                                    next.insert(*id, raw);
                                }
                                Ok(())
                            },
                        );
                        match r {
                            Ok(()) => bytes += m.len,
                            Err(e) if e.is_corruption() => {
                                let (object, tensor) = match failed {
                                    Some(id) => (ObjectRef::Chunk { id }, tensor_of(&m, &id)),
                                    None => (
                                        ObjectRef::Manifest {
                                            id: **mid,
                                            path: path.to_string(),
                                        },
                                        None,
                                    ),
                                };
                                damage.push(Damage {
                                    error: e.to_string(),
                                    object,
                                    place: Place {
                                        commit: Some(**commit),
                                        step: Some(step),
                                        file: Some(path.to_string()),
                                        tensor,
                                    },
                                    reason: CorruptReason::of(&e),
                                    path: Some(path.to_string()),
                                    commits: holders.get(*mid).cloned().unwrap_or_default(),
                                })
                            }
                            Err(e) => return Err(e),
                        }
                        prev = next;
                    }
                    Ok((bytes, damage))
                })
                .collect();
            for r in results {
                let (bytes, damage) = r?;
                report.verified_bytes += bytes;
                report.damage.extend(damage);
            }
        }
        if quick {
            // Attribute damaged chunks to the files using them.
            let mut per_file: BTreeMap<String, Damage> = BTreeMap::new();
            for (mid, (commit, path)) in &reach.manifests {
                let Ok(m) = self.manifest(mid, path) else {
                    continue;
                };
                let first_bad = m.segments.iter().flat_map(|s| s.chunks()).find_map(|c| {
                    match bad_chunks.get(c) {
                        Some(e) => Some((*c, e.to_string(), CorruptReason::of(e))),
                        None => (!reach.headers.contains_key(c)).then(|| {
                            let error = format!("chunk {} is missing", c.short(12));
                            (*c, error, CorruptReason::Missing)
                        }),
                    }
                });
                if let Some((id, error, reason)) = first_bad {
                    let d = per_file.entry(path.clone()).or_insert_with(|| Damage {
                        error,
                        object: ObjectRef::Chunk { id },
                        place: chunk_place(&reach, &id, commit, path, &m),
                        reason,
                        path: Some(path.clone()),
                        commits: Vec::new(),
                    });
                    d.commits
                        .extend(holders.get(mid).cloned().unwrap_or_default());
                }
            }
            report.damage.extend(per_file.into_values());
        }
        if heads {
            report.damage.extend(self.check_heads(&reach)?);
        }
        for d in &mut report.damage {
            d.commits.sort_by_key(|c| (c.1, c.0));
            d.commits.dedup();
        }
        Ok(report)
    }

    /// Verify one commit's files completely (no history).
    pub fn verify_commit(&self, id: &CommitId) -> Result<FsckReport, RepoError> {
        self.fsck_commits(&[*id], Some(1), false)
    }

    /// The newest commit before `id` on its first-parent line whose files
    /// all verify, with its step: where to fall back to when `id` is
    /// damaged.
    pub fn newest_intact_before(
        &self,
        id: &CommitId,
    ) -> Result<Option<(CommitId, u64)>, RepoError> {
        let mut cur = match self.commit_object(id) {
            Ok(c) => c.parents.first().copied(),
            Err(e) if e.is_corruption() => None,
            Err(e) => return Err(e),
        };
        while let Some(c) = cur {
            let commit = match self.commit_object(&c) {
                Ok(commit) => commit,
                Err(e) if e.is_corruption() => return Ok(None),
                Err(e) => return Err(e),
            };
            if self.verify_commit(&c)?.is_clean() {
                return Ok(Some((c, commit.step)));
            }
            cur = commit.parents.first().copied();
        }
        Ok(None)
    }
}
