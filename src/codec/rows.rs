//! Row frames (format version 8, codec id 2): a chunk of a float matrix
//! whose rows are near copies of one another, up to scale, stored as a
//! few *root* rows whole and every other row as a delta against one root.
//!
//! Where it pays: Adam's moments of an output embedding. Every vocabulary
//! row's gradient is the softmax probability of its token times the same
//! hidden states, so the rows of `exp_avg` and `exp_avg_sq` of the tokens
//! a batch did not contain point the same way (cosine 0.9999 in the
//! generated GPT-2-shaped runs). Order-0 coding of byte streams, and
//! zstd's 128 KiB window, cannot see rows 1 KiB apart agreeing in their
//! top mantissa bits; a delta against a row of about the same norm can.
//!
//! Owns: the row geometry of a chunk ([`Rows`]), the cheap screen that
//! decides whether a chunk's rows are alike enough to try, the choice of
//! roots (rows ordered by sign along their mean direction, then norm, in
//! groups of [`GROUP`] with the middle one the root), and the root map and
//! root index sections of the frame. The frame itself (two inner frames)
//! is assembled and taken apart in `codec/mod.rs`, which owns the codec.
//! Stands on `leb`, `dtype` and the codec's error type.

use super::bits::BitWriter;
use super::{leb, DType, DecodeError};

/// Rows of one root: one root and up to `GROUP - 1` rows coded against it.
pub const GROUP: usize = 16;
/// Fewest whole rows a chunk needs for a row frame to be tried.
pub const MIN_ROWS: usize = 2 * GROUP;
/// Fewest elements a row needs (shorter rows: the index costs too much).
pub const MIN_ROW_LEN: usize = 16;
/// Rows the screen samples: 16 spread over the chunk. 128 cost FULL
/// weights, which the screen turns away, 20-25% of their encode speed
/// (fp32 2081 -> 1647 MiB/s in codec-bench); the median of 15 cosines
/// separates weights (near 0) from alike rows (0.85 and up) as well.
const SAMPLE_ROWS: usize = 16;
/// The screen passes when the median cosine between neighbours of the
/// sample, in root order, is at least this. Measured with the screen off
/// (`examples/row_frames`) on the optimizer state of gpt-small, bert-ft
/// and the generated fp32 and bf16 runs: chunks below 0.85 gained
/// nothing (weights sit near 0, `exp_avg` of most layers at 0.3-0.7),
/// some at 0.85-0.9 gained 2-4% (positive `exp_avg_sq` rows), and the
/// output embedding's moments (0.97-0.99999) 4-36%. 0.9, not 0.85: a
/// pretrained embedding's weights (bert-ft's, 0.83-0.87) gained at most
/// 2% for a key pass and three encodes that halved their encode speed,
/// and the 2-4% of the chunks between pay the same.
const MIN_COSINE: f32 = 0.9;

/// Whether the encoder tries a row frame (for a chunk whose [`Rows`] it
/// is given).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowFrames {
    /// Never.
    Never,
    /// For a whole float chunk of at least [`MIN_ROWS`] rows of
    /// [`MIN_ROW_LEN`] elements or more whose rows a sample finds alike,
    /// kept when it saves this fraction of the plain frame (a row frame
    /// decodes two frames and moves every row, so it is slower).
    Auto { min_gain: f32 },
    /// For every whole float chunk of two rows or more, whatever it
    /// saves (tests, fuzz).
    Always,
}

/// Where a chunk's rows lie: the tensor's row length (its last dimension,
/// in elements) and how many elements of the chunk come before the first
/// row that starts inside it (the end of a row the previous chunk began).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Elements per row.
    pub len: usize,
    /// Elements before the first whole row, below `len`.
    pub lead: usize,
}

impl Rows {
    /// The rows of a chunk that starts at element `start` of a tensor
    /// whose shape is `shape`: `None` for tensors of fewer than two
    /// dimensions or rows shorter than [`MIN_ROW_LEN`].
    pub fn of_chunk(shape: &[u64], start: u64) -> Option<Rows> {
        let &last = shape.last()?;
        if shape.len() < 2 || last < MIN_ROW_LEN as u64 || last > u32::MAX as u64 {
            return None;
        }
        let lead = (last - start % last) % last;
        Some(Rows {
            len: last as usize,
            lead: lead as usize,
        })
    }
}

