//! Checkpoint files: turning one file into a [`Layout`] of tensor and opaque
//! byte segments.
//!
//! This module owns the knowledge of on-disk checkpoint formats:
//! safetensors, PyTorch `torch.save` zip archives (`.pt`, `.pth`, `.bin`;
//! the pickle `data.pkl` inside is *read*, never executed), PyTorch
//! distributed-checkpoint data files (`.distcp`: a sequence of such
//! archives) and numpy `.npy`; and HF Trainer's `trainer_state.json`,
//! for the step and metrics a commit records ([`TrainerState`]).
//! Any other file is one opaque segment. A layout covers its file exactly:
//! concatenating the bytes of its segments, in order, reproduces the file.
//!
//! Parsers read headers through `Read + Seek` and return byte ranges; they
//! never need the whole file in memory, never panic on any input and never
//! allocate more than a bound derived from the file length (every length is
//! checked before it is used). The rule for what is an error and what is
//! merely opaque is in `docs/format/checkpoint-files.md`: a file whose name
//! promises a format and whose content breaks it is an error; a file that is
//! well-formed but outside what ckvc understands is opaque.
//!
//! This module must not touch the store, the repository or codec internals: it
//! only uses [`DType`], and it does not read tensor data.

use std::io::{Read, Seek, SeekFrom};

pub use crate::codec::DType;

mod distcp;
mod json;
mod npy;
mod pickle;
mod safetensors;
mod torchzip;
mod trainer_state;
mod zip;

pub use distcp::{parse_distcp, DcpIndex};
pub use npy::parse_npy;
pub use safetensors::parse_safetensors;
pub use torchzip::{optimizer_param_names, parse_torch_legacy, parse_torch_zip};
pub use trainer_state::{is_whole_json, TrainerState};

/// The step number in a checkpoint directory name (`step-500`,
/// `checkpoint-500`, `iter_0000500`): the trailing digits.
pub fn step_of_dir_name(name: &str) -> Option<u64> {
    let digits: String = name
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_digit())
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

/// Which parser produced a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FileKind {
    Safetensors,
    TorchZip,
    Npy,
    /// A PyTorch distributed-checkpoint data file (`.distcp`): a sequence of
    /// `torch.save` archives.
    DistCp,
    /// A legacy (`_use_new_zipfile_serialization=False`) `torch.save` file:
    /// pickles, then raw storages.
    TorchLegacy,
    /// Not a format ckvc understands: the layout is one opaque segment (or
    /// none for an empty file).
    Opaque,
}

/// A file split into segments: contiguous, in file order, covering `0..len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub kind: FileKind,
    pub len: u64,
    pub segments: Vec<Segment>,
}

/// One byte range of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// The raw little-endian elements of one tensor (or torch storage).
    Tensor(TensorInfo),
    /// Bytes ckvc keeps as they are: headers, zip records, pickles, padding.
    Opaque { offset: u64, len: u64 },
}

/// Where a tensor's data sits in its file and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Unique within the layout and stable across checkpoints of one run.
    pub name: String,
    pub dtype: DType,
    /// Row-major (C order) dimensions; `[]` for a 0-d tensor.
    pub shape: Vec<u64>,
    pub offset: u64,
    /// Always `numel(shape) * dtype.width()`.
    pub len: u64,
}

impl Segment {
    /// First byte of the segment in the file.
    pub fn offset(&self) -> u64 {
        match self {
            Segment::Tensor(t) => t.offset,
            Segment::Opaque { offset, .. } => *offset,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Segment::Tensor(t) => t.len,
            Segment::Opaque { len, .. } => *len,
        }
    }

    /// True for a zero-length segment (only a tensor with no elements).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a file could not be split into a layout. The caller adds the path.
///
/// Offsets are byte offsets in the file being parsed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The file ends before a structure it announces.
    #[error("truncated {what}: needs bytes up to {need}, file has {have}")]
    Truncated {
        what: &'static str,
        need: u64,
        have: u64,
    },
    /// A structure is inconsistent (bad magic, offsets that lie, overlaps,
    /// sizes that disagree).
    #[error("corrupt at byte {offset}: {reason}")]
    Corrupt { offset: u64, reason: String },
    /// A header or index is larger than ckvc is willing to hold in memory.
    #[error("{what} of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        what: &'static str,
        size: u64,
        limit: u64,
    },
    /// `data.pkl` uses a pickle opcode the reader does not implement.
    #[error("unsupported pickle opcode 0x{opcode:02x} at byte {offset}")]
    UnsupportedPickle { opcode: u8, offset: u64 },
    /// A layout breaks the coverage invariant (reported by [`Layout::validate`]).
    #[error("invalid layout at segment {index}: {reason}")]
    InvalidLayout { index: usize, reason: &'static str },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl FormatError {
    pub(crate) fn corrupt(offset: u64, reason: impl Into<String>) -> Self {
        FormatError::Corrupt {
            offset,
            reason: reason.into(),
        }
    }
}

