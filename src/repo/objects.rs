//! The repository's stored objects and their byte encodings
//! (`docs/format/objects.md`): chunk records, file manifests, trees and
//! commits. Every encoding starts with a version byte; decoders check every
//! length and return [`RepoError::Corrupt`] instead of panicking.

use crate::codec::DType;
use crate::format::FileKind;
use crate::store::{ChunkId, CommitId, ObjectId};

use super::RepoError;

/// Version byte of every object encoding written by this build (chunk
/// records have their own, [`CHUNK_RECORD_VERSION`]).
pub const OBJECT_VERSION: u8 = 1;
/// Version byte of chunk records written by this build (2 added the write
/// time; version 1 records are still read, as written at time 0).
pub const CHUNK_RECORD_VERSION: u8 = 2;

/// Object kinds: the first byte of an `Objects` key.
pub const KIND_MANIFEST: u8 = b'F';
pub const KIND_TREE: u8 = b'T';
pub const KIND_COMMIT: u8 = b'C';

/// The key of an object in the `Objects` space.
pub fn object_key(kind: u8, id: &ObjectId) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = kind;
    k[1..].copy_from_slice(id.as_bytes());
    k
}

/// First byte of a chunk head's key in the `Index` space.
pub const KIND_CHUNK_HEAD: u8 = b'H';

/// The key of a chunk's head in the `Index` space: `'H' ++ chunk id`.
/// Its value is the chunk record's header, the record's bytes before its
/// payload ([`ChunkHeader::payload_offset`] of them), so the depth, length
/// and base of a stored chunk are known without reading its payload from
/// a blob file (repository format 2, `docs/format/objects.md`).
pub fn chunk_head_key(id: &ChunkId) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = KIND_CHUNK_HEAD;
    k[1..].copy_from_slice(id.as_bytes());
    k
}

/// Records shorter than this get no head: the store keeps them inline in
/// its LSM tree (its blob files take values of at least 4 KiB), where
/// reading the record costs what reading a head would, and on a run of
/// many small tensors their heads were 0.2% of the repository.
pub const HEAD_MIN_RECORD: usize = 4 << 10;

/// The head of an encoded chunk record: its bytes before the payload.
pub fn chunk_head_of(record: &[u8]) -> Result<&[u8], ObjectDecodeError> {
    let h = ChunkRecord::decode_header(record)?;
    Ok(&record[..h.payload_offset])
}

/// The head a chunk record of these bytes is stored with: none below
/// [`HEAD_MIN_RECORD`].
pub fn stored_head(record: &[u8]) -> Result<Option<&[u8]>, ObjectDecodeError> {
    if record.len() < HEAD_MIN_RECORD {
        return Ok(None);
    }
    chunk_head_of(record).map(Some)
}

/// How a chunk's payload is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Payload {
    /// A chunk codec frame (`docs/format/codec.md`).
    Codec = 0,
    /// A zstd frame (opaque bytes: headers, json, pickles).
    Zstd = 1,
}

/// A stored chunk: how to turn the payload back into the raw bytes whose
/// blake3 is the chunk's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRecord {
    pub payload: Payload,
    pub raw_len: u64,
    /// The chunk the codec frame is a delta against, if any.
    pub base: Option<ChunkId>,
    /// Delta steps to a full chunk: 0 for a full chunk, base depth + 1.
    pub depth: u16,
    /// When the record was written (Unix seconds): gc spares unreferenced
    /// records younger than its grace period.
    pub written: u64,
    pub data: Vec<u8>,
}

/// A chunk record without its payload (see [`ChunkRecord::decode_header`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub payload: Payload,
    pub raw_len: u64,
    pub base: Option<ChunkId>,
    pub depth: u16,
    pub written: u64,
    /// Where the payload starts in the encoded record.
    pub payload_offset: usize,
}