/// The split of a chunk of `n` whole elements by [`Rows`]: `lead`
/// elements, `count` rows of `len`, then `trail` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub len: usize,
    pub lead: usize,
    pub count: usize,
    pub trail: usize,
}

impl Geometry {
    /// `None` when the chunk holds no whole row.
    pub fn new(n: usize, rows: Rows) -> Option<Geometry> {
        if rows.len == 0 || rows.lead >= rows.len || rows.lead > n {
            return None;
        }
        let count = (n - rows.lead) / rows.len;
        let trail = n - rows.lead - count * rows.len;
        (count > 0).then_some(Geometry {
            len: rows.len,
            lead: rows.lead,
            count,
            trail,
        })
    }

    /// Byte range of row `i` in the chunk, for elements of `w` bytes.
    pub fn row(&self, i: usize, w: usize) -> std::ops::Range<usize> {
        let at = (self.lead + i * self.len) * w;
        at..at + self.len * w
    }
}

/// Which rows are roots and which root each other row is coded against.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// One per row: the row is a root.
    pub is_root: Vec<bool>,
    /// The root rows, ascending.
    pub roots: Vec<u32>,
    /// One per other row, in row order: the index in `roots` of its root.
    pub of: Vec<u32>,
}

/// Whether `dtype` can have row frames.
pub fn float_rows(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// A row's values as `f32`, into `out`.
fn values_of(row: &[u8], dtype: DType, out: &mut Vec<f32>) {
    out.clear();
    match dtype {
        DType::F32 => out.extend(
            row.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        DType::BF16 => out.extend(
            row.chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)),
        ),
        _ => out.extend(
            row.chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
    }
}

/// Eight-lane sums of `a[i] * b[i]` and `a[i] * a[i]` (the compiler keeps
/// the lanes in vector registers; one running sum would be sequential).
fn dot_norm(a: &[f32], b: &[f32]) -> (f32, f32) {
    let mut dot = [0f32; 8];
    let mut sq = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        let (x, y): (&[f32; 8], &[f32; 8]) = (x.try_into().expect("8"), y.try_into().expect("8"));
        for k in 0..8 {
            dot[k] += x[k] * y[k];
            sq[k] += x[k] * x[k];
        }
    }
    for (k, (x, y)) in ar.iter().zip(br).enumerate() {
        dot[k] += x * y;
        sq[k] += x * x;
    }
    (dot.iter().sum(), sq.iter().sum())
}

/// Up to [`SAMPLE_ROWS`] rows spread evenly over the chunk, as `f32`
/// (row after row), and the direction rows are signed by: the sign of
/// each column's sum over them.
struct Sample {
    rows: usize,
    values: Vec<f32>,
    dir: Vec<f32>,
}

fn sample(body: &[u8], g: &Geometry, dtype: DType) -> Sample {
    let w = dtype.width();
    let step = g.count.div_ceil(SAMPLE_ROWS).max(1);
    let mut values = Vec::with_capacity(g.count.div_ceil(step) * g.len);
    let mut v = Vec::with_capacity(g.len);
    for i in (0..g.count).step_by(step) {
        values_of(&body[g.row(i, w)], dtype, &mut v);
        values.extend_from_slice(&v);
    }
    let mut sum = vec![0f32; g.len];
    for row in values.chunks_exact(g.len) {
        for (s, x) in sum.iter_mut().zip(row) {
            *s += if x.is_finite() { *x } else { 0.0 };
        }
    }
    Sample {
        rows: values.len() / g.len,
        values,
        dir: sum
            .iter()
            .map(|s| if *s < 0.0 { -1.0 } else { 1.0 })
            .collect(),
    }
}

/// The direction [`plan`] signs rows by, from a sample of them.
pub fn direction(body: &[u8], g: &Geometry, dtype: DType) -> Vec<f32> {
    sample(body, g, dtype).dir
}

/// The order key of a row's values: its sign along `dir`, then its
/// squared norm (non-finite values order last, as the largest norm).
fn key(v: &[f32], dir: &[f32]) -> (bool, f32) {
    let (dot, sq) = dot_norm(v, dir);
    signed_norm(dot, sq)
}

/// The key of a row from its dot product with the direction and its
/// squared norm.
fn signed_norm(dot: f32, sq: f32) -> (bool, f32) {
    let sq = if sq.is_finite() { sq } else { f32::INFINITY };
    (dot >= 0.0, sq)
}

