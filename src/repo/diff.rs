//! `diff`: what changed between two commits, file by file and tensor by
//! tensor.
//!
//! Files are compared by their whole-file blake3 (no chunk is read for a
//! file that did not change). In a changed file, tensors are paired by name;
//! a tensor whose chunk ids are the same on both sides is unchanged without
//! reading a chunk; otherwise, when dtype and shape agree, both sides are
//! streamed chunk by chunk (memory: two chunks) and compared element by
//! element in f64 ([`ElementDiff`]). Returns data only: the CLI prints.

use std::collections::HashMap;

use crate::codec::DType;
use crate::format::FileKind;
use crate::store::{ChunkId, CommitId};

use super::objects::{FileManifest, SegmentRef};
use super::{Place, RepoError, Repository, Site};

/// What `diff` reports about two commits.
#[derive(Debug, Clone)]
pub struct DiffReport {
    pub a: CommitId,
    pub b: CommitId,
    pub step_a: u64,
    pub step_b: u64,
    /// Every path of either commit, sorted.
    pub files: Vec<FileDiff>,
}

impl DiffReport {
    /// How many files have `status`.
    pub fn count(&self, status: FileStatus) -> usize {
        self.files.iter().filter(|f| f.status == status).count()
    }

    /// The file at `path`, if either commit has it.
    pub fn file(&self, path: &str) -> Option<&FileDiff> {
        self.files.iter().find(|f| f.path == path)
    }
}

/// A file's fate between the two commits (by whole-file blake3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileStatus {
    Added,
    Removed,
    Changed,
    Unchanged,
}

impl FileStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            FileStatus::Added => "added",
            FileStatus::Removed => "removed",
            FileStatus::Changed => "changed",
            FileStatus::Unchanged => "unchanged",
        }
    }
}

/// One path of either commit.
#[derive(Debug, Clone)]
pub struct FileDiff {
    pub path: String,
    pub status: FileStatus,
    /// The file's kind (in `b`, or in `a` when removed).
    pub kind: FileKind,
    /// Length in `a` (`None`: not in `a`).
    pub len_a: Option<u64>,
    /// Length in `b` (`None`: not in `b`).
    pub len_b: Option<u64>,
    /// For a file in both commits: whether its non-tensor bytes (headers,
    /// pickles, the whole of an opaque file) differ.
    pub opaque_changed: bool,
    /// For a file in both commits: every tensor of either side, paired by
    /// name (`a`'s order, then tensors only `b` has). Empty for added and
    /// removed files.
    pub tensors: Vec<TensorDiff>,
}

/// One tensor name of a file in both commits.
#[derive(Debug, Clone)]
pub struct TensorDiff {
    pub name: String,
    pub change: TensorChange,
}

#[derive(Debug, Clone)]
pub enum TensorChange {
    /// Same chunks (so the same bytes); nothing was read.
    Unchanged {
        dtype: DType,
        shape: Vec<u64>,
    },
    /// Same dtype and shape, different bytes: compared element by element.
    Changed {
        dtype: DType,
        shape: Vec<u64>,
        diff: ElementDiff,
    },
    Added {
        dtype: DType,
        shape: Vec<u64>,
    },
    Removed {
        dtype: DType,
        shape: Vec<u64>,
    },
    /// The dtype or the shape differs; values are not compared.
    Reshaped {
        dtype_a: DType,
        shape_a: Vec<u64>,
        dtype_b: DType,
        shape_b: Vec<u64>,
    },
}

impl TensorChange {
    pub fn as_str(&self) -> &'static str {
        match self {
            TensorChange::Unchanged { .. } => "unchanged",
            TensorChange::Changed { .. } => "changed",
            TensorChange::Added { .. } => "added",
            TensorChange::Removed { .. } => "removed",
            TensorChange::Reshaped { .. } => "reshaped",
        }
    }
}