/// Splits a file into a layout, choosing the parser by the file name's
/// extension: `.safetensors`, `.npy`, and `.pt`/`.pth`/`.bin` when the file
/// starts like a zip archive. Everything else is one opaque segment.
///
/// `len` is the file's length; `r` is positioned anywhere.
///
/// ```
/// use std::io::Cursor;
/// use ckvc::format::{parse, DType, FileKind, Segment};
///
/// // A safetensors file with one 2x2 bf16 tensor.
/// let header = br#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
/// let mut file = (header.len() as u64).to_le_bytes().to_vec();
/// file.extend_from_slice(header);
/// file.extend_from_slice(&[0x80, 0x3f, 0, 0x40, 0x40, 0x40, 0x80, 0x40]);
///
/// let layout = parse("model.safetensors", &mut Cursor::new(&file), file.len() as u64).unwrap();
/// layout.validate().unwrap();
/// assert_eq!(layout.kind, FileKind::Safetensors);
/// let t = layout.tensors().next().unwrap();
/// assert_eq!((t.name.as_str(), t.dtype, t.shape.as_slice()), ("w", DType::BF16, &[2, 2][..]));
/// // The header is one opaque segment, the tensor covers the rest.
/// assert_eq!(layout.segments[0], Segment::Opaque { offset: 0, len: 8 + header.len() as u64 });
/// assert_eq!((t.offset, t.len), (8 + header.len() as u64, 8));
/// ```
pub fn parse<R: Read + Seek>(file_name: &str, r: &mut R, len: u64) -> Result<Layout, FormatError> {
    let lower = file_name.to_ascii_lowercase();
    let ext = lower.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    match ext {
        "safetensors" => parse_safetensors(r, len),
        "npy" => parse_npy(r, len),
        // A legacy (pre-1.6) torch pickle or any other binary blob behind
        // these extensions is opaque; a zip must be a sound zip.
        "pt" | "pth" | "bin" if zip::looks_like_zip(r, len)? => parse_torch_zip(r, len),
        // The legacy torch format: opaque, never an error, when not understood.
        "pt" | "pth" | "bin" if torchzip::looks_legacy(r, len)? => parse_torch_legacy(r, len),
        // Anything not understood in a DCP file is opaque, never an error.
        "distcp" => parse_distcp(r, len, None),
        _ => Ok(Layout::opaque(len)),
    }
}

/// Opens `path` for reading with `O_NONBLOCK`: a FIFO put where a
/// checkpoint file was must not block the open (the caller checks the file
/// type on the handle); for a regular file the flag changes nothing.
pub(crate) fn open_nonblocking(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK);
    }
    o.open(path)
}

/// [`open_nonblocking`], failing unless `path` is a regular file.
pub(crate) fn open_regular(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    let f = open_nonblocking(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(f)
}

/// The bytes of the regular file at `path` when it holds at most `limit`;
/// `None` for anything else (missing, a FIFO or device, too large).
pub(crate) fn read_small_file(path: &std::path::Path, limit: u64) -> Option<Vec<u8>> {
    let f = open_regular(path).ok()?;
    let mut buf = Vec::new();
    f.take(limit.saturating_add(1)).read_to_end(&mut buf).ok()?;
    (buf.len() as u64 <= limit).then_some(buf)
}

/// What the files of one checkpoint directory say about each other: the
/// item names of each DCP checkpoint's `.metadata` (in the directory or a
/// subdirectory), which name the tensors of its `.distcp` files.
#[derive(Debug, Clone, Default)]
pub struct DirContext {
    /// Directory prefix (`""` or `sub/`) -> what its `.metadata` says.
    dcp: std::collections::HashMap<String, DcpIndex>,
}

impl DirContext {
    /// Reads the `.metadata` files among `files` (relative `/` paths and
    /// full paths). One that cannot be read or is not DCP's leaves the
    /// items of its files named by position.
    pub fn read<'a>(files: impl IntoIterator<Item = (&'a str, &'a std::path::Path)>) -> DirContext {
        let mut ctx = DirContext::default();
        for (rel, path) in files {
            let (prefix, name) = match rel.rsplit_once('/') {
                Some((dir, name)) => (format!("{dir}/"), name),
                None => (String::new(), rel),
            };
            if name != ".metadata" {
                continue;
            }
            let Some(bytes) = read_small_file(path, distcp::MAX_METADATA) else {
                continue;
            };
            if let Ok(index) = DcpIndex::parse(&bytes) {
                ctx.dcp.insert(prefix, index);
            }
        }
        ctx
    }

    /// [`parse`] of the file at `rel` (relative to the checkpoint
    /// directory), with what the other files say about it.
    pub fn parse<R: Read + Seek>(
        &self,
        rel: &str,
        r: &mut R,
        len: u64,
    ) -> Result<Layout, FormatError> {
        let (prefix, name) = match rel.rsplit_once('/') {
            Some((dir, name)) => (format!("{dir}/"), name),
            None => (String::new(), rel),
        };
        if name.to_ascii_lowercase().ends_with(".distcp") {
            let names = self.dcp.get(&prefix).and_then(|i| i.items_of(name));
            return parse_distcp(r, len, names);
        }
        parse(name, r, len)
    }
}