impl ChunkRecord {
    /// `version u8 | payload u8 | raw_len u64 | has_base u8 | [base 32] | depth u16 |
    /// written u64 | data`
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data.len() + 53);
        Self::encode_parts_into(
            self.payload,
            self.raw_len,
            self.base.as_ref(),
            self.depth,
            self.written,
            &self.data,
            &mut out,
        );
        out
    }

    /// [`ChunkRecord::encode`] of the record with these fields and payload
    /// `data`, into `out` (cleared first), so a caller holding the payload
    /// elsewhere does not build a record to encode it.
    pub fn encode_parts_into(
        payload: Payload,
        raw_len: u64,
        base: Option<&ChunkId>,
        depth: u16,
        written: u64,
        data: &[u8],
        out: &mut Vec<u8>,
    ) {
        out.clear();
        out.push(CHUNK_RECORD_VERSION);
        out.push(payload as u8);
        out.extend_from_slice(&raw_len.to_le_bytes());
        match base {
            Some(b) => {
                out.push(1);
                out.extend_from_slice(b.as_bytes());
            }
            None => out.push(0),
        }
        out.extend_from_slice(&depth.to_le_bytes());
        out.extend_from_slice(&written.to_le_bytes());
        out.extend_from_slice(data);
    }

    pub fn decode(bytes: &[u8]) -> Result<ChunkRecord, ObjectDecodeError> {
        let h = Self::decode_header(bytes)?;
        Ok(Self::with_header(&h, bytes[h.payload_offset..].to_vec()))
    }

    /// [`ChunkRecord::decode`] keeping `bytes` as the payload's buffer
    /// (the header moved out of it) instead of copying the payload.
    pub fn decode_owned(mut bytes: Vec<u8>) -> Result<ChunkRecord, ObjectDecodeError> {
        let h = Self::decode_header(&bytes)?;
        bytes.drain(..h.payload_offset);
        Ok(Self::with_header(&h, bytes))
    }

    /// The record of header `h` with payload `data`.
    fn with_header(h: &ChunkHeader, data: Vec<u8>) -> ChunkRecord {
        ChunkRecord {
            payload: h.payload,
            raw_len: h.raw_len,
            base: h.base,
            depth: h.depth,
            written: h.written,
            data,
        }
    }

    /// The fields before the payload, without copying it.
    pub fn decode_header(bytes: &[u8]) -> Result<ChunkHeader, ObjectDecodeError> {
        let mut r = Reader::new(bytes);
        let v = r.u8()?;
        if v != 1 && v != CHUNK_RECORD_VERSION {
            return Err(ObjectDecodeError::ChunkRecordVersion { found: v });
        }
        let payload = match r.u8()? {
            0 => Payload::Codec,
            1 => Payload::Zstd,
            p => return Err(ObjectDecodeError::unknown("chunk payload kind", p)),
        };
        let raw_len = r.u64()?;
        let base = match r.u8()? {
            0 => None,
            1 => Some(ChunkId::from_bytes(r.array32()?)),
            f => {
                return Err(ObjectDecodeError::BadFlag {
                    what: "base",
                    found: f,
                })
            }
        };
        let depth = r.u16()?;
        let written = if v >= 2 { r.u64()? } else { 0 };
        Ok(ChunkHeader {
            payload,
            raw_len,
            base,
            depth,
            written,
            payload_offset: r.p,
        })
    }
}

/// One segment of a file, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentRef {
    Tensor {
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        len: u64,
        chunks: Vec<ChunkId>,
    },
    Opaque {
        len: u64,
        chunks: Vec<ChunkId>,
    },
}

