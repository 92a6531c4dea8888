//! Objects in and out of the repository for another one: the stored
//! encodings of objects and chunk records by id, for a push
//! ([`Repository::object_bytes`]), and a verified import for a fetch or a
//! clone ([`Repository::import`], [`Import`]).
//!
//! Owns the rules that keep an import safe: every object hashes to its
//! id and decodes before it is staged; every chunk record is decoded
//! through its delta chain with the repository's own decode path
//! (`chain.rs`, bounded) and checked against its blake3 id before it is
//! written; chunk records go to the store in unlogged batches first, then
//! the objects, the ref moves and the shallow list in one atomic batch, so
//! an import interrupted anywhere leaves at most unreferenced chunks (gc's
//! grace period covers them: their write time is the import's).
//!
//! Must not: know where the bytes come from (packs, remotes); the caller
//! stages them and names their origin.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::codec::{self, Scratch};
use crate::store::{Batch, ChunkId, CommitId, ObjectId, Space};

use super::chain::{decode_chain, Link};
use super::commit::{encode_record, now_secs};
use super::objects::{
    chunk_head_key, corrupt, object_key, stored_head, ChunkRecord, Commit, FileManifest, Payload,
    Tree, KIND_COMMIT, KIND_MANIFEST, KIND_TREE,
};
use super::reach::TensorPlace;
use super::remotes::tracking_ref;
use super::{ObjectRef, Place, RepoError, Repository, Site, SHALLOW};

/// Imported chunk records are written to the store in batches of about
/// this many bytes.
const BATCH_BYTES: usize = 64 << 20;

/// The kinds of stored objects a transfer moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectKind {
    /// A chunk record; its id is the blake3 of the raw chunk.
    Chunk,
    /// A file manifest; its id is the blake3 of its encoding, as are the
    /// next two.
    Manifest,
    Tree,
    Commit,
}

impl ObjectKind {
    pub fn name(self) -> &'static str {
        match self {
            ObjectKind::Chunk => "chunk",
            ObjectKind::Manifest => "manifest",
            ObjectKind::Tree => "tree",
            ObjectKind::Commit => "commit",
        }
    }

    /// The object of this kind with id `id` (a manifest's path is not
    /// known from its id alone: empty).
    pub fn object_ref(self, id: &[u8; 32]) -> ObjectRef {
        match self {
            ObjectKind::Chunk => ObjectRef::Chunk {
                id: ChunkId::from_bytes(*id),
            },
            ObjectKind::Manifest => ObjectRef::Manifest {
                id: ObjectId::from_bytes(*id),
                path: String::new(),
            },
            ObjectKind::Tree => ObjectRef::Tree {
                id: ObjectId::from_bytes(*id),
            },
            ObjectKind::Commit => ObjectRef::Commit {
                id: CommitId::from_bytes(*id),
            },
        }
    }

    /// Where an object of this kind is stored.
    fn key(self, id: &[u8; 32]) -> (Space, Vec<u8>) {
        let object = |kind| object_key(kind, &ObjectId::from_bytes(*id)).to_vec();
        match self {
            ObjectKind::Chunk => (Space::Chunks, id.to_vec()),
            ObjectKind::Manifest => (Space::Objects, object(KIND_MANIFEST)),
            ObjectKind::Tree => (Space::Objects, object(KIND_TREE)),
            ObjectKind::Commit => (Space::Objects, object(KIND_COMMIT)),
        }
    }
}

impl Repository {
    /// Whether an object (or chunk record) is stored.
    pub fn has_object(&self, kind: ObjectKind, id: &[u8; 32]) -> Result<bool, RepoError> {
        if kind == ObjectKind::Chunk {
            return self.has_chunk(&ChunkId::from_bytes(*id));
        }
        let (space, key) = kind.key(id);
        Ok(self.store.contains(space, &key)?)
    }