impl Layout {
    /// The layout of a file ckvc keeps as a single opaque blob.
    pub fn opaque(len: u64) -> Layout {
        let segments = if len == 0 {
            Vec::new()
        } else {
            vec![Segment::Opaque { offset: 0, len }]
        };
        Layout {
            kind: FileKind::Opaque,
            len,
            segments,
        }
    }

    /// Checks the coverage invariant: segments start at 0, each starts where
    /// the previous ended, they end at `len`, opaque segments are non-empty
    /// and every tensor's length is `numel * width`.
    pub fn validate(&self) -> Result<(), FormatError> {
        let mut pos = 0u64;
        for (index, seg) in self.segments.iter().enumerate() {
            let bad = |reason| Err(FormatError::InvalidLayout { index, reason });
            if seg.offset() != pos {
                return bad("segment does not start where the previous one ended");
            }
            match seg {
                Segment::Opaque { len, .. } if *len == 0 => return bad("empty opaque segment"),
                Segment::Tensor(t) if tensor_bytes(&t.shape, t.dtype) != Some(t.len) => {
                    return bad("tensor length is not numel * width")
                }
                _ => {}
            }
            pos = match pos.checked_add(seg.len()) {
                Some(p) => p,
                None => return bad("segment end overflows"),
            };
        }
        if pos != self.len {
            return Err(FormatError::InvalidLayout {
                index: self.segments.len(),
                reason: "segments do not end at the file length",
            });
        }
        Ok(())
    }

    /// The tensor segments, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Tensor(t) => Some(t),
            Segment::Opaque { .. } => None,
        })
    }

    /// Builds a layout from tensor byte ranges: sorts them, rejects ranges
    /// beyond `len` or overlapping each other, and fills every gap with one
    /// opaque segment (so no two opaque segments are adjacent).
    pub(crate) fn from_tensors(
        kind: FileKind,
        len: u64,
        mut tensors: Vec<TensorInfo>,
    ) -> Result<Layout, FormatError> {
        tensors.sort_by_key(|t| (t.offset, t.len));
        let mut segments = Vec::with_capacity(tensors.len() * 2 + 1);
        let mut pos = 0u64;
        for t in tensors {
            let end = t.offset.checked_add(t.len).filter(|&e| e <= len).ok_or(
                FormatError::Truncated {
                    what: "tensor data",
                    need: t.offset.saturating_add(t.len),
                    have: len,
                },
            )?;
            if t.offset < pos {
                return Err(FormatError::corrupt(
                    t.offset,
                    format!("tensor {:?} overlaps the previous tensor", t.name),
                ));
            }
            if t.offset > pos {
                segments.push(Segment::Opaque {
                    offset: pos,
                    len: t.offset - pos,
                });
            }
            pos = end;
            segments.push(Segment::Tensor(t));
        }
        if len > pos {
            segments.push(Segment::Opaque {
                offset: pos,
                len: len - pos,
            });
        }
        Ok(Layout {
            kind,
            len,
            segments,
        })
    }
}

/// `numel(shape) * width`, or `None` on overflow.
pub(crate) fn tensor_bytes(shape: &[u64], dtype: DType) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))?
        .checked_mul(dtype.width() as u64)
}

/// Reads `n` bytes at `offset`, after checking they lie within `len` and
/// `n <= limit`, so a lying header can never make us allocate more than the
/// file (or the limit) holds.
pub(crate) fn read_at<R: Read + Seek>(
    r: &mut R,
    len: u64,
    offset: u64,
    n: u64,
    limit: u64,
    what: &'static str,
) -> Result<Vec<u8>, FormatError> {
    if n > limit {
        return Err(FormatError::TooLarge {
            what,
            size: n,
            limit,
        });
    }
    let end = offset.checked_add(n).filter(|&e| e <= len);
    if end.is_none() {
        return Err(FormatError::Truncated {
            what,
            need: offset.saturating_add(n),
            have: len,
        });
    }
    let n = usize::try_from(n).map_err(|_| FormatError::TooLarge {
        what,
        size: n,
        limit: usize::MAX as u64,
    })?;
    let mut buf = vec![0u8; n];
    r.seek(SeekFrom::Start(offset))?;
    r.read_exact(&mut buf)?;
    Ok(buf)
}

#[cfg(test)]
mod tests;