impl SegmentRef {
    pub fn len(&self) -> u64 {
        match self {
            SegmentRef::Tensor { len, .. } | SegmentRef::Opaque { len, .. } => *len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn chunks(&self) -> &[ChunkId] {
        match self {
            SegmentRef::Tensor { chunks, .. } | SegmentRef::Opaque { chunks, .. } => chunks,
        }
    }
}

/// A file of a commit: its segments and what the whole must hash to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileManifest {
    pub kind: FileKind,
    pub len: u64,
    /// blake3 of the whole file, checked on checkout.
    pub hash: [u8; 32],
    /// Unix permission bits.
    pub mode: u32,
    pub segments: Vec<SegmentRef>,
}

fn kind_code(k: FileKind) -> u8 {
    match k {
        FileKind::Safetensors => 1,
        FileKind::TorchZip => 2,
        FileKind::Npy => 3,
        FileKind::DistCp => 4,
        FileKind::TorchLegacy => 5,
        _ => 0,
    }
}

fn kind_from_code(c: u8) -> Result<FileKind, ObjectDecodeError> {
    Ok(match c {
        0 => FileKind::Opaque,
        1 => FileKind::Safetensors,
        2 => FileKind::TorchZip,
        3 => FileKind::Npy,
        4 => FileKind::DistCp,
        5 => FileKind::TorchLegacy,
        _ => return Err(ObjectDecodeError::unknown("file kind", c)),
    })
}

impl FileManifest {
    /// `version | kind u8 | len u64 | hash 32 | mode u32 | nseg varint | segments`;
    /// a segment is `0 | name str | dtype u8 | ndim varint | dims u64.. | len u64 | chunks`
    /// or `1 | len u64 | chunks`; chunks are `count varint | ids 32..`.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::new();
        w.push(OBJECT_VERSION);
        w.push(kind_code(self.kind));
        w.extend_from_slice(&self.len.to_le_bytes());
        w.extend_from_slice(&self.hash);
        w.extend_from_slice(&self.mode.to_le_bytes());
        put_varint(&mut w, self.segments.len() as u64);
        for s in &self.segments {
            match s {
                SegmentRef::Tensor {
                    name,
                    dtype,
                    shape,
                    len,
                    chunks,
                } => {
                    w.push(0);
                    put_str(&mut w, name);
                    w.push(dtype.code());
                    put_varint(&mut w, shape.len() as u64);
                    for d in shape {
                        w.extend_from_slice(&d.to_le_bytes());
                    }
                    w.extend_from_slice(&len.to_le_bytes());
                    put_ids(&mut w, chunks);
                }
                SegmentRef::Opaque { len, chunks } => {
                    w.push(1);
                    w.extend_from_slice(&len.to_le_bytes());
                    put_ids(&mut w, chunks);
                }
            }
        }
        w
    }

    pub fn decode(bytes: &[u8]) -> Result<FileManifest, ObjectDecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let kind = kind_from_code(r.u8()?)?;
        let len = r.u64()?;
        let hash = r.array32()?;
        let mode = r.u32()?;
        let n = r.count(10)?;
        let mut segments = Vec::with_capacity(n);
        for _ in 0..n {
            segments.push(match r.u8()? {
                0 => {
                    let name = r.string()?;
                    let code = r.u8()?;
                    let dtype =
                        DType::from_code(code).ok_or(ObjectDecodeError::unknown("dtype", code))?;
                    let ndim = r.count(8)?;
                    let mut shape = Vec::with_capacity(ndim);
                    for _ in 0..ndim {
                        shape.push(r.u64()?);
                    }
                    let len = r.u64()?;
                    let chunks = r.ids()?;
                    SegmentRef::Tensor {
                        name,
                        dtype,
                        shape,
                        len,
                        chunks,
                    }
                }
                1 => {
                    let len = r.u64()?;
                    SegmentRef::Opaque {
                        len,
                        chunks: r.ids()?,
                    }
                }
                t => return Err(ObjectDecodeError::unknown("segment type", t)),
            });
        }
        r.end()?;
        // Checked: crafted lengths must not wrap around to the file length.
        let total = segments
            .iter()
            .try_fold(0u64, |t, s| t.checked_add(s.len()))
            .ok_or(ObjectDecodeError::SegmentsOverflow)?;
        if total != len {
            return Err(ObjectDecodeError::SegmentsCover {
                covered: total,
                len,
            });
        }
        Ok(FileManifest {
            kind,
            len,
            hash,
            mode,
            segments,
        })
    }
}