/// [`key`] of an f32 (`W` 4) or bf16 (`W` 2) row read straight from its
/// bytes, eight lanes at a time: the key pass reads every row of a chunk
/// the screen passes, and going through a vector of `f32` made it cost
/// as much as coding the chunk.
#[inline(always)]
fn row_key<const W: usize>(row: &[u8], dir: &[f32]) -> (bool, f32) {
    // The bits of the f32 that element `k` of `b` (`W` bytes each) is.
    let bits_of = |b: &[u8], k: usize| {
        if W == 4 {
            u32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]])
        } else {
            u32::from(u16::from_le_bytes([b[2 * k], b[2 * k + 1]])) << 16
        }
    };
    let mut dot = [0f32; 8];
    let mut sq = [0f32; 8];
    let bytes = row.chunks_exact(8 * W);
    let (rest, dirs) = (bytes.remainder(), dir.chunks_exact(8));
    let dir_rest = dirs.remainder();
    for (b, d) in bytes.zip(dirs) {
        // Eight values as one load: the lanes' bits, then the floats.
        let mut bits = [0u32; 8];
        for (k, v) in bits.iter_mut().enumerate() {
            *v = bits_of(b, k);
        }
        let d: &[f32; 8] = d.try_into().expect("8 directions");
        for k in 0..8 {
            let x = f32::from_bits(bits[k]);
            dot[k] += x * d[k];
            sq[k] += x * x;
        }
    }
    for (k, (b, d)) in rest.chunks_exact(W).zip(dir_rest).enumerate() {
        let x = f32::from_bits(bits_of(b, 0));
        dot[k] += x * d;
        sq[k] += x * x;
    }
    signed_norm(dot.iter().sum(), sq.iter().sum())
}

/// [`row_key`] of every row of an f32 (`W` 4) or bf16 (`W` 2) chunk,
/// appended to `out`: one call compiled for the CPU's widest vectors
/// (eight lanes in one register; the baseline build splits them in two
/// and shuffles), the same sums in the same order either way.
#[inline(always)]
fn keys_body<const W: usize>(body: &[u8], g: &Geometry, dir: &[f32], out: &mut Vec<(bool, f32)>) {
    for i in 0..g.count {
        out.push(row_key::<W>(&body[g.row(i, W)], dir));
    }
}

#[inline(always)]
fn keys_f32_body(body: &[u8], g: &Geometry, dir: &[f32], out: &mut Vec<(bool, f32)>) {
    keys_body::<4>(body, g, dir, out)
}

#[inline(always)]
fn keys_bf16_body(body: &[u8], g: &Geometry, dir: &[f32], out: &mut Vec<(bool, f32)>) {
    keys_body::<2>(body, g, dir, out)
}

dispatch!(keys_f32, keys_f32_body, (body: &[u8], g: &Geometry, dir: &[f32], out: &mut Vec<(bool, f32)>));
dispatch!(keys_bf16, keys_bf16_body, (body: &[u8], g: &Geometry, dir: &[f32], out: &mut Vec<(bool, f32)>));

fn by_key(keys: &[(bool, f32)]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    |&a, &b| {
        let (ka, kb) = (keys[a as usize], keys[b as usize]);
        ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1)).then(a.cmp(&b))
    }
}