/// How the elements of one tensor differ between `a` and `b`.
///
/// Computed in f64 from the element values: f64 and f32 directly, f16 and
/// bf16 through the `half` crate, fp8 (E4M3 "fn", E5M2) by their bit
/// layouts, integers and bool as exact integers (the difference of two
/// 64-bit integers is taken in i128, then converted to f64).
///
/// Not-a-number and infinities:
/// - An element is *changed* when the two values are not numerically
///   equal, except that NaN on both sides counts as equal (whatever the
///   payloads). So NaN against a number is changed, `+inf` against `+inf`
///   is not, and `-0.0` against `+0.0` is not (numerically equal).
/// - A changed element whose difference is not finite (NaN on one side, an
///   infinity on one or both sides, or an f64 overflow) is counted in
///   [`ElementDiff::nonfinite`] and left out of the magnitudes:
///   `max_abs`, `mean_abs` and `norm_diff` are over the elements whose
///   difference is finite (unchanged elements count as difference 0), and
///   `norm_a` is over the finite values of `a`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ElementDiff {
    pub elements: u64,
    /// Elements whose values differ (see above).
    pub changed: u64,
    /// Changed elements whose difference is not a finite number.
    pub nonfinite: u64,
    /// Largest finite |b - a|.
    pub max_abs: f64,
    /// Mean of |b - a| over the elements with a finite difference.
    pub mean_abs: f64,
    /// ||a||_2 over the finite values of `a`.
    pub norm_a: f64,
    /// ||b - a||_2 over the finite differences.
    pub norm_diff: f64,
}

impl ElementDiff {
    /// Changed elements over all elements (0 for an empty tensor).
    pub fn fraction_changed(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            self.changed as f64 / self.elements as f64
        }
    }

    /// ||b - a|| / ||a||. When ||a|| = 0: `Some(0.0)` if the difference is
    /// zero too, else `None` (a change from zero has no relative size).
    pub fn rel_l2(&self) -> Option<f64> {
        if self.norm_a > 0.0 {
            Some(self.norm_diff / self.norm_a)
        } else if self.norm_diff == 0.0 {
            Some(0.0)
        } else {
            None
        }
    }
}

impl Repository {
    /// What changed from commit `a` to commit `b`.
    pub fn diff(&self, a: &CommitId, b: &CommitId) -> Result<DiffReport, RepoError> {
        let ca = self.commit_object(a)?;
        let cb = self.commit_object(b)?;
        let ta = self.tree(&ca.tree)?;
        let tb = self.tree(&cb.tree)?;
        let mut files = Vec::new();
        // Both trees are sorted by path: merge them.
        let (mut i, mut j) = (0, 0);
        while i < ta.entries.len() || j < tb.entries.len() {
            let ea = ta.entries.get(i);
            let eb = tb.entries.get(j);
            let order = match (ea, eb) {
                (Some(x), Some(y)) => x.0.cmp(&y.0),
                (Some(_), None) => std::cmp::Ordering::Less,
                _ => std::cmp::Ordering::Greater,
            };
            match order {
                std::cmp::Ordering::Less => {
                    let (path, id) = ea.expect("a has an entry");
                    let m = self.manifest(id, path)?;
                    files.push(FileDiff {
                        path: path.clone(),
                        status: FileStatus::Removed,
                        kind: m.kind,
                        len_a: Some(m.len),
                        len_b: None,
                        opaque_changed: false,
                        tensors: Vec::new(),
                    });
                    i += 1;
                }
                std::cmp::Ordering::Greater => {
                    let (path, id) = eb.expect("b has an entry");
                    let m = self.manifest(id, path)?;
                    files.push(FileDiff {
                        path: path.clone(),
                        status: FileStatus::Added,
                        kind: m.kind,
                        len_a: None,
                        len_b: Some(m.len),
                        opaque_changed: false,
                        tensors: Vec::new(),
                    });
                    j += 1;
                }
                std::cmp::Ordering::Equal => {
                    let (path, ida) = ea.expect("a has an entry");
                    let (_, idb) = eb.expect("b has an entry");
                    let ma = self.manifest(ida, path)?;
                    let mb = if ida == idb {
                        ma.clone()
                    } else {
                        self.manifest(idb, path)?
                    };
                    let ctx = Ctx {
                        path,
                        a: ca.step,
                        b: cb.step,
                    };
                    files.push(self.diff_file(&ma, &mb, &ctx)?);
                    i += 1;
                    j += 1;
                }
            }
        }
        Ok(DiffReport {
            a: *a,
            b: *b,
            step_a: ca.step,
            step_b: cb.step,
            files,
        })
    }