/// A commit's files: sorted relative paths -> manifest ids.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tree {
    pub entries: Vec<(String, ObjectId)>,
}

impl Tree {
    /// `version | count varint | (path str | manifest id 32)..`, sorted by path.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![OBJECT_VERSION];
        put_varint(&mut w, self.entries.len() as u64);
        for (p, id) in &self.entries {
            put_str(&mut w, p);
            w.extend_from_slice(id.as_bytes());
        }
        w
    }

    pub fn decode(bytes: &[u8]) -> Result<Tree, ObjectDecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let n = r.count(33)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let p = r.string()?;
            check_path(&p)?;
            entries.push((p, ObjectId::from_bytes(r.array32()?)));
        }
        r.end()?;
        if entries.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(ObjectDecodeError::TreeUnsorted);
        }
        Ok(Tree { entries })
    }
}

/// A path as stored in a tree: relative, `/`-separated, no empty, `.` or
/// `..` components, so it can never escape the checkout directory; and no
/// `.ckvc` component, so a checkout can never write into a repository's
/// own data (a crafted tree fetched from a remote included).
pub fn check_path(p: &str) -> Result<(), PathError> {
    let problem = if p.is_empty() || p.starts_with('/') || p.contains('\\') || p.contains('\0') {
        PathProblem::NotRelative
    } else if p.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        PathProblem::BadComponent
    } else if p.split('/').any(|c| c == super::DOT_DIR) {
        PathProblem::InDotDir
    } else {
        return Ok(());
    };
    Err(PathError {
        path: p.to_string(),
        problem,
    })
}

/// A path [`check_path`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
#[error("path {path:?} {problem}")]
pub struct PathError {
    pub path: String,
    pub problem: PathProblem,
}

/// What is wrong with a [`PathError`]'s path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PathProblem {
    /// Empty, absolute, or holding `\\` or NUL.
    NotRelative,
    /// An empty, `.` or `..` component.
    BadComponent,
    /// A `.ckvc` component.
    InDotDir,
}

impl std::fmt::Display for PathProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathProblem::NotRelative => f.write_str("is not a relative path"),
            PathProblem::BadComponent => f.write_str("has an empty, '.' or '..' component"),
            PathProblem::InDotDir => write!(
                f,
                "lies in a {} directory, which holds a repository's own data",
                super::DOT_DIR
            ),
        }
    }
}

