//! PyTorch distributed checkpoint (DCP) data files, `__<rank>_<n>.distcp`,
//! as DCP's filesystem writer makes them: one `torch.save` archive per
//! write item (a tensor, or the pickled bytes of any other object), written
//! one after another with nothing between them. `.metadata` beside them
//! records each item's offset and length; this parser does not need it: it
//! walks the archives back from the end of the file (each zip's end record
//! says where its central directory starts relative to the archive, which
//! gives the archive's first byte), then parses each archive like any
//! `torch.save` file.
//!
//! Tensors are named after the state-dict key `.metadata` records for the
//! item's byte range (`model.layers.0.weight`, with `@<offsets>` for a
//! shard that does not start at 0), so a tensor keeps its name, and finds
//! its delta base, from step to step and across a change of world size
//! wherever shards line up. Without `.metadata` (or for an item it does not
//! list) the name is `<item>/<name in the archive>`, `<item>` counting the
//! archives from 0 in file order: stable as long as the same state is saved
//! with the same world size.
//!
//! With `SerializationFormat.SAFETENSORS` DCP writes tensor items as
//! safetensors blobs instead; those are split by the item ranges that
//! `.metadata` records (a safetensors blob has no trailer to walk back by).
//!
//! Anything not understood (a file that is not such a sequence, compressed
//! or encrypted entries, a transform DCP applied to the stream) keeps the
//! whole file as one opaque segment: a DCP file never fails a commit.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use super::pickle::{self, Node, Pickle, Value};
use super::{
    parse_safetensors, parse_torch_zip, zip, FileKind, FormatError, Layout, Segment, TensorInfo,
};

/// The largest `.metadata` read (about 200 bytes per item).
pub const MAX_METADATA: u64 = 64 << 20;

/// What a DCP checkpoint's `.metadata` says about its items: per data file,
/// each item's byte range and name (its fully-qualified name in the state
/// dict, with the shard's offsets when they are not all zero). Read with
/// the non-executing pickle reader.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DcpIndex {
    /// relative path -> (offset, length) -> name
    files: HashMap<String, HashMap<(u64, u64), String>>,
}

impl DcpIndex {
    /// Parses the bytes of a `.metadata` file. A pickle that is not DCP's
    /// `Metadata` gives an error; the caller then names items by position.
    pub fn parse(bytes: &[u8]) -> Result<DcpIndex, FormatError> {
        let tree = pickle::read(bytes, 0)?;
        let bad = |why: &str| FormatError::corrupt(0, format!(".metadata: {why}"));
        let storage =
            object_field(&tree, tree.root, "storage_data").ok_or_else(|| bad("no storage_data"))?;
        let Some(Node::Dict(items)) = tree.node(storage) else {
            return Err(bad("storage_data is not a dict"));
        };
        let mut index = DcpIndex::default();
        // Names and paths are copied per item: an fqn, offsets or path
        // shared by memo among many items must not be copied without bound.
        let mut copied = 0usize;
        for (k, v) in items {
            let fqn = object_field(&tree, *k, "fqn")
                .and_then(|f| tree.str(f))
                .ok_or_else(|| bad("an index without fqn"))?;
            let offsets = object_field(&tree, *k, "offset").and_then(|o| ints(&tree, o));
            let path = object_field(&tree, *v, "relative_path")
                .and_then(|p| tree.str(p))
                .ok_or_else(|| bad("storage info without relative_path"))?;
            let int = |name| match object_field(&tree, *v, name) {
                Some(Value::Int(i)) => u64::try_from(i).ok(),
                _ => None,
            };
            let (Some(offset), Some(length)) = (int("offset"), int("length")) else {
                return Err(bad("storage info without offset and length"));
            };
            let name = match offsets {
                Some(o) if o.iter().any(|&x| x != 0) => {
                    let o: Vec<String> = o.iter().map(i64::to_string).collect();
                    format!("{fqn}@{}", o.join(","))
                }
                _ => fqn.to_string(),
            };
            copied = copied.saturating_add(name.len() + path.len());
            if copied > MAX_METADATA as usize {
                return Err(bad("item names longer than the file allows"));
            }
            index
                .files
                .entry(path.to_string())
                .or_default()
                .insert((offset, length), name);
        }
        Ok(index)
    }

    /// The items of the data file at `path` (relative to the checkpoint).
    pub fn items_of(&self, path: &str) -> Option<&HashMap<(u64, u64), String>> {
        self.files.get(path)
    }
}

/// The most fields of a DCP dataclass state read (real ones have a
/// handful); with more, the object is not DCP's. Items can share one state
/// by memo, so an unbounded scan per item would be quadratic in the file.
const MAX_FIELDS: usize = 64;

/// The most dimensions of an index offset read (same reason).
const MAX_DIMS: usize = 64;

/// `name` in the `BUILD` state dict of the object `v` (a dataclass).
fn object_field(tree: &Pickle, v: Value, name: &str) -> Option<Value> {
    let Node::Object(o) = tree.node(v)? else {
        return None;
    };
    let Node::Dict(state) = tree.node(o.state?)? else {
        return None;
    };
    if state.len() > MAX_FIELDS {
        return None;
    }
    state
        .iter()
        .find(|(k, _)| tree.str(*k) == Some(name))
        .map(|(_, v)| *v)
}

/// The integers of a `torch.Size((a, b, ..))` or a plain tuple; `None` for
/// `None` or anything else.
fn ints(tree: &Pickle, v: Value) -> Option<Vec<i64>> {
    let items = match tree.node(v)? {
        Node::Object(o) => tree.items(o.args)?.first().and_then(|a| tree.items(*a))?,
        Node::Tuple(t) | Node::List(t) => t,
        _ => return None,
    };
    if items.len() > MAX_DIMS {
        return None;
    }
    items
        .iter()
        .map(|x| match x {
            Value::Int(i) => Some(*i),
            _ => None,
        })
        .collect()
}