    fn diff_file(
        &self,
        ma: &FileManifest,
        mb: &FileManifest,
        ctx: &Ctx,
    ) -> Result<FileDiff, RepoError> {
        let same = ma.hash == mb.hash && ma.len == mb.len;
        let ka = tensors_by_key(ma);
        let kb = tensors_by_key(mb);
        let in_a: HashMap<_, _> = ka.iter().copied().collect();
        let in_b: HashMap<_, _> = kb.iter().copied().collect();
        let mut tensors = Vec::new();
        for (key, ta) in &ka {
            let change = match in_b.get(key) {
                None => TensorChange::Removed {
                    dtype: ta.dtype,
                    shape: ta.shape.to_vec(),
                },
                Some(tb) if same || ta.chunks == tb.chunks => TensorChange::Unchanged {
                    dtype: tb.dtype,
                    shape: tb.shape.to_vec(),
                },
                Some(tb) if ta.dtype != tb.dtype || ta.shape != tb.shape => {
                    TensorChange::Reshaped {
                        dtype_a: ta.dtype,
                        shape_a: ta.shape.to_vec(),
                        dtype_b: tb.dtype,
                        shape_b: tb.shape.to_vec(),
                    }
                }
                Some(tb) => {
                    let place = Place {
                        file: Some(ctx.path.to_string()),
                        tensor: Some(key.0.to_string()),
                        ..Place::default()
                    };
                    if ta.len != tb.len {
                        return Err(RepoError::Corrupt {
                            site: Site::at(place),
                            reason: format!(
                                "same dtype and shape at steps {} and {} but {} and {} bytes",
                                ctx.a, ctx.b, ta.len, tb.len
                            ),
                        });
                    }
                    let diff = compare_elements(
                        ta.dtype,
                        ta.len,
                        chunk_source(self, ta.chunks),
                        chunk_source(self, tb.chunks),
                    )
                    .map_err(|e| e.placed(&place))?;
                    TensorChange::Changed {
                        dtype: ta.dtype,
                        shape: ta.shape.to_vec(),
                        diff,
                    }
                }
            };
            tensors.push(TensorDiff {
                name: key.0.to_string(),
                change,
            });
        }
        for (key, tb) in &kb {
            if !in_a.contains_key(key) {
                tensors.push(TensorDiff {
                    name: key.0.to_string(),
                    change: TensorChange::Added {
                        dtype: tb.dtype,
                        shape: tb.shape.to_vec(),
                    },
                });
            }
        }
        Ok(FileDiff {
            path: ctx.path.to_string(),
            status: if same {
                FileStatus::Unchanged
            } else {
                FileStatus::Changed
            },
            kind: mb.kind,
            len_a: Some(ma.len),
            len_b: Some(mb.len),
            opaque_changed: !same && opaque_parts(ma) != opaque_parts(mb),
            tensors,
        })
    }
}

/// Where a diff is, for error messages.
struct Ctx<'a> {
    path: &'a str,
    a: u64,
    b: u64,
}

/// A tensor segment of a manifest, borrowed.
#[derive(Clone, Copy)]
struct TensorRef<'m> {
    dtype: DType,
    shape: &'m [u64],
    len: u64,
    chunks: &'m [ChunkId],
}

