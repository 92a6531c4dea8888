//! `show`: one commit's metadata, files, tensors and how they are stored.
//!
//! Reads the commit, its tree, every manifest and every chunk *record* (to
//! learn its stored size, delta base and chain depth); it never decodes a
//! chunk payload, so it costs one store read per distinct chunk and no
//! codec work. Returns data only: the CLI prints.

use std::collections::HashMap;

use crate::codec::DType;
use crate::format::FileKind;
use crate::store::{ChunkId, CommitId, Space, StoreExt};

use super::objects::{corrupt, ChunkRecord, Commit, SegmentRef};
use super::{RepoError, Repository};

/// What `show` reports about one commit.
#[derive(Debug, Clone)]
pub struct ShowReport {
    pub id: CommitId,
    /// Step, branch, parents, time, message, metrics and commit-time stats.
    pub commit: Commit,
    /// In tree order (sorted by path).
    pub files: Vec<FileShow>,
}

/// One file of a commit.
#[derive(Debug, Clone)]
pub struct FileShow {
    pub path: String,
    pub kind: FileKind,
    pub len: u64,
    /// blake3 of the whole file.
    pub hash: [u8; 32],
    /// Unix permission bits.
    pub mode: u32,
    /// In file order.
    pub segments: Vec<SegmentShow>,
}

impl FileShow {
    /// The whole-file blake3 in hex.
    pub fn hash_hex(&self) -> String {
        crate::store::to_hex(&self.hash)
    }

    /// The file's tensors, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorShow> {
        self.segments.iter().filter_map(|s| match s {
            SegmentShow::Tensor(t) => Some(t),
            SegmentShow::Opaque { .. } => None,
        })
    }

    /// What all the file's segments occupy in the store.
    pub fn storage(&self) -> Storage {
        self.segments.iter().fold(Storage::default(), |acc, s| {
            let st = match s {
                SegmentShow::Tensor(t) => &t.storage,
                SegmentShow::Opaque { storage, .. } => storage,
            };
            acc.merge(st)
        })
    }
}

/// One segment of a file.
#[derive(Debug, Clone)]
pub enum SegmentShow {
    Tensor(TensorShow),
    /// Bytes that are not tensor data (headers, pickles, json, ...).
    Opaque {
        bytes: u64,
        storage: Storage,
    },
}

/// One tensor of a file.
#[derive(Debug, Clone)]
pub struct TensorShow {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Raw bytes of the tensor data.
    pub bytes: u64,
    pub storage: Storage,
}

/// How a segment's chunks are stored.
///
/// A chunk shared with other segments or commits is counted in full for
/// each segment that names it (a chunk named twice within one segment is
/// counted twice), so sizes are "what this segment needs", not "what this
/// commit added" (that is [`super::objects::CommitStats::stored_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Storage {
    /// Number of chunks.
    pub chunks: u64,
    /// Chunks stored as a delta against a base chunk.
    pub delta_chunks: u64,
    /// Deepest delta chain among the chunks (0: all stored full).
    pub max_depth: u16,
    /// Sum of the sizes of the chunk records in the store (header and
    /// encoded payload).
    pub stored_bytes: u64,
}

impl Storage {
    /// True when at least one chunk is a delta.
    pub fn is_delta(&self) -> bool {
        self.delta_chunks > 0
    }

    fn merge(self, o: &Storage) -> Storage {
        Storage {
            chunks: self.chunks + o.chunks,
            delta_chunks: self.delta_chunks + o.delta_chunks,
            max_depth: self.max_depth.max(o.max_depth),
            stored_bytes: self.stored_bytes + o.stored_bytes,
        }
    }
}

/// What one chunk record says about its storage.
#[derive(Debug, Clone, Copy)]
struct RecordInfo {
    size: u64,
    delta: bool,
    depth: u16,
}

impl Repository {
    /// The metadata, files, tensors and storage of `commit`.
    pub fn show(&self, commit: &CommitId) -> Result<ShowReport, RepoError> {
        let c = self.commit_object(commit)?;
        let files = self.file_shows(&c, true)?;
        Ok(ShowReport {
            id: *commit,
            commit: c,
            files,
        })
    }

    /// The files of `commit` with their tensors (name, dtype, shape, bytes)
    /// in tree order, as [`Repository::show`] lists them but without
    /// reading a chunk record: every [`Storage`] is left empty
    /// (`Storage::default()`), so this costs one read per manifest.
    pub fn list_files(&self, commit: &CommitId) -> Result<Vec<FileShow>, RepoError> {
        let c = self.commit_object(commit)?;
        self.file_shows(&c, false)
    }

    /// Every file of commit `c`; with `storage`, each segment's chunk
    /// records are read for its [`Storage`].
    fn file_shows(&self, c: &Commit, storage: bool) -> Result<Vec<FileShow>, RepoError> {
        let tree = self.tree(&c.tree)?;
        // Chunks recur (zero-filled tensors, identical opaque headers):
        // read each record once.
        let mut seen: HashMap<ChunkId, RecordInfo> = HashMap::new();
        let mut files = Vec::with_capacity(tree.entries.len());
        for (path, mid) in &tree.entries {
            let m = self.manifest(mid, path)?;
            let mut segments = Vec::with_capacity(m.segments.len());
            for seg in &m.segments {
                let storage = if storage {
                    self.storage_of(seg.chunks(), &mut seen, path)?
                } else {
                    Storage::default()
                };
                segments.push(match seg {
                    SegmentRef::Tensor {
                        name,
                        dtype,
                        shape,
                        len,
                        ..
                    } => SegmentShow::Tensor(TensorShow {
                        name: name.clone(),
                        dtype: *dtype,
                        shape: shape.clone(),
                        bytes: *len,
                        storage,
                    }),
                    SegmentRef::Opaque { len, .. } => SegmentShow::Opaque {
                        bytes: *len,
                        storage,
                    },
                });
            }
            files.push(FileShow {
                path: path.clone(),
                kind: m.kind,
                len: m.len,
                hash: m.hash,
                mode: m.mode,
                segments,
            });
        }
        Ok(files)
    }