/// The most archives walked in one file (a write item each); a file with
/// more is kept opaque rather than parsed in time quadratic in its items.
const MAX_ITEMS: usize = 1 << 20;

/// Parses a `.distcp` file; never an error for content it does not
/// understand (the whole file is then opaque), only for I/O errors.
/// `names`, from the checkpoint's [`DcpIndex`], names the items found at
/// exactly their recorded byte ranges; other items are named by position.
pub fn parse_distcp<R: Read + Seek>(
    r: &mut R,
    len: u64,
    names: Option<&HashMap<(u64, u64), String>>,
) -> Result<Layout, FormatError> {
    match items(r, len, names) {
        Ok(layout) => Ok(layout),
        Err(FormatError::Io(e)) => Err(FormatError::Io(e)),
        Err(_) => Ok(Layout::opaque(len)),
    }
}

fn items<R: Read + Seek>(
    r: &mut R,
    len: u64,
    names: Option<&HashMap<(u64, u64), String>>,
) -> Result<Layout, FormatError> {
    if len == 0 {
        return Err(FormatError::corrupt(0, "empty"));
    }
    let spans = match names.and_then(|m| recorded_spans(m, len)) {
        Some(spans) => spans,
        None => zip_spans(r, len)?,
    };
    let mut segments = Vec::new();
    for (item, &(start, end)) in spans.iter().enumerate() {
        let n = end - start;
        let mut w = Window::new(r, start, n);
        // DCP's default format writes torch.save archives; its
        // SerializationFormat.SAFETENSORS writes tensors as safetensors
        // (and other items still as torch.save archives).
        let zipped = zip::looks_like_zip(&mut w, n)?;
        let inner = if zipped {
            let inner = parse_torch_zip(&mut w, n)?;
            if inner.kind != FileKind::TorchZip {
                return Err(FormatError::corrupt(
                    start,
                    "an item is not a torch archive",
                ));
            }
            inner
        } else {
            parse_safetensors(&mut w, n)?
        };
        // A safetensors blob names its tensors by their state-dict keys.
        let fqn = names.and_then(|m| m.get(&(start, n))).filter(|_| zipped);
        let single = inner.tensors().count() == 1;
        for seg in inner.segments {
            segments.push(match seg {
                Segment::Tensor(t) => Segment::Tensor(TensorInfo {
                    name: match fqn {
                        Some(f) if single => f.clone(),
                        Some(f) => format!("{f}/{}", t.name),
                        None if !zipped => t.name,
                        None => format!("{item}/{}", t.name),
                    },
                    offset: t.offset + start,
                    ..t
                }),
                Segment::Opaque { offset, len } => Segment::Opaque {
                    offset: offset + start,
                    len,
                },
            });
        }
    }
    // Adjacent opaque segments (the end of one archive, the start of the
    // next) become one.
    let mut merged: Vec<Segment> = Vec::with_capacity(segments.len());
    for seg in segments {
        match (merged.last_mut(), &seg) {
            (Some(Segment::Opaque { len: l, .. }), Segment::Opaque { len, .. }) => *l += len,
            _ => merged.push(seg),
        }
    }
    let layout = Layout {
        kind: FileKind::DistCp,
        len,
        segments: merged,
    };
    layout.validate()?;
    Ok(layout)
}

/// The items' byte ranges from the offsets `.metadata` records: each item
/// runs from its offset to the next item's (several tensors recorded at one
/// offset share one safetensors blob, as DCP's safetensors serialization
/// writes them); `None` (walk the file instead) unless the first starts at
/// 0 and all lie inside the file.
fn recorded_spans(names: &HashMap<(u64, u64), String>, len: u64) -> Option<Vec<(u64, u64)>> {
    let mut starts: Vec<u64> = names.keys().map(|&(o, _)| o).collect();
    starts.sort_unstable();
    starts.dedup();
    if starts.first() != Some(&0) || starts.last().is_some_and(|&l| l >= len) {
        return None;
    }
    let ends = starts.iter().skip(1).copied().chain([len]);
    Some(starts.iter().copied().zip(ends).collect())
}

/// The spans of the torch archives that make up the file, walked back from
/// its end.
fn zip_spans<R: Read + Seek>(r: &mut R, len: u64) -> Result<Vec<(u64, u64)>, FormatError> {
    let mut spans = Vec::new();
    let mut end = len;
    while end > 0 {
        if spans.len() >= MAX_ITEMS {
            return Err(FormatError::corrupt(end, "too many items"));
        }
        let start = zip::archive_start(&mut Window::new(r, 0, end), end)?;
        if start >= end {
            return Err(FormatError::corrupt(end, "empty archive"));
        }
        spans.push((start, end));
        end = start;
    }
    spans.reverse();
    Ok(spans)
}

/// `len` bytes of `r` from `start`, seen as a file of their own.
struct Window<'a, R> {
    r: &'a mut R,
    start: u64,
    len: u64,
    pos: u64,
}

impl<'a, R: Read + Seek> Window<'a, R> {
    fn new(r: &'a mut R, start: u64, len: u64) -> Self {
        Window {
            r,
            start,
            len,
            pos: 0,
        }
    }
}

impl<R: Read + Seek> Read for Window<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.len.saturating_sub(self.pos);
        let n = (buf.len() as u64).min(left) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.r.seek(SeekFrom::Start(self.start + self.pos))?;
        let got = self.r.read(&mut buf[..n])?;
        self.pos += got as u64;
        Ok(got)
    }
}

impl<R: Read + Seek> Seek for Window<'_, R> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let target = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match target {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "seek before the start of the window",
            )),
        }
    }
}