/// Whether the rows of `body` look alike enough to try a row frame: the
/// median cosine between neighbours, in root order, of up to
/// [`SAMPLE_ROWS`] rows spread over the chunk (weights, cosines near 0,
/// stop here). When they do, the direction [`plan`] signs rows by.
pub fn screen(body: &[u8], g: &Geometry, dtype: DType) -> Option<Vec<f32>> {
    // Two pairs of rows first: weights' rows are near orthogonal (|cosine|
    // below 0.2), alike rows point the same way or the opposite way.
    let w = dtype.width();
    let (mut u, mut v) = (Vec::with_capacity(g.len), Vec::with_capacity(g.len));
    let c = g.count;
    let aligned = [(0, c / 2), (c / 4, 3 * c / 4)].iter().any(|&(i, j)| {
        values_of(&body[g.row(i, w)], dtype, &mut u);
        values_of(&body[g.row(j, w)], dtype, &mut v);
        let (uv, uu) = dot_norm(&u, &v);
        let (_, vv) = dot_norm(&v, &v);
        uu > 0.0 && vv > 0.0 && uv.abs() >= 0.5 * (uu.sqrt() * vv.sqrt())
    });
    if !aligned {
        return None;
    }
    let s = sample(body, g, dtype);
    if s.rows < SAMPLE_ROWS / 2 {
        return None;
    }
    let row = |i: u32| &s.values[i as usize * g.len..(i as usize + 1) * g.len];
    let keys: Vec<(bool, f32)> = (0..s.rows as u32).map(|i| key(row(i), &s.dir)).collect();
    let mut order: Vec<u32> = (0..s.rows as u32).collect();
    order.sort_unstable_by(by_key(&keys));
    // Pairs of zero rows are left out: the plain frame's element map
    // stores zero rows for next to nothing (bert-ft's embedding moments,
    // most of whose rows are zero, gained 1-2% for three encodes).
    let mut cos: Vec<f32> = order
        .windows(2)
        .filter_map(|p| {
            let (ab, aa) = dot_norm(row(p[0]), row(p[1]));
            let bb = keys[p[1] as usize].1;
            match (aa > 0.0, bb > 0.0) {
                (false, false) => None,
                (true, true) => {
                    let c = ab / (aa.sqrt() * bb.sqrt());
                    Some(if c.is_finite() { c } else { -1.0 })
                }
                _ => Some(0.0),
            }
        })
        .collect();
    if cos.len() < SAMPLE_ROWS / 2 {
        return None;
    }
    let mid = cos.len() / 2;
    let (_, median, _) = cos.select_nth_unstable_by(mid, |a, b| a.total_cmp(b));
    (*median >= MIN_COSINE).then_some(s.dir)
}

/// The roots of the rows of `body`: rows ordered by sign along `dir`
/// (from [`screen`] or [`direction`]), then by norm, cut into groups of
/// [`GROUP`]; the middle row of each group is its root.
pub fn plan(body: &[u8], g: &Geometry, dtype: DType, dir: &[f32]) -> Plan {
    let w = dtype.width();
    let mut v = Vec::with_capacity(g.len);
    let mut keys = Vec::with_capacity(g.count);
    match dtype {
        DType::F32 => keys_f32(body, g, dir, &mut keys),
        DType::BF16 => keys_bf16(body, g, dir, &mut keys),
        _ => keys.extend((0..g.count).map(|i| {
            values_of(&body[g.row(i, w)], dtype, &mut v);
            key(&v, dir)
        })),
    }
    // Sign, norm and row number packed in one integer that sorts the
    // same (a non-negative float's bits order as it does): a third of
    // the comparisons' cost on a chunk of 8192 rows.
    let mut packed: Vec<u64> = keys
        .iter()
        .enumerate()
        .map(|(i, &(sign, sq))| {
            let sq = if sq > 0.0 { sq } else { 0.0 };
            u64::from(sign) << 63 | u64::from(sq.to_bits()) << 31 | i as u64
        })
        .collect();
    packed.sort_unstable();
    let order: Vec<u32> = packed.iter().map(|&k| (k & 0x7fff_ffff) as u32).collect();
    let mut root_of = vec![0u32; g.count];
    let mut is_root = vec![false; g.count];
    for group in order.chunks(GROUP) {
        let root = group[group.len() / 2];
        is_root[root as usize] = true;
        for &r in group {
            root_of[r as usize] = root;
        }
    }
    let roots: Vec<u32> = (0..g.count as u32)
        .filter(|&i| is_root[i as usize])
        .collect();
    // Root row number -> its index among the roots.
    let mut index = vec![0u32; g.count];
    for (k, &r) in roots.iter().enumerate() {
        index[r as usize] = k as u32;
    }
    let of = (0..g.count)
        .filter(|&i| !is_root[i])
        .map(|i| index[root_of[i] as usize])
        .collect();
    Plan { is_root, roots, of }
}