    /// The stored encoding of an object (or chunk record) into `buf`
    /// (replacing what it held); `false` when it is not stored. The bytes
    /// are not verified here: a receiver verifies them
    /// ([`Repository::import`]), and a sender proves its history first
    /// ([`Repository::reachable`] with chunk headers).
    pub fn object_bytes(
        &self,
        kind: ObjectKind,
        id: &[u8; 32],
        buf: &mut Vec<u8>,
    ) -> Result<bool, RepoError> {
        let (space, key) = kind.key(id);
        Ok(self.store.get(space, &key, buf)?)
    }

    /// Start importing objects received from elsewhere; `from` names their
    /// origin in errors (`"received from the remote"`), `max_chunk_raw`
    /// bounds the raw size any incoming chunk record may declare. Nothing
    /// but verified chunk records is written before [`Import::commit`].
    pub fn import(&self, from: &str, max_chunk_raw: u64) -> Import<'_> {
        Import {
            repo: self,
            from: from.into(),
            max_chunk_raw,
            written: now_secs(),
            objects: Batch::new(),
            shallow: Vec::new(),
            chunks: Mutex::new(unlogged_batch()),
            heads: Mutex::new(Vec::new()),
            reencoded: AtomicU64::new(0),
            chunk_count: AtomicU64::new(0),
            depths: Mutex::new(HashMap::new()),
        }
    }
}

/// Where an incoming chunk's delta base is (see [`Import::add_chunk`]).
pub enum ImportBase<'a> {
    /// Raw bytes verified earlier in this import.
    Verified(&'a [u8]),
    /// The encoded record of another incoming chunk: decoded through its
    /// own chain and verified here.
    Record(Vec<u8>),
}

/// A verified import in progress (see [`Repository::import`]). Dropping it
/// without [`commit`](Import::commit) leaves only unreferenced chunk
/// records behind.
pub struct Import<'r> {
    repo: &'r Repository,
    from: String,
    max_chunk_raw: u64,
    /// The write time imported records get (gc's grace period covers them
    /// until the final batch references them).
    written: u64,
    /// Objects, ref moves and the shallow list: the final atomic batch.
    objects: Batch,
    shallow: Vec<CommitId>,
    /// Verified chunk records not written yet.
    chunks: Mutex<Batch>,
    /// The heads of the chunk records staged, for the final batch (after
    /// the flush that makes their records durable).
    heads: Mutex<Vec<(ChunkId, Vec<u8>)>>,
    reencoded: AtomicU64,
    chunk_count: AtomicU64,
    /// The delta depth each imported chunk is stored with.
    depths: Mutex<HashMap<ChunkId, u16>>,
}

/// An error about received bytes (not about the local repository).
fn received(e: RepoError) -> RepoError {
    RepoError::Received(Box::new(e))
}

fn unlogged_batch() -> Batch {
    let mut b = Batch::new();
    b.unlogged();
    b
}