/// Why an encoded object (chunk record, manifest, tree, commit, ref log
/// entry) does not decode: fields, so a caller can tell one cause from
/// another without reading the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ObjectDecodeError {
    /// The bytes end at `offset` with `need` more wanted.
    #[error("truncated at byte {offset} (need {need} more)")]
    Truncated { offset: usize, need: usize },
    #[error("chunk record version {found}, this build reads 1 and {CHUNK_RECORD_VERSION}")]
    ChunkRecordVersion { found: u8 },
    #[error("object version {found}, this build reads {OBJECT_VERSION}")]
    ObjectVersion { found: u8 },
    /// A code (`what`: "file kind", "dtype", ...) this build does not know.
    #[error("unknown {what} {found}")]
    Unknown { what: &'static str, found: u64 },
    /// A flag byte (`what`: "base", "provenance", ...) that is neither 0 nor 1.
    #[error("bad {what} flag {found}")]
    BadFlag { what: &'static str, found: u8 },
    #[error("varint longer than 10 bytes")]
    VarintTooLong,
    /// A count of items that cannot fit in the `left` bytes remaining.
    #[error("count {count} exceeds the {left} bytes left")]
    CountTooLarge { count: u64, left: u64 },
    #[error("string is not UTF-8")]
    NotUtf8,
    #[error("{count} trailing bytes")]
    TrailingBytes { count: usize },
    #[error("segment lengths overflow")]
    SegmentsOverflow,
    /// A manifest's segments do not add up to its file length.
    #[error("segments cover {covered} bytes of a {len}-byte file")]
    SegmentsCover { covered: u64, len: u64 },
    #[error("tree paths are not sorted and unique")]
    TreeUnsorted,
    #[error("commit metrics are not a JSON object")]
    MetricsNotObject,
    #[error(transparent)]
    Path(#[from] PathError),
}

impl ObjectDecodeError {
    fn unknown(what: &'static str, found: u8) -> ObjectDecodeError {
        ObjectDecodeError::Unknown {
            what,
            found: found.into(),
        }
    }
}

/// A checkpoint in the history.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    pub tree: ObjectId,
    pub parents: Vec<CommitId>,
    pub step: u64,
    /// The branch it was committed on.
    pub branch: String,
    pub message: String,
    /// Seconds since the Unix epoch.
    pub time: u64,
    /// Metrics from `trainer_state.json` (loss, eval_loss, learning_rate, ...), as JSON.
    pub metrics: serde_json::Map<String, serde_json::Value>,
    pub stats: CommitStats,
    /// The training code's git state, when the commit ran inside a git
    /// repository (or was given `--code DIR`).
    pub provenance: Option<super::provenance::Provenance>,
}

/// Sizes recorded at commit time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct CommitStats {
    pub files: u64,
    /// Bytes of the checkpoint's files.
    pub logical_bytes: u64,
    /// Bytes this commit added to the store (new chunk records and objects).
    pub stored_bytes: u64,
    pub chunks: u64,
    pub new_chunks: u64,
    /// Deepest delta chain among the commit's chunks (0: a full snapshot).
    pub max_depth: u16,
}

impl Commit {
    /// `version | tree 32 | nparents varint | parents 32.. | step u64 | time u64 |
    /// branch str | message str | metrics str (JSON) | files, logical, stored,
    /// chunks, new_chunks (u64 each) | max_depth u16 | has_provenance u8 |
    /// [code repo str | code commit str | code branch str | dirty u8]`
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![OBJECT_VERSION];
        w.extend_from_slice(self.tree.as_bytes());
        put_varint(&mut w, self.parents.len() as u64);
        for p in &self.parents {
            w.extend_from_slice(p.as_bytes());
        }
        w.extend_from_slice(&self.step.to_le_bytes());
        w.extend_from_slice(&self.time.to_le_bytes());
        put_str(&mut w, &self.branch);
        put_str(&mut w, &self.message);
        put_str(
            &mut w,
            &serde_json::Value::Object(self.metrics.clone()).to_string(),
        );
        let s = &self.stats;
        for v in [
            s.files,
            s.logical_bytes,
            s.stored_bytes,
            s.chunks,
            s.new_chunks,
        ] {
            w.extend_from_slice(&v.to_le_bytes());
        }
        w.extend_from_slice(&s.max_depth.to_le_bytes());
        match &self.provenance {
            None => w.push(0),
            Some(p) => {
                w.push(1);
                put_str(&mut w, &p.repo);
                put_str(&mut w, &p.commit);
                put_str(&mut w, &p.branch);
                w.push(p.dirty as u8);
            }
        }
        w
    }

    pub fn decode(bytes: &[u8]) -> Result<Commit, ObjectDecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let tree = ObjectId::from_bytes(r.array32()?);
        let np = r.count(32)?;
        let mut parents = Vec::with_capacity(np);
        for _ in 0..np {
            parents.push(CommitId::from_bytes(r.array32()?));
        }
        let step = r.u64()?;
        let time = r.u64()?;
        let branch = r.string()?;
        let message = r.string()?;
        let metrics = match serde_json::from_str(&r.string()?) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => return Err(ObjectDecodeError::MetricsNotObject),
        };
        let mut v = [0u64; 5];
        for x in v.iter_mut() {
            *x = r.u64()?;
        }
        let max_depth = r.u16()?;
        let provenance = match r.u8()? {
            0 => None,
            1 => Some(super::provenance::Provenance {
                repo: r.string()?,
                commit: r.string()?,
                branch: r.string()?,
                dirty: match r.u8()? {
                    0 => false,
                    1 => true,
                    d => {
                        return Err(ObjectDecodeError::BadFlag {
                            what: "dirty",
                            found: d,
                        })
                    }
                },
            }),
            f => {
                return Err(ObjectDecodeError::BadFlag {
                    what: "provenance",
                    found: f,
                })
            }
        };
        r.end()?;
        Ok(Commit {
            tree,
            parents,
            step,
            branch,
            message,
            time,
            metrics,
            stats: CommitStats {
                files: v[0],
                logical_bytes: v[1],
                stored_bytes: v[2],
                chunks: v[3],
                new_chunks: v[4],
                max_depth,
            },
            provenance,
        })
    }
}