/// A file's tensors keyed by (name, occurrence of that name), in file order:
/// names are unique in every format ckvc reads, but a damaged or odd file
/// must not make two tensors collide.
fn tensors_by_key(m: &FileManifest) -> Vec<((&str, usize), TensorRef<'_>)> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    m.segments
        .iter()
        .filter_map(|s| match s {
            SegmentRef::Tensor {
                name,
                dtype,
                shape,
                len,
                chunks,
            } => {
                let n = seen.entry(name.as_str()).or_default();
                *n += 1;
                let t = TensorRef {
                    dtype: *dtype,
                    shape,
                    len: *len,
                    chunks,
                };
                Some(((name.as_str(), *n - 1), t))
            }
            SegmentRef::Opaque { .. } => None,
        })
        .collect()
}

/// The non-tensor parts of a file: identical content is cut into identical
/// chunks, so comparing ids compares bytes.
fn opaque_parts(m: &FileManifest) -> Vec<(u64, &[ChunkId])> {
    m.segments
        .iter()
        .filter_map(|s| match s {
            SegmentRef::Opaque { len, chunks } => Some((*len, chunks.as_slice())),
            SegmentRef::Tensor { .. } => None,
        })
        .collect()
}

/// The raw bytes of `chunks`, one chunk per call, `None` after the last.
fn chunk_source<'r>(
    repo: &'r Repository,
    chunks: &'r [ChunkId],
) -> impl FnMut() -> Result<Option<Vec<u8>>, RepoError> + 'r {
    let mut it = chunks.iter();
    move || it.next().map(|id| repo.read_chunk(id)).transpose()
}

/// One side's bytes as a stream of whole elements over its chunks.
struct Elements<F> {
    next_chunk: F,
    buf: Vec<u8>,
    pos: usize,
}

impl<F: FnMut() -> Result<Option<Vec<u8>>, RepoError>> Elements<F> {
    fn new(next_chunk: F) -> Self {
        Elements {
            next_chunk,
            buf: Vec::new(),
            pos: 0,
        }
    }

    /// Make at least `w` bytes available, carrying the bytes of an element
    /// split across chunks over into the next one. False when the chunks
    /// are exhausted first.
    fn fill(&mut self, w: usize) -> Result<bool, RepoError> {
        while self.buf.len() - self.pos < w {
            let Some(raw) = (self.next_chunk)()? else {
                return Ok(false);
            };
            if self.pos == self.buf.len() {
                self.buf = raw;
            } else {
                self.buf.drain(..self.pos);
                self.buf.extend_from_slice(&raw);
            }
            self.pos = 0;
        }
        Ok(true)
    }

    fn available(&self) -> &[u8] {
        &self.buf[self.pos..]
    }
}

/// Compare two tensors of `dtype` and `len` bytes given as chunk streams;
/// the two sides may be cut at different offsets.
fn compare_elements(
    dtype: DType,
    len: u64,
    a: impl FnMut() -> Result<Option<Vec<u8>>, RepoError>,
    b: impl FnMut() -> Result<Option<Vec<u8>>, RepoError>,
) -> Result<ElementDiff, RepoError> {
    let w = dtype.width();
    let bad = |reason: String| RepoError::Corrupt {
        site: Site::at(Place::default()),
        reason,
    };
    if len % w as u64 != 0 {
        return Err(bad(format!(
            "{len} bytes is not a whole number of {w}-byte elements"
        )));
    }
    let mut ea = Elements::new(a);
    let mut eb = Elements::new(b);
    let mut acc = Acc::default();
    loop {
        match (ea.fill(w)?, eb.fill(w)?) {
            (true, true) => {}
            (false, false) => break,
            _ => {
                return Err(bad(
                    "the two sides hold different numbers of elements".into()
                ))
            }
        }
        let (xa, xb) = (ea.available(), eb.available());
        let n = xa.len().min(xb.len()) / w * w;
        acc.add(dtype, &xa[..n], &xb[..n]);
        ea.pos += n;
        eb.pos += n;
    }
    if !ea.available().is_empty() || !eb.available().is_empty() {
        return Err(bad("chunks end inside an element".into()));
    }
    if acc.elements * w as u64 != len {
        return Err(bad(format!(
            "chunks hold {} bytes, the tensor {len}",
            acc.elements * w as u64
        )));
    }
    Ok(acc.finish())
}

