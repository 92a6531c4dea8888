//! Reachability: which stored objects a set of commits needs. One walk
//! serves gc (mark), fsck (what to prove), and transfers (what the other
//! side lacks): commits through their parents, each commit's tree, the
//! trees' file manifests, the manifests' chunks, and the chunks' delta
//! bases, transitively.
//!
//! The walk never stops at the first damaged object: it records what it
//! could not read (with the commit and file that name it) and goes on, so
//! fsck can report everything and gc can refuse to sweep a damaged graph.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::codec::{DType, FrameInfo, Rows};
use crate::store::{ChunkId, CommitId, ObjectId, Space};

use super::chain::base_chain;
use super::objects::{corrupt, ChunkHeader, ChunkRecord, Commit, Payload, SegmentRef};
use super::{ObjectRef, Place, RepoError, Repository, Site};

/// Where a chunk is used: the first file and tensor found naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkUse {
    pub commit: CommitId,
    pub path: String,
    /// The tensor's name; `None` for opaque bytes (headers, pickles, blobs).
    pub tensor: Option<String>,
    pub dtype: Option<DType>,
    /// Where in that tensor the chunk is (`None` for opaque bytes).
    pub place: Option<TensorPlace>,
}

/// A chunk's place in its tensor: the tensor's shape and length in
/// bytes, the chunk's index and how many chunks the tensor has (every one
/// but the last equally long).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlace {
    pub shape: Vec<u64>,
    pub len: u64,
    pub index: usize,
    pub count: usize,
}

impl TensorPlace {
    /// The place of chunk `index` of `seg`, for a tensor segment (none
    /// for opaque bytes).
    pub fn at(seg: &SegmentRef, index: usize) -> Option<TensorPlace> {
        match seg {
            SegmentRef::Tensor {
                shape, len, chunks, ..
            } => Some(TensorPlace {
                shape: shape.clone(),
                len: *len,
                index,
                count: chunks.len(),
            }),
            SegmentRef::Opaque { .. } => None,
        }
    }

    /// The chunk's rows in its tensor ([`Rows::of_chunk`]), given its
    /// raw length and the tensor's dtype: the last chunk ends the tensor,
    /// every other starts at its index times its length.
    pub fn rows(&self, dtype: DType, raw_len: u64) -> Option<Rows> {
        let at = if self.index + 1 == self.count {
            self.len.checked_sub(raw_len)?
        } else {
            (self.index as u64).checked_mul(raw_len)?
        };
        Rows::of_chunk(&self.shape, at / dtype.width() as u64)
    }
}

/// Everything a set of root commits needs, and what of it is damaged.
#[derive(Debug, Default)]
pub struct Reachable {
    /// Every reachable commit, parents before children.
    pub commits: Vec<CommitId>,
    /// Tree of each commit.
    pub trees: HashSet<ObjectId>,
    /// Tree and step of each reachable commit.
    pub commit_info: HashMap<CommitId, (ObjectId, u64)>,
    /// The manifests each readable tree names.
    pub tree_manifests: HashMap<ObjectId, Vec<ObjectId>>,
    /// Every reachable file manifest, with the first (commit, path) naming it.
    pub manifests: HashMap<ObjectId, (CommitId, String)>,
    /// Chunks named by manifests, with where they are used.
    pub chunks: HashMap<ChunkId, ChunkUse>,
    /// Chunk headers of `chunks` and of all their delta bases (filled by
    /// [`Repository::reachable`] when asked for chunk headers).
    pub headers: HashMap<ChunkId, ChunkHeader>,
    /// Commits, trees and manifests that could not be read, in the order
    /// found: the object, the commit (and file) naming it, the error.
    pub damage: Vec<(ObjectRef, Place, RepoError)>,
    /// Chunks (named or bases) whose record could not be read or is
    /// malformed, with the error naming where they are used.
    pub chunk_damage: Vec<(ChunkId, RepoError)>,
}