/// The mean number of leading bits a row shares with its root (the
/// leading zeros of their XOR, element by element), over every 8th
/// group of rows: what a delta against the root saves per element
/// before entropy coding, which the plain frame saves partly too (an
/// exponent byte codes to 2-3 bits).
pub fn shared_bits(body: &[u8], g: &Geometry, dtype: DType, plan: &Plan) -> f64 {
    let w = dtype.width();
    let (mut bits, mut n) = (0u64, 0u64);
    let others = (0..g.count).filter(|&i| !plan.is_root[i]);
    for (k, (i, &x)) in others.zip(&plan.of).enumerate() {
        if (k / GROUP) % 8 != 0 {
            continue;
        }
        let row = &body[g.row(i, w)];
        let root = &body[g.row(plan.roots[x as usize] as usize, w)];
        // Zero elements are left out: the plain frame's element map
        // stores them for next to nothing too.
        let (b, c) = match w {
            4 => shared::<4>(row, root),
            _ => shared::<2>(row, root),
        };
        bits += b;
        n += c;
    }
    bits as f64 / n.max(1) as f64
}

/// Summed leading zeros of `a[i] ^ b[i]` over the `W`-byte elements of
/// `a` that are not zero, and how many those are.
fn shared<const W: usize>(a: &[u8], b: &[u8]) -> (u64, u64) {
    let (mut bits, mut n) = (0u64, 0u64);
    for (x, y) in a.chunks_exact(W).zip(b.chunks_exact(W)) {
        let (mut u, mut v) = ([0u8; 8], [0u8; 8]);
        u[..W].copy_from_slice(x);
        v[..W].copy_from_slice(y);
        let (u, v) = (u64::from_le_bytes(u), u64::from_le_bytes(v));
        if u != 0 {
            bits += u64::from((u ^ v).leading_zeros()) + 8 * W as u64 - 64;
            n += 1;
        }
    }
    (bits, n)
}

/// The fewest [`shared_bits`] a chunk of `w`-byte elements needs for its
/// row frame to be built. Measured (`examples/row_frames`, 275 chunks of
/// optimizer state of both corpora and the generated runs): f32 chunks
/// below 7.5 shared bits gained under 2% but for three (3-5%), bf16
/// chunks below 5.8 nothing; above, most gained 2-15% (f32) and 5-36%
/// (bf16).
pub fn min_shared_bits(w: usize) -> f64 {
    if w == 4 {
        7.5
    } else {
        5.8
    }
}

/// Bits of one root index when there are `roots` roots.
pub fn index_bits(roots: usize) -> u32 {
    usize::BITS - roots.saturating_sub(1).leading_zeros()
}

/// The root map (one bit per row, least significant first, 1 = root)
/// and the root indices (`index_bits` each, least significant first),
/// as the frame stores them after the root count.
pub fn write_plan(plan: &Plan, out: &mut Vec<u8>) {
    let mut bytes = vec![0u8; plan.is_root.len().div_ceil(8)];
    for (i, _) in plan.is_root.iter().enumerate().filter(|(_, r)| **r) {
        bytes[i / 8] |= 1 << (i % 8);
    }
    out.extend_from_slice(&bytes);
    let b = index_bits(plan.roots.len());
    let mut w = BitWriter::default();
    for &x in &plan.of {
        w.put(u64::from(x), b, out);
    }
    w.finish(out);
}

/// The root map and indices of a frame of `count` rows and `roots`
/// roots at `frame[pos..]`, checked: as many set bits as roots, every
/// index below `roots`, padding bits 0. Returns the plan (its `roots`
/// ascending) and the position after it.
pub fn read_plan(
    frame: &[u8],
    pos: usize,
    count: usize,
    roots: usize,
) -> Result<(Plan, usize), DecodeError> {
    use super::corrupt;
    let map_len = count.div_ceil(8);
    let b = index_bits(roots);
    let others = count - roots;
    let idx_len = (others * b as usize).div_ceil(8);
    let end = pos + map_len + idx_len;
    let section = frame.get(pos..end).ok_or(DecodeError::Truncated {
        need: end as u64,
        have: frame.len() as u64,
    })?;
    let (map, idx) = section.split_at(map_len);
    if count % 8 != 0 && map[map_len - 1] >> (count % 8) != 0 {
        return Err(corrupt(pos + map_len - 1, "root map padding bits set"));
    }
    let set: usize = map.iter().map(|b| b.count_ones() as usize).sum();
    if set != roots {
        return Err(corrupt(pos, "root map does not mark as many rows as roots"));
    }
    let is_root: Vec<bool> = (0..count).map(|i| map[i / 8] >> (i % 8) & 1 == 1).collect();
    let root_rows: Vec<u32> = (0..count as u32).filter(|&i| is_root[i as usize]).collect();
    let mut of = Vec::with_capacity(others);
    let mask = (1u64 << b) - 1;
    let (mut acc, mut have, mut at) = (0u64, 0u32, 0usize);
    for _ in 0..others {
        while have < b {
            acc |= u64::from(idx[at]) << have;
            at += 1;
            have += 8;
        }
        let x = acc & mask;
        acc >>= b;
        have -= b;
        if x as usize >= roots {
            return Err(corrupt(pos + map_len + at - 1, "root index out of range"));
        }
        of.push(x as u32);
    }
    if acc != 0 {
        return Err(corrupt(end - 1, "root index padding bits set"));
    }
    Ok((
        Plan {
            is_root,
            roots: root_rows,
            of,
        },
        end,
    ))
}