/// Running sums of an element comparison.
#[derive(Debug, Default)]
struct Acc {
    elements: u64,
    changed: u64,
    nonfinite: u64,
    finite: u64,
    sum_abs: f64,
    sum_sq_diff: f64,
    sum_sq_a: f64,
    max_abs: f64,
}

impl Acc {
    /// Add the elements of `a` and `b` (equal lengths, whole elements).
    fn add(&mut self, dtype: DType, a: &[u8], b: &[u8]) {
        debug_assert_eq!(a.len(), b.len());
        let w = dtype.width();
        let pairs = a.chunks_exact(w).zip(b.chunks_exact(w));
        match dtype {
            DType::F64 => pairs.for_each(|(x, y)| self.float(f64le(x), f64le(y))),
            DType::F32 => pairs.for_each(|(x, y)| self.float(f32le(x), f32le(y))),
            DType::F16 => pairs.for_each(|(x, y)| {
                self.float(
                    half::f16::from_bits(u16le(x)).to_f64(),
                    half::f16::from_bits(u16le(y)).to_f64(),
                )
            }),
            DType::BF16 => pairs.for_each(|(x, y)| {
                self.float(
                    half::bf16::from_bits(u16le(x)).to_f64(),
                    half::bf16::from_bits(u16le(y)).to_f64(),
                )
            }),
            DType::F8E4M3 => pairs.for_each(|(x, y)| self.float(f8e4m3(x[0]), f8e4m3(y[0]))),
            DType::F8E5M2 => pairs.for_each(|(x, y)| self.float(f8e5m2(x[0]), f8e5m2(y[0]))),
            DType::Bool | DType::U8 => {
                pairs.for_each(|(x, y)| self.int(i128::from(x[0]), i128::from(y[0])))
            }
            DType::I8 => {
                pairs.for_each(|(x, y)| self.int(i128::from(x[0] as i8), i128::from(y[0] as i8)))
            }
            DType::I16 => pairs.for_each(|(x, y)| {
                self.int(i128::from(u16le(x) as i16), i128::from(u16le(y) as i16))
            }),
            DType::U16 => {
                pairs.for_each(|(x, y)| self.int(i128::from(u16le(x)), i128::from(u16le(y))))
            }
            DType::I32 => pairs.for_each(|(x, y)| {
                self.int(i128::from(u32le(x) as i32), i128::from(u32le(y) as i32))
            }),
            DType::U32 => {
                pairs.for_each(|(x, y)| self.int(i128::from(u32le(x)), i128::from(u32le(y))))
            }
            DType::I64 => pairs.for_each(|(x, y)| {
                self.int(i128::from(u64le(x) as i64), i128::from(u64le(y) as i64))
            }),
            DType::U64 => {
                pairs.for_each(|(x, y)| self.int(i128::from(u64le(x)), i128::from(u64le(y))))
            }
        }
    }

    fn float(&mut self, x: f64, y: f64) {
        self.elements += 1;
        if x.is_finite() {
            self.sum_sq_a += x * x;
        }
        let d = if x == y || (x.is_nan() && y.is_nan()) {
            0.0
        } else {
            self.changed += 1;
            (y - x).abs()
        };
        self.magnitude(d);
    }

    fn int(&mut self, x: i128, y: i128) {
        self.elements += 1;
        let xf = x as f64;
        self.sum_sq_a += xf * xf;
        if x != y {
            self.changed += 1;
        }
        self.magnitude((y - x).unsigned_abs() as f64);
    }

    fn magnitude(&mut self, d: f64) {
        if d.is_finite() {
            self.finite += 1;
            self.sum_abs += d;
            self.sum_sq_diff += d * d;
            if d > self.max_abs {
                self.max_abs = d;
            }
        } else {
            self.nonfinite += 1;
        }
    }