impl Reachable {
    /// Every chunk id needed: named by manifests or a delta base of one.
    pub fn all_chunks(&self) -> impl Iterator<Item = &ChunkId> {
        self.chunks
            .keys()
            .chain(self.headers.keys().filter(|k| !self.chunks.contains_key(k)))
    }
}

/// How far to walk.
#[derive(Debug, Clone, Copy, Default)]
pub struct WalkOptions {
    /// Read every chunk's header and follow delta bases (reads chunk records).
    pub chunk_headers: bool,
    /// With `chunk_headers`, also parse each codec payload's frame header
    /// (a damaged one is chunk damage).
    pub frame_headers: bool,
    /// Only the newest `n` commits along parent links from each root
    /// (a shallow history); `None`: all.
    pub depth: Option<usize>,
}

impl Repository {
    /// Walk from `roots`. Damage is collected in [`Reachable::damage`], not
    /// returned as an error; store I/O failures are errors.
    pub fn reachable(&self, roots: &[CommitId], opts: WalkOptions) -> Result<Reachable, RepoError> {
        self.reachable_with(roots, opts, &HashMap::new())
    }

    /// [`reachable`](Self::reachable) with commits not yet stored: those in
    /// `overlay` are taken from it (gc plans rewritten histories this way).
    pub(crate) fn reachable_with(
        &self,
        roots: &[CommitId],
        opts: WalkOptions,
        overlay: &HashMap<CommitId, Commit>,
    ) -> Result<Reachable, RepoError> {
        let mut r = Reachable::default();
        // Breadth first with generation numbers, then order parents first.
        let mut seen: HashMap<CommitId, usize> = HashMap::new();
        let mut queue: VecDeque<(CommitId, usize)> = roots.iter().map(|&c| (c, 0)).collect();
        let mut order = Vec::new();
        let mut parents_of: HashMap<CommitId, Vec<CommitId>> = HashMap::new();
        let shallow = self.shallow()?;
        while let Some((id, gen)) = queue.pop_front() {
            if seen.contains_key(&id) || opts.depth.is_some_and(|d| gen >= d) {
                continue;
            }
            seen.insert(id, gen);
            let stored = match overlay.get(&id) {
                Some(c) => Ok(c.clone()),
                None => self.commit_object(&id),
            };
            let commit = match stored {
                Ok(c) => c,
                Err(e) if e.is_corruption() => {
                    let place = Place {
                        commit: Some(id),
                        ..Place::default()
                    };
                    r.damage.push((ObjectRef::Commit { id }, place, e));
                    continue;
                }
                Err(e) => return Err(e),
            };
            order.push(id);
            // A shallow clone's boundary: its parents were never fetched.
            if !shallow.contains(&id) {
                for p in &commit.parents {
                    queue.push_back((*p, gen + 1));
                }
            }
            parents_of.insert(id, commit.parents.clone());
            r.commit_info.insert(id, (commit.tree, commit.step));
            if !r.trees.insert(commit.tree) {
                continue;
            }
            let tree = match self.tree(&commit.tree) {
                Ok(t) => t,
                Err(e) if e.is_corruption() => {
                    let at = Place {
                        commit: Some(id),
                        step: Some(commit.step),
                        ..Place::default()
                    };
                    let tree = ObjectRef::Tree { id: commit.tree };
                    let e = e.placed(&at);
                    r.damage.push((tree, at, e));
                    continue;
                }
                Err(e) => return Err(e),
            };
            r.tree_manifests
                .insert(commit.tree, tree.entries.iter().map(|(_, m)| *m).collect());
            for (path, mid) in tree.entries {
                if r.manifests.contains_key(&mid) {
                    continue;
                }
                let m = match self.manifest(&mid, &path) {
                    Ok(m) => m,
                    Err(e) if e.is_corruption() => {
                        let at = Place {
                            commit: Some(id),
                            step: Some(commit.step),
                            file: Some(path.clone()),
                            tensor: None,
                        };
                        let m = ObjectRef::Manifest {
                            id: mid,
                            path: path.clone(),
                        };
                        let e = e.placed(&at);
                        r.damage.push((m, at, e));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                for seg in &m.segments {
                    let (tensor, dtype) = match seg {
                        SegmentRef::Tensor { name, dtype, .. } => (Some(name), Some(*dtype)),
                        SegmentRef::Opaque { .. } => (None, None),
                    };
                    for (index, c) in seg.chunks().iter().enumerate() {
                        r.chunks.entry(*c).or_insert_with(|| ChunkUse {
                            commit: id,
                            path: path.clone(),
                            tensor: tensor.cloned(),
                            dtype,
                            place: TensorPlace::at(seg, index),
                        });
                    }
                }
                r.manifests.insert(mid, (id, path));
            }
        }
        r.commits = parents_first(order, &parents_of);
        if opts.chunk_headers {
            let mut starts: Vec<ChunkId> = r.chunks.keys().copied().collect();
            starts.sort();
            for start in starts {
                if r.headers.contains_key(&start) {
                    continue;
                }
                // This walk's headers join `r.headers` after it, so a base
                // read by an earlier walk ends this one, and a cycle within
                // it is caught by the chain walk.
                let mut fresh: Vec<(ChunkId, ChunkHeader)> = Vec::new();
                let mut bad: Option<(ChunkId, RepoError)> = None;
                let walk = base_chain(start, |c| {
                    match self.chunk_header_checked(c, opts.frame_headers) {
                        Ok(h) => {
                            fresh.push((*c, h));
                            Ok(h.base.filter(|b| !r.headers.contains_key(b)))
                        }
                        Err(e) if e.is_corruption() => {
                            bad = Some((*c, e));
                            Ok(None)
                        }
                        Err(e) => Err(e),
                    }
                });
                let mut chain_error = None;
                for step in walk {
                    match step {
                        Ok(_) => {}
                        Err(e) if e.is_corruption() => chain_error = Some(e),
                        Err(e) => return Err(e),
                    }
                }
                r.headers.extend(fresh);
                for (id, e) in bad.into_iter().chain(chain_error.map(|e| (start, e))) {
                    let e = self.chunk_damage(&r, &id, e);
                    r.chunk_damage.push((id, e));
                }
            }
        }
        Ok(r)
    }

    /// Name the file and tensor a damaged chunk belongs to, when known.
    fn chunk_damage(&self, r: &Reachable, id: &ChunkId, e: RepoError) -> RepoError {
        match r.chunks.get(id) {
            Some(u) => e.placed(&Place {
                commit: Some(u.commit),
                step: r.commit_info.get(&u.commit).map(|i| i.1),
                file: Some(u.path.clone()),
                tensor: u.tensor.clone(),
            }),
            // Only a delta base: the chunks based on it carry the places.
            None => e,
        }
    }

    /// A chunk record's header (its payload is read but not copied).
    pub fn chunk_header(&self, id: &ChunkId) -> Result<ChunkHeader, RepoError> {
        self.chunk_header_checked(id, false)
    }

    /// [`chunk_header`](Self::chunk_header), with `frame` also checking
    /// that a codec payload starts with a valid frame header.
    fn chunk_header_checked(&self, id: &ChunkId, frame: bool) -> Result<ChunkHeader, RepoError> {
        // A pool buffer: fsck and gc read every reachable chunk's header.
        let mut bytes = self.pool.take(0);
        let h = self.parse_chunk_header(id, frame, &mut bytes);
        self.pool.put(bytes);
        h
    }

    fn parse_chunk_header(
        &self,
        id: &ChunkId,
        frame: bool,
        bytes: &mut Vec<u8>,
    ) -> Result<ChunkHeader, RepoError> {
        if !self.store.get(Space::Chunks, id.as_bytes(), bytes)? {
            return Err(RepoError::Missing {
                site: Site::chunk(*id),
            });
        }
        let h = ChunkRecord::decode_header(bytes).map_err(corrupt(Site::chunk(*id)))?;
        if frame && h.payload == Payload::Codec {
            FrameInfo::parse(&bytes[h.payload_offset..]).map_err(|source| RepoError::Decode {
                site: Site::chunk(*id),
                source,
            })?;
        }
        Ok(h)
    }

    /// Every root of the repository: branch heads, tags and
    /// remote-tracking refs, plus [`reflog_roots`](Self::reflog_roots)
    /// (`since`: `u64::MAX` for none), sorted and unique.
    pub fn roots(&self, since: u64) -> Result<Vec<CommitId>, RepoError> {
        let mut roots = self.ref_roots()?;
        roots.extend(self.reflog_roots(since)?);
        roots.sort();
        roots.dedup();
        Ok(roots)
    }

    /// The commits refs name: branch heads, tags, remote-tracking refs.
    pub fn ref_roots(&self) -> Result<Vec<CommitId>, RepoError> {
        let mut roots: Vec<CommitId> = self.branches()?.into_iter().map(|(_, c)| c).collect();
        roots.extend(self.tags()?.into_iter().map(|(_, c)| c));
        roots.extend(self.all_remote_refs()?.into_iter().map(|(_, c)| c));
        Ok(roots)
    }

    /// The old and new commits of ref-log entries written after `since`
    /// (Unix seconds; `u64::MAX`: none) that still exist.
    pub fn reflog_roots(&self, since: u64) -> Result<Vec<CommitId>, RepoError> {
        let mut roots = Vec::new();
        if since == u64::MAX {
            return Ok(roots);
        }
        for e in self.reflog(None)? {
            if e.time > since {
                for c in [e.old, e.new].into_iter().flatten() {
                    if self.has_commit(&c)? {
                        roots.push(c);
                    }
                }
            }
        }
        Ok(roots)
    }
}

/// Order `commits` so every commit comes after its parents (those present).
fn parents_first(
    commits: Vec<CommitId>,
    parents: &HashMap<CommitId, Vec<CommitId>>,
) -> Vec<CommitId> {
    let mut out = Vec::with_capacity(commits.len());
    let mut done: HashSet<CommitId> = HashSet::new();
    for root in commits {
        // Iterative post-order: parents, then the commit.
        let mut stack = vec![(root, false)];
        while let Some((c, expanded)) = stack.pop() {
            if done.contains(&c) {
                continue;
            }
            if expanded {
                done.insert(c);
                out.push(c);
                continue;
            }
            stack.push((c, true));
            for p in parents.get(&c).into_iter().flatten() {
                if parents.contains_key(p) && !done.contains(p) {
                    stack.push((*p, false));
                }
            }
        }
    }
    out
}

impl Repository {
    /// The rows a chunk stored whole is encoded with (gc, a shallow
    /// fetch), as a commit gives them: from its place in the tensor naming
    /// it, unless the repository has row frames off.
    pub(crate) fn keyframe_rows(
        &self,
        dtype: Option<DType>,
        place: Option<&TensorPlace>,
        raw_len: usize,
    ) -> Option<Rows> {
        dtype
            .filter(|_| self.config.row_frames)
            .zip(place)
            .and_then(|(dt, p)| p.rows(dt, raw_len as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk but the last starts at its index times its length; the
    /// last ends the tensor; a place that cannot hold the chunk has none.
    #[test]
    fn a_chunks_rows_follow_its_place_in_the_tensor() {
        // 10 rows of 100 f32: chunks of 256 elements, the last 232.
        let place = |index| TensorPlace {
            shape: vec![10, 100],
            len: 4000,
            index,
            count: 4,
        };
        let rows = |index, raw_len| place(index).rows(DType::F32, raw_len);
        assert_eq!(rows(0, 1024), Some(Rows { len: 100, lead: 0 }));
        assert_eq!(rows(1, 1024), Some(Rows { len: 100, lead: 44 }));
        assert_eq!(rows(3, 928), Some(Rows { len: 100, lead: 32 }));
        assert_eq!(rows(3, 5000), None);
        let huge = TensorPlace {
            index: usize::MAX - 1,
            count: usize::MAX,
            ..place(0)
        };
        assert_eq!(huge.rows(DType::F32, u64::MAX), None);
    }
}