/// The row section's three numbers: row length, lead, root count.
pub fn read_numbers(frame: &[u8], pos: usize) -> Result<([usize; 3], usize), DecodeError> {
    let mut v = [0usize; 3];
    let mut at = pos;
    for x in &mut v {
        let (n, next) = leb::read(frame, at, frame.len(), 5)?;
        *x = n as usize;
        at = next;
    }
    Ok((v, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk's rows from its tensor's shape and start: the lead is what
    /// is left of the row the chunk starts in; 1-D tensors and short rows
    /// have none.
    #[test]
    fn rows_of_a_chunk_follow_its_start() {
        assert_eq!(
            Rows::of_chunk(&[8, 100], 0),
            Some(Rows { len: 100, lead: 0 })
        );
        assert_eq!(
            Rows::of_chunk(&[8, 100], 250),
            Some(Rows { len: 100, lead: 50 })
        );
        assert_eq!(
            Rows::of_chunk(&[2, 4, 100], 300),
            Some(Rows { len: 100, lead: 0 })
        );
        assert_eq!(Rows::of_chunk(&[800], 0), None);
        assert_eq!(Rows::of_chunk(&[100, 8], 0), None);
        assert_eq!(Rows::of_chunk(&[], 0), None);
    }

    /// The bits an element shares with its root's: all of them when
    /// equal, none when the sign differs, the leading ones of the XOR
    /// between; zero elements are not counted. (The first version
    /// subtracted 64 before adding the width and overflowed in debug
    /// builds.)
    #[test]
    fn shared_bits_count_leading_equal_bits_without_overflow() {
        let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let a = f(&[1.0, 1.0, 0.0, 1.0]);
        let b = f(&[1.0, -1.0, 5.0, f32::from_bits(1.0f32.to_bits() ^ 0x100)]);
        // 32 (equal) + 0 (sign) + 23 (bit 8 differs); the zero is left out.
        assert_eq!(shared::<4>(&a, &b), (55, 3));
        let h = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(
            shared::<2>(&h(&[0x3f80, 0x3f80]), &h(&[0x3f80, 0x3f81])),
            (16 + 15, 2)
        );
    }

    /// The root map and indices read back as written, for root counts
    /// whose index widths are 0 to 9 bits, and a flipped padding bit is
    /// corrupt.
    #[test]
    fn plans_read_back_as_written() {
        for count in [2usize, 3, 17, 33, 100, 1000, 4099] {
            let g = Geometry::new(count * 3, Rows { len: 3, lead: 0 }).unwrap();
            let body: Vec<u8> = (0..count * 3)
                .flat_map(|i| ((i * 7919 % 1013) as f32).to_le_bytes())
                .collect();
            let dir = direction(&body, &g, DType::F32);
            let plan = plan(&body, &g, DType::F32, &dir);
            assert_eq!(plan.roots.len(), count.div_ceil(GROUP));
            let mut out = vec![0xaa];
            write_plan(&plan, &mut out);
            let (back, end) = read_plan(&out, 1, count, plan.roots.len()).unwrap();
            assert_eq!((back, end), (plan.clone(), out.len()));
            // The last byte's top bit is padding when the last section
            // (the indices, or the map when there are none) ends short of it.
            let index = plan.of.len() * index_bits(plan.roots.len()) as usize;
            let last = if index > 0 { index } else { count };
            if last % 8 != 0 {
                let mut bad = out.clone();
                *bad.last_mut().unwrap() |= 0x80;
                assert!(read_plan(&bad, 1, count, plan.roots.len()).is_err());
            }
        }
    }
}