fn put_varint(w: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        w.push(v as u8 | 0x80);
        v >>= 7;
    }
    w.push(v as u8);
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    put_varint(w, s.len() as u64);
    w.extend_from_slice(s.as_bytes());
}

fn put_ids(w: &mut Vec<u8>, ids: &[ChunkId]) {
    put_varint(w, ids.len() as u64);
    for id in ids {
        w.extend_from_slice(id.as_bytes());
    }
}

/// Bounds-checked reads over an encoded object.
struct Reader<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8]) -> Self {
        Reader { b, p: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], ObjectDecodeError> {
        let end = self.p.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or(ObjectDecodeError::Truncated {
            offset: self.p,
            need: n,
        })?;
        let s = &self.b[self.p..end];
        self.p = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, ObjectDecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ObjectDecodeError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, ObjectDecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, ObjectDecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn array32(&mut self) -> Result<[u8; 32], ObjectDecodeError> {
        Ok(self.take(32)?.try_into().expect("32 bytes"))
    }
    fn varint(&mut self) -> Result<u64, ObjectDecodeError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            v |= ((b & 0x7f) as u64) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(ObjectDecodeError::VarintTooLong)
    }
    /// A count of items of at least `min_size` bytes each: bounded by what
    /// is left, so a corrupt count cannot make us allocate.
    fn count(&mut self, min_size: usize) -> Result<usize, ObjectDecodeError> {
        let n = self.varint()?;
        let left = (self.b.len() - self.p) as u64;
        if n.saturating_mul(min_size.max(1) as u64) > left {
            return Err(ObjectDecodeError::CountTooLarge { count: n, left });
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, ObjectDecodeError> {
        let n = self.count(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| ObjectDecodeError::NotUtf8)
    }
    fn ids(&mut self) -> Result<Vec<ChunkId>, ObjectDecodeError> {
        let n = self.count(32)?;
        (0..n)
            .map(|_| Ok(ChunkId::from_bytes(self.array32()?)))
            .collect()
    }
    fn version(&mut self) -> Result<(), ObjectDecodeError> {
        match self.u8()? {
            OBJECT_VERSION => Ok(()),
            v => Err(ObjectDecodeError::ObjectVersion { found: v }),
        }
    }
    fn end(&self) -> Result<(), ObjectDecodeError> {
        if self.p == self.b.len() {
            Ok(())
        } else {
            Err(ObjectDecodeError::TrailingBytes {
                count: self.b.len() - self.p,
            })
        }
    }
}

/// One move of a ref, as the ref log records it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RefLogEntry {
    /// `refs/heads/<branch>` or `refs/tags/<tag>`.
    pub refname: String,
    /// `None`: the ref was created.
    pub old: Option<CommitId>,
    /// `None`: the ref was deleted.
    pub new: Option<CommitId>,
    /// Unix seconds.
    pub time: u64,
    /// What moved it: `commit`, `branch`, `gc --keep`, `pull`, ...
    pub op: String,
}

impl RefLogEntry {
    /// `version | has_old u8 | [old 32] | has_new u8 | [new 32] | time u64 | op str`
    /// (the ref name is in the key).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![OBJECT_VERSION];
        for id in [&self.old, &self.new] {
            match id {
                Some(id) => {
                    w.push(1);
                    w.extend_from_slice(id.as_bytes());
                }
                None => w.push(0),
            }
        }
        w.extend_from_slice(&self.time.to_le_bytes());
        put_str(&mut w, &self.op);
        w
    }

