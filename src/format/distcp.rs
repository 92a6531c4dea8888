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
//! Tensors are named `<item>/<name in the archive>`, `<item>` counting the
//! archives from 0 in file order: a run that saves the same state with the
//! same world size writes the same items in the same order at every step,
//! so each tensor finds its delta base under the same name.
//!
//! Anything not understood (a file that is not such a sequence, compressed
//! or encrypted entries, a transform DCP applied to the stream) keeps the
//! whole file as one opaque segment: a DCP file never fails a commit.

use std::io::{Read, Seek, SeekFrom};

use super::{parse_torch_zip, zip, FileKind, FormatError, Layout, Segment, TensorInfo};

/// The most archives walked in one file (a write item each); a file with
/// more is kept opaque rather than parsed in time quadratic in its items.
const MAX_ITEMS: usize = 1 << 20;

/// Parses a `.distcp` file; never an error for content it does not
/// understand (the whole file is then opaque), only for I/O errors.
pub fn parse_distcp<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    match items(r, len) {
        Ok(layout) => Ok(layout),
        Err(FormatError::Io(e)) => Err(FormatError::Io(e)),
        Err(_) => Ok(Layout::opaque(len)),
    }
}

fn items<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    // The archives' spans, walked back from the end.
    if len == 0 {
        return Err(FormatError::corrupt(0, "empty"));
    }
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
    let mut segments = Vec::new();
    for (item, (start, end)) in spans.into_iter().enumerate() {
        let n = end - start;
        let inner = parse_torch_zip(&mut Window::new(r, start, n), n)?;
        if inner.kind != FileKind::TorchZip {
            return Err(FormatError::corrupt(
                start,
                "an item is not a torch archive",
            ));
        }
        for seg in inner.segments {
            segments.push(match seg {
                Segment::Tensor(t) => Segment::Tensor(TensorInfo {
                    name: format!("{item}/{}", t.name),
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