    fn storage_of(
        &self,
        chunks: &[ChunkId],
        seen: &mut HashMap<ChunkId, RecordInfo>,
        path: &str,
    ) -> Result<Storage, RepoError> {
        let mut s = Storage::default();
        for id in chunks {
            let info = match seen.get(id) {
                Some(i) => *i,
                None => {
                    let site = || {
                        super::Site::chunk(*id).with_place(super::Place {
                            file: Some(path.to_string()),
                            ..Default::default()
                        })
                    };
                    let bytes = self
                        .store
                        .get_vec(Space::Chunks, id.as_bytes())?
                        .ok_or_else(|| RepoError::Missing { site: site() })?;
                    let rec = ChunkRecord::decode(&bytes).map_err(corrupt(site()))?;
                    let info = RecordInfo {
                        size: bytes.len() as u64,
                        delta: rec.base.is_some(),
                        depth: rec.depth,
                    };
                    seen.insert(*id, info);
                    info
                }
            };
            s.chunks += 1;
            s.delta_chunks += u64::from(info.delta);
            s.max_depth = s.max_depth.max(info.depth);
            s.stored_bytes += info.size;
        }
        Ok(s)
    }
}

impl Repository {
    /// The parameter names of the optimizer state tensors (`state.<i>.…`)
    /// of torch zip file `path` of `commit`, index -> name, when the file
    /// itself records them (every param group lists `param_names`, as
    /// torch >= 2.6 saves for an optimizer given named parameters). `None`
    /// otherwise: no `state.` tensors, names not recorded (transformers'
    /// Trainer passes bare parameters, and a model file cannot tell which
    /// index is which: safetensors sorts its keys and the Trainer orders
    /// the indices by weight-decay group), or a pickle that does not
    /// parse. Display only: nothing is stored. Reads only the file's opaque
    /// segments (the zip directory and the pickle; each chunk verified
    /// against its id), never its tensor data.
    pub fn optimizer_param_names(
        &self,
        commit: &CommitId,
        path: &str,
    ) -> Result<Option<std::collections::BTreeMap<u64, String>>, RepoError> {
        let (m, _) = self.manifest_at(commit, path)?;
        let has_state = m
            .segments
            .iter()
            .any(|s| matches!(s, SegmentRef::Tensor { name, .. } if name.starts_with("state.")));
        let opaque_len: u64 = m
            .segments
            .iter()
            .filter(|s| matches!(s, SegmentRef::Opaque { .. }))
            .map(SegmentRef::len)
            .sum();
        if m.kind != FileKind::TorchZip || !has_state || opaque_len > PARAM_NAMES_MAX_OPAQUE {
            return Ok(None);
        }
        let mut opaque = Vec::new();
        let mut at = 0u64;
        for seg in &m.segments {
            if let SegmentRef::Opaque { chunks, .. } = seg {
                let mut bytes = Vec::new();
                for id in chunks {
                    bytes.extend_from_slice(&self.read_chunk(id)?);
                }
                opaque.push((at, bytes));
            }
            at += seg.len();
        }
        let mut file = OpaqueOnly {
            parts: opaque,
            len: m.len,
            pos: 0,
        };
        Ok(crate::format::optimizer_param_names(&mut file, m.len)
            .ok()
            .flatten())
    }
}

/// Files whose opaque bytes (zip directory, pickle, anything not a tensor)
/// exceed this are not read for optimizer parameter names (a display hint
/// is not worth decoding that much).
const PARAM_NAMES_MAX_OPAQUE: u64 = 256 << 20;

/// A file of which only the opaque segments were read: reads of tensor
/// bytes give zeros (the zip and pickle readers never look at them).
struct OpaqueOnly {
    /// (offset, bytes) of each opaque segment, in file order.
    parts: Vec<(u64, Vec<u8>)>,
    len: u64,
    pos: u64,
}

impl std::io::Read for OpaqueOnly {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (self.len.saturating_sub(self.pos)).min(buf.len() as u64) as usize;
        let out = &mut buf[..n];
        out.fill(0);
        let (start, end) = (self.pos, self.pos + n as u64);
        for (off, bytes) in &self.parts {
            let (lo, hi) = (start.max(*off), end.min(off + bytes.len() as u64));
            if lo < hi {
                out[(lo - start) as usize..(hi - start) as usize]
                    .copy_from_slice(&bytes[(lo - off) as usize..(hi - off) as usize]);
            }
        }
        self.pos = end;
        Ok(n)
    }
}

impl std::io::Seek for OpaqueOnly {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        let pos = match to {
            std::io::SeekFrom::Start(p) => Some(p),
            std::io::SeekFrom::End(d) => self.len.checked_add_signed(d),
            std::io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}