impl Import<'_> {
    /// The site of incoming object `object` used at `place`.
    fn site(&self, object: ObjectRef, place: Place) -> Box<Site> {
        Site::of(object).with_place(place).received(&self.from)
    }

    /// Check that `bytes` hash to `id` and stage them under `key`.
    fn stage(
        &mut self,
        key: &[u8],
        id: &ObjectId,
        bytes: Vec<u8>,
        site: Box<Site>,
    ) -> Result<(), RepoError> {
        if ObjectId::digest(&bytes) != *id {
            return Err(RepoError::Corrupt {
                site,
                reason: "content does not match its id".into(),
            });
        }
        self.objects.put(Space::Objects, key, bytes);
        Ok(())
    }

    /// Stage an incoming commit; returns it decoded.
    pub fn add_commit(&mut self, id: &CommitId, bytes: Vec<u8>) -> Result<Commit, RepoError> {
        let site = self.site(ObjectRef::Commit { id: *id }, Place::default());
        let commit = Commit::decode(&bytes)
            .map_err(super::objects::corrupt(site.clone()))
            .map_err(received)?;
        let oid = ObjectId::from_bytes(*id.as_bytes());
        self.stage(&object_key(KIND_COMMIT, &oid), &oid, bytes, site)
            .map_err(received)?;
        Ok(commit)
    }

    /// Stage the incoming tree of commit `of`; returns it decoded.
    pub fn add_tree(
        &mut self,
        id: &ObjectId,
        bytes: Vec<u8>,
        of: &CommitId,
    ) -> Result<Tree, RepoError> {
        let site = self.site(
            ObjectRef::Tree { id: *id },
            Place {
                commit: Some(*of),
                ..Place::default()
            },
        );
        let tree = Tree::decode(&bytes)
            .map_err(super::objects::corrupt(site.clone()))
            .map_err(received)?;
        self.stage(&object_key(KIND_TREE, id), id, bytes, site)
            .map_err(received)?;
        Ok(tree)
    }

    /// Stage the incoming manifest of file `path` in commit `of`; returns
    /// it decoded.
    pub fn add_manifest(
        &mut self,
        id: &ObjectId,
        bytes: Vec<u8>,
        path: &str,
        of: &CommitId,
    ) -> Result<FileManifest, RepoError> {
        let site = self.site(
            ObjectRef::Manifest {
                id: *id,
                path: path.to_string(),
            },
            Place {
                commit: Some(*of),
                file: Some(path.to_string()),
                ..Place::default()
            },
        );
        let m = FileManifest::decode(&bytes)
            .map_err(super::objects::corrupt(site.clone()))
            .map_err(received)?;
        self.stage(&object_key(KIND_MANIFEST, id), id, bytes, site)
            .map_err(received)?;
        Ok(m)
    }

    /// Verify an incoming chunk record and stage it; returns the chunk's
    /// raw bytes. The record is decoded through its delta chain: `base`
    /// says, for each base, whether its bytes were verified earlier in this
    /// import or which incoming record holds it (`None`: the local store
    /// has it, read and verified there). With `keyframe` the chunk is
    /// stored re-encoded without a base (its base is left behind, as in a
    /// shallow fetch), knowing its rows from `place` (where a manifest
    /// puts it in a tensor) as a commit would; otherwise its record is
    /// stored as received, stamped with the import's write time. Safe to
    /// call from several threads.
    #[allow(clippy::too_many_arguments)]
    pub fn add_chunk<'a, E>(
        &self,
        id: &ChunkId,
        record: &[u8],
        keyframe: bool,
        place: Option<&TensorPlace>,
        mut base: impl FnMut(&ChunkId) -> Result<Option<ImportBase<'a>>, E>,
        scratch: &mut Scratch,
    ) -> Result<Vec<u8>, E>
    where
        E: From<RepoError>,
    {
        let decode = |c: &ChunkId, bytes: &[u8]| {
            ChunkRecord::decode(bytes)
                .map_err(super::objects::corrupt(
                    self.site(ObjectRef::Chunk { id: *c }, Place::default()),
                ))
                .map_err(received)
        };
        let rec = decode(id, record)?;
        let (raw, mut rec) = decode_chain(
            id,
            rec,
            self.max_chunk_raw,
            &self.from,
            &self.repo.pool,
            received,
            |b| {
                Ok::<_, E>(match base(b)? {
                    Some(ImportBase::Verified(raw)) => Link::Raw(raw.into()),
                    Some(ImportBase::Record(bytes)) => Link::Record(decode(b, &bytes)?),
                    None => Link::Raw(self.repo.read_chunk(b)?.into()),
                })
            },
        )?;
        let bytes = if keyframe {
            let dtype = match rec.payload {
                Payload::Codec => Some(
                    codec::FrameInfo::parse(&rec.data)
                        .map_err(|source| {
                            received(RepoError::Decode {
                                site: self.site(ObjectRef::Chunk { id: *id }, Place::default()),
                                source,
                            })
                        })?
                        .dtype,
                ),
                Payload::Zstd => None,
            };
            self.reencoded.fetch_add(1, Ordering::Relaxed);
            let level = self.repo.config.zstd_level;
            let rows = self.repo.keyframe_rows(dtype, place, raw.len());
            let mut whole = encode_record(&raw, dtype, rows, None, level, scratch)?;
            whole.written = self.written;
            whole.encode()
        } else {
            // The depth the record claims is the sender's; a commit here
            // trusts stored depths to bound delta chains (`max_chain`), so
            // it is set to the real one: the base's as stored here, plus
            // one (a lie, or a base stored deeper here, would understate
            // it and let chains grow past every bound).
            rec.depth = match rec.base {
                Some(b) => self.stored_depth(&b)?.saturating_add(1),
                None => 0,
            };
            rec.written = self.written;
            rec.encode()
        };
        let depth = if keyframe { 0 } else { rec.depth };
        self.depths
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(*id, depth);
        self.chunk_count.fetch_add(1, Ordering::Relaxed);
        if let Some(head) = stored_head(&bytes).map_err(corrupt(Site::chunk(*id)))? {
            self.heads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((*id, head.to_vec()));
        }
        let full = {
            let mut b = self.chunks.lock().unwrap_or_else(|e| e.into_inner());
            b.put(Space::Chunks, id.as_bytes(), bytes);
            (b.payload_bytes() >= BATCH_BYTES).then(|| std::mem::replace(&mut *b, unlogged_batch()))
        };
        if let Some(full) = full {
            self.repo.store.write(full).map_err(RepoError::from)?;
        }
        Ok(raw)
    }

    /// The delta depth chunk `id` is stored with: as imported here, else as
    /// the local store has it.
    fn stored_depth(&self, id: &ChunkId) -> Result<u16, RepoError> {
        let imported = self
            .depths
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .copied();
        if let Some(d) = imported {
            return Ok(d);
        }
        Ok(match self.repo.chunk_head(id)? {
            Some(h) => h.depth,
            None => self.repo.chunk_header(id)?.depth,
        })
    }

    /// Chunks stored re-encoded without their base so far.
    pub fn reencoded(&self) -> u64 {
        self.reencoded.load(Ordering::Relaxed)
    }

    /// Point `refs/remotes/<remote>/<branch>` at `new` in the final batch,
    /// if it is still at `old` then (logged as `op`).
    pub fn set_remote_ref(
        &mut self,
        remote: &str,
        branch: &str,
        old: Option<&CommitId>,
        new: &CommitId,
        op: &str,
    ) {
        self.repo.move_ref(
            &mut self.objects,
            &tracking_ref(remote, branch),
            old,
            Some(new),
            op,
        );
    }

    /// Record commits whose parents this import leaves behind (a shallow
    /// fetch): history walks stop at them.
    pub fn add_shallow(&mut self, commits: &[CommitId]) {
        self.shallow.extend_from_slice(commits);
    }

    /// Write what was staged: the remaining chunk records (made durable
    /// first), then the objects, ref moves and shallow list in one atomic
    /// batch.
    pub fn commit(mut self) -> Result<(), RepoError> {
        let store = &self.repo.store;
        let chunks = self.chunks.into_inner().unwrap_or_else(|e| e.into_inner());
        if !chunks.is_empty() {
            store.write(chunks)?;
        }
        if self.chunk_count.load(Ordering::Relaxed) > 0 {
            store.flush()?;
        }
        let heads = self.heads.into_inner().unwrap_or_else(|e| e.into_inner());
        for (id, head) in heads {
            self.objects.put(Space::Index, &chunk_head_key(&id), head);
        }
        if !self.shallow.is_empty() {
            let mut all: Vec<CommitId> = self.repo.shallow()?.into_iter().collect();
            all.append(&mut self.shallow);
            all.sort();
            all.dedup();
            self.objects.put(
                Space::Meta,
                SHALLOW,
                all.iter().flat_map(|c| c.0).collect::<Vec<u8>>(),
            );
        }
        store.write(self.objects)?;
        store.flush()?;
        Ok(())
    }
}