    pub fn decode(refname: &str, bytes: &[u8]) -> Result<RefLogEntry, ObjectDecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let mut ids = [None, None];
        for id in &mut ids {
            *id = match r.u8()? {
                0 => None,
                1 => Some(CommitId::from_bytes(r.array32()?)),
                f => {
                    return Err(ObjectDecodeError::BadFlag {
                        what: "id",
                        found: f,
                    })
                }
            };
        }
        let time = r.u64()?;
        let op = r.string()?;
        r.end()?;
        let [old, new] = ids;
        Ok(RefLogEntry {
            refname: refname.into(),
            old,
            new,
            time,
            op,
        })
    }
}

/// Map a decode failure of an object to the repository error.
pub fn corrupt(site: Box<super::Site>) -> impl FnOnce(ObjectDecodeError) -> RepoError {
    move |source| RepoError::BadObject { site, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_round_trip_and_reject_truncation() {
        let id = ChunkId::digest(b"x");
        let m = FileManifest {
            kind: FileKind::Safetensors,
            len: 30,
            hash: [7; 32],
            mode: 0o644,
            segments: vec![
                SegmentRef::Opaque {
                    len: 10,
                    chunks: vec![id],
                },
                SegmentRef::Tensor {
                    name: "w".into(),
                    dtype: DType::BF16,
                    shape: vec![2, 5],
                    len: 20,
                    chunks: vec![id, id],
                },
            ],
        };
        let e = m.encode();
        assert_eq!(FileManifest::decode(&e).unwrap(), m);
        for cut in 0..e.len() {
            assert!(FileManifest::decode(&e[..cut]).is_err());
        }
        let t = Tree {
            entries: vec![
                ("a/b.bin".into(), ObjectId::digest(b"1")),
                ("c".into(), ObjectId::digest(b"2")),
            ],
        };
        assert_eq!(Tree::decode(&t.encode()).unwrap(), t);
        let c = Commit {
            tree: ObjectId::digest(b"t"),
            parents: vec![CommitId::digest(b"p")],
            step: 600,
            branch: "main".into(),
            message: "m".into(),
            time: 1,
            metrics: serde_json::from_str(r#"{"loss": 1.5}"#).unwrap(),
            stats: CommitStats {
                files: 4,
                logical_bytes: 10,
                stored_bytes: 5,
                chunks: 3,
                new_chunks: 2,
                max_depth: 1,
            },
            provenance: Some(crate::repo::provenance::Provenance {
                repo: "/src".into(),
                commit: "abc".into(),
                branch: "main".into(),
                dirty: true,
            }),
        };
        assert_eq!(Commit::decode(&c.encode()).unwrap(), c);
        let r = ChunkRecord {
            payload: Payload::Codec,
            raw_len: 8,
            base: Some(id),
            depth: 3,
            written: 1_700_000_000,
            data: vec![1, 2, 3],
        };
        assert_eq!(ChunkRecord::decode(&r.encode()).unwrap(), r);
    }

    #[test]
    fn paths_that_could_escape_are_rejected() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a\\b",
            "a/.",
            ".ckvc/db/CURRENT",
            "sub/.ckvc/x",
        ] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        for good in [
            "a",
            "step-1/model.safetensors",
            "a.b/c..d",
            ".ckvc-notes",
            "x.ckvc",
        ] {
            assert!(check_path(good).is_ok(), "{good}");
        }
    }
}
