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

use crate::codec::FrameInfo;
use crate::store::{ChunkId, CommitId, ObjectId, Space, StoreExt};

use super::objects::Payload;
use super::reach::WalkOptions;
use super::{RepoError, Repository};

/// What fsck found.
#[derive(Debug, Default)]
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
#[derive(Debug, Clone)]
pub struct Damage {
    /// The error, naming the object (and file and tensor, when known).
    pub error: String,
    /// The file affected, when the damage is inside one.
    pub path: Option<String>,
    /// (commit, step) of every reachable commit containing the damage.
    pub commits: Vec<(CommitId, u64)>,
}

impl Repository {
    /// Check everything reachable from every branch and tag.
    pub fn fsck(&self, quick: bool) -> Result<FsckReport, RepoError> {
        let roots = self.roots(u64::MAX)?;
        self.fsck_commits(&roots, None, quick)
    }

    /// Check the commits reachable from `roots` (only the newest `depth`
    /// generations when given).
    pub fn fsck_commits(
        &self,
        roots: &[CommitId],
        depth: Option<usize>,
        quick: bool,
    ) -> Result<FsckReport, RepoError> {
        let reach = self.reachable(
            roots,
            WalkOptions {
                chunk_headers: true,
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
        let mut steps = HashMap::new();
        for c in &reach.commits {
            let commit = self.commit_object(c)?;
            steps.insert(*c, commit.step);
            if let Ok(tree) = self.tree(&commit.tree) {
                for (_, mid) in tree.entries {
                    holders.entry(mid).or_default().push((*c, commit.step));
                }
            }
        }
        for e in &reach.damage {
            report.damage.push(Damage {
                error: e.to_string(),
                path: None,
                commits: Vec::new(),
            });
        }
        // A damaged chunk: every manifest using it is damaged.
        let mut bad_chunks: HashSet<ChunkId> = HashSet::new();
        if quick {
            for (id, h) in &reach.headers {
                if h.payload == Payload::Codec {
                    if let Some(bytes) = self.store.get_vec(Space::Chunks, id.as_bytes())? {
                        if let Err(e) = FrameInfo::parse(&bytes[h.payload_offset..]) {
                            bad_chunks.insert(*id);
                            let what = match reach.chunks.get(id) {
                                Some(u) => u.describe(),
                                None => "a delta base".into(),
                            };
                            report.damage.push(Damage {
                                error: format!("chunk {} of {what}: {e}", id.short(12)),
                                path: reach.chunks.get(id).map(|u| u.path.clone()),
                                commits: Vec::new(),
                            });
                        }
                    }
                }
            }
        } else {
            let manifests: Vec<(&ObjectId, &(CommitId, String))> = reach.manifests.iter().collect();
            let results: Vec<Result<(u64, Option<Damage>), RepoError>> = manifests
                .par_iter()
                .map(|(mid, (commit, path))| {
                    let m = match self.manifest(mid, path) {
                        Ok(m) => m,
                        Err(e) if e.is_corruption() => return Ok((0, None)),
                        Err(e) => return Err(e),
                    };
                    let step = steps.get(commit).copied().unwrap_or(0);
                    match self.stream_file(&m, path, commit, step, |_| Ok(())) {
                        Ok(()) => Ok((m.len, None)),
                        Err(e) if e.is_corruption() => Ok((
                            0,
                            Some(Damage {
                                error: e.to_string(),
                                path: Some(path.clone()),
                                commits: holders.get(*mid).cloned().unwrap_or_default(),
                            }),
                        )),
                        Err(e) => Err(e),
                    }
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
            let mut per_file: BTreeMap<String, Vec<(CommitId, u64)>> = BTreeMap::new();
            for (mid, (_, path)) in &reach.manifests {
                let Ok(m) = self.manifest(mid, path) else {
                    continue;
                };
                if m.segments
                    .iter()
                    .flat_map(|s| s.chunks())
                    .any(|c| bad_chunks.contains(c) || !reach.headers.contains_key(c))
                {
                    per_file
                        .entry(path.clone())
                        .or_default()
                        .extend(holders.get(mid).cloned().unwrap_or_default());
                }
            }
            for (path, commits) in per_file {
                report.damage.push(Damage {
                    error: format!("{path}: a chunk is missing or damaged"),
                    path: Some(path),
                    commits,
                });
            }
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