    fn finish(self) -> ElementDiff {
        ElementDiff {
            elements: self.elements,
            changed: self.changed,
            nonfinite: self.nonfinite,
            max_abs: self.max_abs,
            mean_abs: if self.finite == 0 {
                0.0
            } else {
                self.sum_abs / self.finite as f64
            },
            norm_a: self.sum_sq_a.sqrt(),
            norm_diff: self.sum_sq_diff.sqrt(),
        }
    }
}

fn u16le(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn u32le(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4-byte element"))
}
fn u64le(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8-byte element"))
}
fn f32le(b: &[u8]) -> f64 {
    f64::from(f32::from_bits(u32le(b)))
}
fn f64le(b: &[u8]) -> f64 {
    f64::from_bits(u64le(b))
}

/// fp8 E4M3 ("fn": bias 7, no infinities, S.1111.111 is NaN).
fn f8e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f64::from(b & 7);
    if e == 0xf && b & 7 == 7 {
        f64::NAN
    } else if e == 0 {
        sign * m * (-9f64).exp2()
    } else {
        sign * (1.0 + m / 8.0) * f64::from(e - 7).exp2()
    }
}

/// fp8 E5M2: the top byte of an IEEE binary16.
fn f8e5m2(b: u8) -> f64 {
    half::f16::from_bits(u16::from(b) << 8).to_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compare `a` and `b` with each side cut into chunks of the given byte
    /// sizes (cycled), so elements straddle chunk boundaries.
    fn cmp_cut(dtype: DType, a: &[u8], b: &[u8], cut_a: usize, cut_b: usize) -> ElementDiff {
        fn src(
            bytes: &[u8],
            cut: usize,
        ) -> impl FnMut() -> Result<Option<Vec<u8>>, RepoError> + '_ {
            let mut it = bytes.chunks(cut);
            move || Ok(it.next().map(<[u8]>::to_vec))
        }
        compare_elements(dtype, a.len() as u64, src(a, cut_a), src(b, cut_b)).unwrap()
    }

    fn cmp(dtype: DType, a: &[u8], b: &[u8]) -> ElementDiff {
        let whole = cmp_cut(dtype, a, b, a.len().max(1), b.len().max(1));
        // Any cutting gives the same answer.
        for (ca, cb) in [(1, 1), (3, 5), (7, 2)] {
            assert_eq!(cmp_cut(dtype, a, b, ca, cb), whole, "cuts {ca} {cb}");
        }
        whole
    }

    fn close(x: f64, y: f64) -> bool {
        (x - y).abs() <= 1e-12 * y.abs().max(1.0)
    }

    #[test]
    fn f32_differences_with_nan_and_inf() {
        let enc = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let a = [
            1.0f32,
            2.0,
            -3.0,
            f32::NAN,
            f32::NAN,
            f32::INFINITY,
            5.0,
            0.0,
            -0.0,
        ];
        let b = [
            1.5f32,
            2.0,
            -1.0,
            f32::NAN,
            4.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            0.0,
        ];
        let d = cmp(DType::F32, &enc(&a), &enc(&b));
        assert_eq!(d.elements, 9);
        // changed: 1.0->1.5, -3->-1, NaN->4, 5->-inf; NaN/NaN, inf/inf, +-0 are equal
        assert_eq!(d.changed, 4);
        assert_eq!(d.nonfinite, 2, "NaN->4 and 5->-inf");
        assert_eq!(d.max_abs, 2.0);
        // finite differences: 0.5, 0, 2, 0 (inf/inf), 0, 0, 0 over 7 elements
        assert!(close(d.mean_abs, 2.5 / 7.0), "{}", d.mean_abs);
        assert!(close(d.norm_diff, (0.25f64 + 4.0).sqrt()));
        assert!(close(d.norm_a, (1.0f64 + 4.0 + 9.0 + 25.0).sqrt()));
        assert!(close(d.rel_l2().unwrap(), d.norm_diff / d.norm_a));
        assert!(close(d.fraction_changed(), 4.0 / 9.0));
    }

    #[test]
    fn bf16_and_f16_go_through_half() {
        let a = [0.5f32, -2.0, 1.0, 0.0];
        let b = [0.75f32, -2.0, f32::NAN, 0.0];
        let bf = |v: &[f32]| {
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let d = cmp(DType::BF16, &bf(&a), &bf(&b));
        assert_eq!((d.elements, d.changed, d.nonfinite), (4, 2, 1));
        assert_eq!(d.max_abs, 0.25);
        assert!(close(d.mean_abs, 0.25 / 3.0));
        assert!(close(
            d.rel_l2().unwrap(),
            0.25 / (0.25f64 + 4.0 + 1.0).sqrt()
        ));

        // f16: 1/3 is not exact; the difference is of the f16 values.
        let h = |v: &[f32]| {
            v.iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let a = [1.0f32 / 3.0, 100.0, f32::INFINITY];
        let b = [0.0f32, 100.0, 65504.0];
        let d = cmp(DType::F16, &h(&a), &h(&b));
        let third = half::f16::from_f32(1.0 / 3.0).to_f64();
        assert_eq!((d.elements, d.changed, d.nonfinite), (3, 2, 1));
        assert_eq!(d.max_abs, third);
        assert!(close(d.norm_a, (third * third + 10000.0).sqrt()));
    }

    #[test]
    fn i64_differences_are_exact_integers() {
        let enc = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let a = [i64::MIN, 0, 7, -5];
        let b = [i64::MAX, 0, 7, 5];
        let d = cmp(DType::I64, &enc(&a), &enc(&b));
        assert_eq!((d.elements, d.changed, d.nonfinite), (4, 2, 0));
        // 2^64 - 1 does not overflow: taken in i128
        assert_eq!(d.max_abs, u64::MAX as f64);
        assert!(close(d.mean_abs, (u64::MAX as f64 + 10.0) / 4.0));
        let same = cmp(DType::I64, &enc(&a), &enc(&a));
        assert_eq!(same.changed, 0);
        assert_eq!(same.rel_l2(), Some(0.0));
    }

    #[test]
    fn zero_norm_a_has_no_relative_change() {
        let z = vec![0u8; 8];
        let one = 1.0f32
            .to_le_bytes()
            .into_iter()
            .chain([0; 4])
            .collect::<Vec<_>>();
        assert_eq!(cmp(DType::F32, &z, &z).rel_l2(), Some(0.0));
        let d = cmp(DType::F32, &z, &one);
        assert_eq!(d.rel_l2(), None);
        assert_eq!(d.fraction_changed(), 0.5);
        assert_eq!(cmp(DType::F32, &[], &[]), ElementDiff::default());
    }

    #[test]
    fn fp8_decoding() {
        assert_eq!(f8e4m3(0x38), 1.0);
        assert_eq!(f8e4m3(0x7e), 448.0);
        assert_eq!(f8e4m3(0x01), (-9f64).exp2());
        assert!(f8e4m3(0x7f).is_nan() && f8e4m3(0xff).is_nan());
        assert_eq!(f8e5m2(0x3c), 1.0);
        assert_eq!(f8e5m2(0x7c), f64::INFINITY);
        assert!(f8e5m2(0x7e).is_nan());
    }

    #[test]
    fn length_mismatches_are_corruption_not_panics() {
        let src = |v: Vec<Vec<u8>>| {
            let mut it = v.into_iter();
            move || Ok(it.next())
        };
        let e = compare_elements(DType::F32, 8, src(vec![vec![0; 8]]), src(vec![vec![0; 4]]));
        assert!(matches!(e, Err(RepoError::Corrupt { .. })));
        let e = compare_elements(DType::F32, 8, src(vec![vec![0; 9]]), src(vec![vec![0; 9]]));
        assert!(matches!(e, Err(RepoError::Corrupt { .. })));
        let e = compare_elements(DType::F32, 7, src(vec![]), src(vec![]));
        assert!(matches!(e, Err(RepoError::Corrupt { .. })));
    }
}
