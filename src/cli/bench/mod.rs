//! `ckvc debug *-bench`: side-by-side measurements on a real training run,
//! compiled only into the binary (they shell out to nothing, but time
//! `cp -r` + sync, call peers and are no API anyone links against). The
//! chunk codec here, the whole repository (commit, checkout, bytes on disk)
//! in [`repo`], gc in [`gc`], remotes in [`remote`]; the run's tensors are
//! loaded by [`corpus`].
//!
//! Owns `ckvc debug codec-bench`: it walks the checkpoint directories of one
//! run in step order, reads every tensor through [`ckvc::format`] (one
//! checkpoint at a time, with the one before it for the DELTA rows; a row
//! is timed in batches of at most [`BATCH_BYTES`]), and measures on the
//! very same bytes the ckvc codec, plain LMC (the same
//! code with rotation, rANS and the delta search switched off), zstd -3 and
//! -19 and bzip2 -9 on byte-grouped bytes, and the order-0 entropy of the
//! byte-grouped streams per 64 KiB block. Every codec is timed from the
//! tensor to its frame and back to the tensor: the peers' compression
//! includes the grouping (and the XOR with the base), their decompression
//! its inverse. These functions return rows; `cli::debug` prints them.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use ckvc::codec::{self, DType, Options, Scratch};

pub mod corpus;
pub mod gc;
pub mod remote;
pub mod repo;

pub use corpus::{Checkpoint, LoadError};

/// One line of the benchmark table (also the `--json` schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// "FULL" (each checkpoint alone) or "DELTA" (against the previous one).
    pub mode: String,
    pub dtype: String,
    /// "weights", "optimizer" or "all".
    pub group: String,
    /// "ckvc", "lmc", "zstd-3", "zstd-19", "entropy" (or a peer's name).
    pub codec: String,
    pub threads: usize,
    pub bytes_in: u64,
    /// Compressed size / original size.
    pub ratio: f64,
    pub compress_mib_s: Option<f64>,
    pub decompress_mib_s: Option<f64>,
}

/// Benchmark knobs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Threads for the all-cores ckvc row (0 = all available).
    pub threads: usize,
    /// Timed passes per measurement; the fastest counts (noise only slows).
    /// A row of less than [`MIN_TIMED_BYTES`] gets more: as many as code
    /// that much.
    pub repeat: usize,
    /// Chunk size the tensors are cut into, as the repository does.
    pub chunk_bytes: usize,
    /// Also run zstd -19 (slow: minutes on a large run).
    pub zstd19: bool,
    /// Also run bzip2 -9 (one pass, ~10 MiB/s).
    pub bzip2: bool,
    /// Tensors with fewer elements are skipped (0-d optimizer step counters).
    pub min_elements: u64,
    /// Give the codec each chunk's rows, as a commit does (row frames).
    pub row_frames: bool,
    /// Most input bytes of a row coded in one batch of timed passes
    /// ([`BATCH_BYTES`]).
    pub batch_bytes: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            threads: 0,
            repeat: 3,
            chunk_bytes: 4 << 20,
            zstd19: true,
            bzip2: true,
            min_elements: corpus::MIN_ELEMENTS,
            row_frames: true,
            batch_bytes: BATCH_BYTES,
        }
    }
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no checkpoint directories with tensors found")]
    Empty { path: PathBuf },
    #[error("round trip failed for {tensor}: the codec returned different bytes")]
    Mismatch { tensor: String },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Repo(#[from] ckvc::repo::RepoError),
    #[error(transparent)]
    Remote(#[from] ckvc::remote::RemoteError),
    #[error("step {step}: checked-out {path} differs from the original at byte {offset}")]
    CheckoutMismatch {
        step: u64,
        path: PathBuf,
        offset: u64,
    },
}

/// One unit of work: a chunk and, in DELTA mode, its base.
struct Job<'a> {
    key: &'a str,
    dtype: DType,
    /// The row group of its tensor ("weights" or "optimizer").
    group: &'static str,
    raw: &'a [u8],
    base: Option<&'a [u8]>,
    /// The chunk's rows in its tensor.
    rows: Option<codec::Rows>,
}

/// Most input bytes of a row coded in one batch of timed passes (the
/// default of [`BenchOptions::batch_bytes`]). Every
/// codec keeps its frames of a batch until the batch is checked (about
/// the input's size each, six codecs), so a row of gigabytes is timed
/// batch by batch: the benchmark holds two checkpoints and about 1.5 GiB
/// besides, not six codings of the whole run (which ran a 6 GiB run out
/// of 24 GiB of memory).
const BATCH_BYTES: u64 = 256 << 20;

/// Run the whole benchmark on a run directory, loading one checkpoint at
/// a time (with the one before it, the DELTA rows' bases).
pub fn codec_bench(dir: &Path, opts: &BenchOptions) -> Result<Vec<Row>, BenchError> {
    let dirs = corpus::run_dirs(dir)?;
    let mut bench = Bench::new(opts, dirs.len());
    let mut prev: Option<Checkpoint> = None;
    for (step, d) in dirs {
        let Some(ck) = corpus::load_checkpoint(step, &d, opts.min_elements)? else {
            continue;
        };
        bench.checkpoint(prev.as_ref(), &ck)?;
        prev = Some(ck);
    }
    if bench.rows.is_empty() {
        return Err(LoadError::Empty {
            path: dir.to_path_buf(),
        }
        .into());
    }
    Ok(bench.finish())
}

/// The benchmark on checkpoints already in memory.
#[cfg(test)]
fn bench_checkpoints(run: &[Checkpoint], opts: &BenchOptions) -> Result<Vec<Row>, BenchError> {
    let mut bench = Bench::new(opts, run.len());
    for (i, ck) in run.iter().enumerate() {
        bench.checkpoint(i.checked_sub(1).map(|p| &run[p]), ck)?;
    }
    Ok(bench.finish())
}

/// What one codec of a row came to, summed over checkpoints and batches:
/// bytes out, and the seconds of the fastest encode and decode pass of
/// each batch.
#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    out: u64,
    c_secs: f64,
    d_secs: f64,
}

/// A row so far: its input bytes, each codec's sums (in the order they
/// run) and the order-0 entropy bits.
#[derive(Debug, Default, Clone)]
struct RowSums {
    bytes_in: u64,
    cells: Vec<(String, usize, Sums)>,
    bits: f64,
}

impl RowSums {
    fn add(&mut self, other: &RowSums) {
        self.bytes_in += other.bytes_in;
        self.bits += other.bits;
        for (name, threads, s) in &other.cells {
            match self
                .cells
                .iter_mut()
                .find(|(n, t, _)| n == name && t == threads)
            {
                Some((_, _, acc)) => {
                    acc.out += s.out;
                    acc.c_secs += s.c_secs;
                    acc.d_secs += s.d_secs;
                }
                None => self.cells.push((name.clone(), *threads, *s)),
            }
        }
    }
}

/// The benchmark fed one checkpoint at a time: rows keyed by (mode, dtype,
/// whether "all", group), each summed over the checkpoints.
struct Bench<'o> {
    opts: &'o BenchOptions,
    pool: Option<rayon::ThreadPool>,
    /// Checkpoints in the run (for [`passes`]).
    checkpoints: usize,
    rows: std::collections::BTreeMap<(u8, DType, bool, &'static str), RowSums>,
    /// The groups each dtype's tensors fell in over the run.
    groups: std::collections::BTreeMap<DType, std::collections::BTreeSet<&'static str>>,
}

impl<'o> Bench<'o> {
    fn new(opts: &'o BenchOptions, checkpoints: usize) -> Self {
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            opts.threads
        };
        let pool = (threads > 1).then(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a rayon pool of a few threads")
        });
        Bench {
            opts,
            checkpoints,
            pool,
            rows: Default::default(),
            groups: Default::default(),
        }
    }

    /// Measure checkpoint `ck` alone (FULL) and against `prev` (DELTA).
    fn checkpoint(&mut self, prev: Option<&Checkpoint>, ck: &Checkpoint) -> Result<(), BenchError> {
        let opts = self.opts;
        for t in &ck.tensors {
            self.groups.entry(t.dtype).or_default().insert(t.group);
        }
        for (mode, delta) in [(0u8, false), (1, true)] {
            let mut jobs: Vec<Job> = Vec::new();
            for (t, base) in corpus::bases_of(prev, ck, delta) {
                let cb = opts.chunk_bytes / t.dtype.width() * t.dtype.width();
                for (c, raw) in t.data.chunks(cb.max(t.dtype.width())).enumerate() {
                    jobs.push(Job {
                        key: &t.key,
                        dtype: t.dtype,
                        group: t.group,
                        raw,
                        base: base.map(|b| &b[c * cb..c * cb + raw.len()]),
                        rows: codec::Rows::of_chunk(&t.shape, (c * cb / t.dtype.width()) as u64)
                            .filter(|_| opts.row_frames),
                    });
                }
            }
            // This checkpoint's groups of each dtype, "all" after them.
            let mut here: std::collections::BTreeMap<DType, Vec<&'static str>> = Default::default();
            for j in &jobs {
                let g = here.entry(j.dtype).or_default();
                if !g.contains(&j.group) {
                    g.push(j.group);
                }
            }
            for (dtype, mut groups) in here {
                groups.sort();
                let mut all = RowSums::default();
                for &group in &groups {
                    let sel: Vec<&Job> = jobs
                        .iter()
                        .filter(|j| j.dtype == dtype && j.group == group)
                        .collect();
                    let sums = self.measure(&sel)?;
                    if groups.len() == 1 {
                        // "all" is the same jobs: the same sums.
                        all = sums.clone();
                    }
                    self.rows
                        .entry((mode, dtype, false, group))
                        .or_default()
                        .add(&sums);
                }
                if groups.len() > 1 {
                    let sel: Vec<&Job> = jobs.iter().filter(|j| j.dtype == dtype).collect();
                    all = self.measure(&sel)?;
                }
                self.rows
                    .entry((mode, dtype, true, "all"))
                    .or_default()
                    .add(&all);
            }
        }
        Ok(())
    }

    /// Time and check every codec on `sel`, [`BenchOptions::batch_bytes`]
    /// at a time.
    /// ckvc (one thread and all), LMC and zstd -3 are timed side by side:
    /// every pass runs each once, in turn, so a busy moment on a shared
    /// machine slows them alike, and the fastest pass of each counts.
    /// zstd -19 and bzip2 -9 are there for their ratio: one pass.
    fn measure(&self, sel: &[&Job]) -> Result<RowSums, BenchError> {
        let mut sums = RowSums::default();
        // Passes as for the row over the whole run (this checkpoint's
        // share times the checkpoints): a row of a few KiB per checkpoint
        // gets the passes of its run's total, not 32 MiB per checkpoint.
        let row_bytes: u64 = sel.iter().map(|j| j.raw.len() as u64).sum();
        let passes = passes(self.opts.repeat, row_bytes * self.checkpoints.max(1) as u64);
        let mut rest = sel;
        while !rest.is_empty() {
            let mut n = 0;
            let mut bytes = 0u64;
            while n < rest.len()
                && (n == 0 || bytes + rest[n].raw.len() as u64 <= self.opts.batch_bytes)
            {
                bytes += rest[n].raw.len() as u64;
                n += 1;
            }
            let (batch, next) = rest.split_at(n);
            rest = next;
            let mut timed = vec![Timed::codec("ckvc", Options::default(), None)];
            if let Some(p) = &self.pool {
                timed.push(Timed::codec("ckvc", Options::default(), Some(p)));
            }
            timed.push(Timed::codec("lmc", Options::lmc(), None));
            timed.push(Timed::zstd(3));
            for _ in 0..passes {
                for t in &mut timed {
                    t.pass(batch);
                }
            }
            if self.opts.zstd19 {
                let mut t = Timed::zstd(19);
                t.pass(batch);
                timed.push(t);
            }
            if self.opts.bzip2 {
                let mut t = Timed::new("bzip2-9".to_string(), Coder::Bzip2);
                t.pass(batch);
                timed.push(t);
            }
            let mut here = RowSums {
                bytes_in: bytes,
                ..RowSums::default()
            };
            for t in timed {
                let (name, threads) = (t.name.clone(), t.threads());
                here.cells.push((name, threads, t.finish(batch)?));
            }
            sums.add(&here);
        }
        sums.bits = sel.iter().map(|j| grouped_entropy_bits(j)).sum();
        Ok(sums)
    }

    /// The rows, "all" left out for a dtype whose tensors were all in one
    /// group over the run (it would repeat that group's row).
    fn finish(self) -> Vec<Row> {
        let mut rows = Vec::new();
        for ((mode, dtype, is_all, group), r) in self.rows {
            if is_all && self.groups.get(&dtype).map_or(0, |g| g.len()) < 2 {
                continue;
            }
            let mk = |codec: &str, threads: usize, out: u64, s: Option<Sums>| Row {
                mode: if mode == 0 { "FULL" } else { "DELTA" }.to_string(),
                dtype: dtype.short_name().to_string(),
                group: group.to_string(),
                codec: codec.to_string(),
                threads,
                bytes_in: r.bytes_in,
                ratio: out as f64 / r.bytes_in.max(1) as f64,
                compress_mib_s: s.map(|s| mib_s(r.bytes_in, s.c_secs)),
                decompress_mib_s: s.map(|s| mib_s(r.bytes_in, s.d_secs)),
            };
            for (name, threads, s) in &r.cells {
                rows.push(mk(name, *threads, s.out, Some(*s)));
            }
            rows.push(mk("entropy", 1, (r.bits / 8.0).ceil() as u64, None));
        }
        rows
    }
}

/// A row's timed passes code at least this many bytes through each codec.
/// The fastest of three passes over a row of a few KiB (the RNG state) is
/// one cold pass and two barely warm ones, tens of microseconds each, and
/// came out 10-30% apart from run to run; a large row's passes are long
/// and warm.
pub const MIN_TIMED_BYTES: u64 = 32 << 20;

/// Passes for a row of `bytes` bytes: `repeat`, or more to code
/// [`MIN_TIMED_BYTES`], but no more than 10,000 for that.
fn passes(repeat: usize, bytes: u64) -> usize {
    let enough = MIN_TIMED_BYTES.div_ceil(bytes.max(1)).min(10_000) as usize;
    repeat.max(1).max(enough)
}

thread_local! {
    /// One scratch and output buffer per worker thread, reused across
    /// chunks, as a caller coding many chunks would keep them (rayon's
    /// `map_init` would make one per split, re-growing buffers each time).
    static SCRATCH: std::cell::RefCell<(Scratch, Vec<u8>)> =
        std::cell::RefCell::new((Scratch::default(), Vec::new()));
}

fn mib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
}

/// One configuration of a benchmark row: its frames, and the fastest
/// encode and decode pass so far.
struct Timed<'p> {
    name: String,
    coder: Coder<'p>,
    frames: Vec<Vec<u8>>,
    best_c: f64,
    best_d: f64,
}

enum Coder<'p> {
    /// The ckvc codec with these options, on this thread (keeping its
    /// scratch and output buffer across passes) or on a pool (whose
    /// threads keep theirs in `SCRATCH`).
    Ckvc {
        opts: Options,
        pool: Option<&'p rayon::ThreadPool>,
        one: Box<(Scratch, Vec<u8>)>,
    },
    /// zstd at this level on the byte-grouped bytes (see [`grouped_input`]);
    /// decompression ends at the tensor. Buffers reused across jobs, as
    /// ckvc's are: the grouped bytes, the tensor.
    Zstd {
        cctx: zstd::bulk::Compressor<'static>,
        dctx: zstd::bulk::Decompressor<'static>,
        buf: Box<(Vec<u8>, Vec<u8>)>,
    },
    /// bzip2 -9 on the byte-grouped bytes.
    Bzip2,
}

impl<'p> Timed<'p> {
    fn codec(name: &str, opts: Options, pool: Option<&'p rayon::ThreadPool>) -> Self {
        Self::new(
            name.to_string(),
            Coder::Ckvc {
                opts,
                pool,
                one: Box::default(),
            },
        )
    }

    fn zstd(level: i32) -> Self {
        Self::new(
            format!("zstd-{level}"),
            Coder::Zstd {
                cctx: zstd::bulk::Compressor::new(level).expect("zstd level 3 or 19"),
                dctx: zstd::bulk::Decompressor::new().expect("zstd decompressor"),
                buf: Box::default(),
            },
        )
    }

    fn new(name: String, coder: Coder<'p>) -> Self {
        Timed {
            name,
            coder,
            frames: Vec::new(),
            best_c: f64::MAX,
            best_d: f64::MAX,
        }
    }

    fn threads(&self) -> usize {
        match &self.coder {
            Coder::Ckvc { pool: Some(p), .. } => p.current_num_threads(),
            _ => 1,
        }
    }

    /// Encode every job, then decode every frame, timing each half. Only
    /// the decoding is timed, not a comparison with the input (that reads
    /// every byte again): [`Timed::finish`] checks every frame once.
    fn pass(&mut self, jobs: &[&Job]) {
        self.frames.resize_with(jobs.len(), Vec::new);
        let frames = &mut self.frames;
        let t = Instant::now();
        match &mut self.coder {
            Coder::Ckvc {
                opts,
                pool: None,
                one,
            } => {
                for (j, f) in jobs.iter().zip(frames.iter_mut()) {
                    codec::encode_shaped_into(j.raw, j.base, j.dtype, j.rows, opts, f, &mut one.0);
                }
            }
            Coder::Ckvc {
                opts,
                pool: Some(pool),
                ..
            } => pool.install(|| {
                jobs.par_iter()
                    .zip(frames.par_iter_mut())
                    .for_each(|(j, f)| {
                        SCRATCH.with_borrow_mut(|(s, _)| {
                            codec::encode_shaped_into(j.raw, j.base, j.dtype, j.rows, opts, f, s)
                        })
                    })
            }),
            Coder::Zstd { cctx, buf, .. } => {
                let joined = &mut buf.0;
                for (j, f) in jobs.iter().zip(frames.iter_mut()) {
                    grouped_input(j, joined);
                    f.clear();
                    f.reserve(zstd::zstd_safe::compress_bound(joined.len()));
                    cctx.compress_to_buffer(joined, f)
                        .expect("zstd compresses any input into its bound");
                }
            }
            Coder::Bzip2 => {
                let mut joined = Vec::new();
                for (j, f) in jobs.iter().zip(frames.iter_mut()) {
                    grouped_input(j, &mut joined);
                    *f = bzip2_compress(&joined);
                }
            }
        }
        self.best_c = self.best_c.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        // Results are not looked at here: `finish` decodes every frame
        // again, compares it and names a failure.
        match &mut self.coder {
            Coder::Ckvc {
                pool: None, one, ..
            } => {
                let (s, out) = &mut **one;
                for (j, f) in jobs.iter().zip(frames.iter()) {
                    let _ = codec::decode_into(f, j.base, codec::HARD_MAX_RAW_LEN, out, s);
                }
            }
            Coder::Ckvc {
                pool: Some(pool), ..
            } => pool.install(|| {
                jobs.par_iter().zip(frames.par_iter()).for_each(|(j, f)| {
                    SCRATCH.with_borrow_mut(|(s, out)| {
                        let _ = codec::decode_into(f, j.base, codec::HARD_MAX_RAW_LEN, out, s);
                    })
                })
            }),
            Coder::Zstd { dctx, buf, .. } => {
                let (grouped, out) = &mut **buf;
                for (j, f) in jobs.iter().zip(frames.iter()) {
                    let _ = zstd_to_tensor(dctx, f, j, grouped, out);
                }
            }
            Coder::Bzip2 => {
                let mut out = Vec::new();
                for (j, f) in jobs.iter().zip(frames.iter()) {
                    let _ = bzip2_to_tensor(f, j, &mut out);
                }
            }
        }
        self.best_d = self.best_d.min(t.elapsed().as_secs_f64());
    }

    /// Check, once and outside the timed passes, that every frame gives
    /// back its input; returns the bytes out and the fastest passes'
    /// seconds.
    fn finish(self, jobs: &[&Job]) -> Result<Sums, BenchError> {
        let bad = match self.coder {
            Coder::Ckvc { .. } => jobs
                .par_iter()
                .zip(self.frames.par_iter())
                .find_any(|(j, f)| codec::decode(f, j.base).ok().as_deref() != Some(j.raw))
                .map(|(j, _)| j.key.to_string()),
            Coder::Zstd { mut dctx, .. } => {
                let (mut grouped, mut out) = (Vec::new(), Vec::new());
                jobs.iter()
                    .zip(&self.frames)
                    .find(|(j, f)| {
                        zstd_to_tensor(&mut dctx, f, j, &mut grouped, &mut out).is_err()
                            || out != j.raw
                    })
                    .map(|(j, _)| j.key.to_string())
            }
            Coder::Bzip2 => {
                let mut out = Vec::new();
                jobs.iter()
                    .zip(&self.frames)
                    .find(|(j, f)| bzip2_to_tensor(f, j, &mut out).is_err() || out != j.raw)
                    .map(|(j, _)| j.key.to_string())
            }
        };
        if let Some(tensor) = bad {
            return Err(BenchError::Mismatch { tensor });
        }
        Ok(Sums {
            out: self.frames.iter().map(|f| f.len() as u64).sum(),
            c_secs: self.best_c,
            d_secs: self.best_d,
        })
    }
}

fn bzip2_compress(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::best());
    e.write_all(data).expect("writing to a Vec cannot fail");
    e.finish().expect("writing to a Vec cannot fail")
}

/// A bzip2 peer's frame back to the tensor: decompressed, then
/// [`codec::ungroup_streams_into`].
fn bzip2_to_tensor(frame: &[u8], j: &Job, out: &mut Vec<u8>) -> std::io::Result<()> {
    use std::io::Read;
    let mut grouped = Vec::with_capacity(j.raw.len());
    bzip2::read::BzDecoder::new(frame).read_to_end(&mut grouped)?;
    codec::ungroup_streams_into(&grouped, j.base, j.dtype, out);
    Ok(())
}

/// A zstd peer's frame back to the tensor: decompressed into `grouped`,
/// then [`codec::ungroup_streams_into`] `out`, the inverse of the grouping
/// (and XOR with the base) its compression time includes.
fn zstd_to_tensor(
    dctx: &mut zstd::bulk::Decompressor<'static>,
    frame: &[u8],
    j: &Job,
    grouped: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> std::io::Result<()> {
    grouped.clear();
    grouped.reserve(j.raw.len());
    dctx.decompress_to_buffer(frame, grouped)?;
    codec::ungroup_streams_into(grouped, j.base, j.dtype, out);
    Ok(())
}

/// The byte-grouped (not rotated) streams of a job, XORed with the grouped
/// base in DELTA mode, back to back, then the bytes of a trailing partial
/// element, into `joined`: what zstd and bzip2 compress.
fn grouped_input(j: &Job, joined: &mut Vec<u8>) {
    codec::group_streams_into(j.raw, j.base, j.dtype, joined);
}

/// Order-0 entropy of the byte-grouped streams, per 64 KiB block, in bits.
fn grouped_entropy_bits(j: &Job) -> f64 {
    let block = 1 << codec::BLOCK_LOG2;
    let w = j.dtype.width();
    let n = j.raw.len() / w;
    let mut streams = codec::grouped_streams(j.raw, j.base, j.dtype);
    streams[0].extend_from_slice(&j.raw[n * w..]);
    streams
        .iter()
        .flat_map(|s| s.chunks(block))
        .map(|b| codec::entropy_bits(&codec::histogram(b)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    use ckvc::testing::Rng;
    use corpus::Tensor;

    #[test]
    fn a_small_row_gets_passes_enough_to_code_32_mib() {
        assert_eq!(passes(3, 20_224), 1660);
        assert_eq!(passes(3, 16 << 20), 3);
        assert_eq!(passes(5, 1 << 30), 5);
        assert_eq!(passes(0, 1 << 30), 1);
        assert_eq!(passes(3, 1), 10_000);
        assert_eq!(passes(20_000, 1), 20_000);
    }

    /// bzip2 -9 runs on the same grouped bytes as zstd and round trips;
    /// it and zstd -19 are left out when switched off.
    #[test]
    fn bzip2_rows_are_measured_in_both_modes_and_can_be_skipped() {
        let tensor = |seed: u64| {
            let mut data = vec![0u8; 4 * 4096];
            Rng(seed).fill(&mut data[..8192]);
            Tensor {
                key: "model.safetensors/w".into(),
                dtype: DType::F32,
                group: "weights",
                shape: vec![4096],
                data,
            }
        };
        let run: Vec<Checkpoint> = (1..=2)
            .map(|s| Checkpoint {
                dir: PathBuf::from(format!("step-{s}")),
                step: s,
                tensors: vec![tensor(s)],
            })
            .collect();
        let opts = BenchOptions {
            threads: 1,
            repeat: 1,
            zstd19: false,
            ..BenchOptions::default()
        };
        let rows = bench_checkpoints(&run, &opts).unwrap();
        for mode in ["FULL", "DELTA"] {
            let r = rows
                .iter()
                .find(|r| r.mode == mode && r.codec == "bzip2-9")
                .expect("a bzip2 row");
            assert!(r.ratio > 0.0 && r.ratio < 1.0, "{mode}: {}", r.ratio);
        }
        assert!(!rows.iter().any(|r| r.codec == "zstd-19"));
        let opts = BenchOptions {
            bzip2: false,
            ..opts
        };
        let rows = bench_checkpoints(&run, &opts).unwrap();
        assert!(!rows.iter().any(|r| r.codec == "bzip2-9"));
    }

    /// A tensor of `len` f32 elements: half noise, half zeros (so that
    /// every codec shrinks it and the sizes differ between codecs).
    fn f32_tensor(key: &str, group: &'static str, len: usize, seed: u64) -> Tensor {
        let mut data = vec![0u8; 4 * len];
        Rng(seed).fill(&mut data[..2 * len]);
        Tensor {
            key: key.into(),
            dtype: DType::F32,
            group,
            shape: vec![len as u64],
            data,
        }
    }

    fn quick() -> BenchOptions {
        BenchOptions {
            threads: 1,
            repeat: 1,
            zstd19: false,
            bzip2: false,
            chunk_bytes: 8 << 10,
            ..BenchOptions::default()
        }
    }

    /// Sizes of every row, without the timings.
    fn sizes(rows: &[Row]) -> Vec<(String, String, String, String, u64, u64)> {
        rows.iter()
            .map(|r| {
                let out = (r.ratio * r.bytes_in as f64).round() as u64;
                let (m, d, g, c) = (&r.mode, &r.dtype, &r.group, &r.codec);
                (m.clone(), d.clone(), g.clone(), c.clone(), r.bytes_in, out)
            })
            .collect()
    }

    /// A row is coded in batches of at most `batch_bytes` (so the bench
    /// holds a batch's frames, not a row's): the bytes are the same as in
    /// one batch, and every checkpoint's tensors are counted once per row.
    #[test]
    fn a_row_coded_in_batches_has_the_bytes_of_one_batch() {
        let run: Vec<Checkpoint> = (1..=3)
            .map(|s| Checkpoint {
                dir: PathBuf::from(format!("step-{s}")),
                step: s,
                tensors: vec![
                    f32_tensor("model.safetensors/w", "weights", 10_000, s),
                    f32_tensor("optimizer.pt/m", "optimizer", 6_000, 10 + s),
                ],
            })
            .collect();
        let whole = bench_checkpoints(&run, &quick()).unwrap();
        let batched = BenchOptions {
            batch_bytes: 10 << 10,
            ..quick()
        };
        let batched = bench_checkpoints(&run, &batched).unwrap();
        assert_eq!(sizes(&whole), sizes(&batched));
        let bytes_in = |mode: &str, group: &str| {
            let r = whole
                .iter()
                .find(|r| r.mode == mode && r.group == group && r.codec == "ckvc");
            r.expect("the row").bytes_in
        };
        assert_eq!(bytes_in("FULL", "weights"), 3 * 40_000);
        assert_eq!(bytes_in("FULL", "all"), 3 * 64_000);
        // No base for the first checkpoint.
        assert_eq!(bytes_in("DELTA", "optimizer"), 2 * 24_000);
        assert_eq!(bytes_in("DELTA", "all"), 2 * 64_000);
    }

    /// The "all" row of a dtype counts a checkpoint whose tensors of that
    /// dtype are in one group, once another checkpoint has two; a dtype in
    /// one group over the whole run gets no "all" row.
    #[test]
    fn an_all_row_counts_the_checkpoints_with_one_group() {
        let mut u8_tensor = f32_tensor("rng_state.pth/cpu", "weights", 1000, 7);
        u8_tensor.dtype = DType::U8;
        let run = vec![
            Checkpoint {
                dir: PathBuf::from("step-1"),
                step: 1,
                tensors: vec![
                    f32_tensor("model.safetensors/w", "weights", 5_000, 1),
                    u8_tensor.clone(),
                ],
            },
            Checkpoint {
                dir: PathBuf::from("step-2"),
                step: 2,
                tensors: vec![
                    f32_tensor("model.safetensors/w", "weights", 5_000, 2),
                    f32_tensor("optimizer.pt/m", "optimizer", 3_000, 3),
                    u8_tensor,
                ],
            },
        ];
        let rows = bench_checkpoints(&run, &quick()).unwrap();
        let all = rows
            .iter()
            .find(|r| {
                r.mode == "FULL" && r.dtype == "fp32" && r.group == "all" && r.codec == "ckvc"
            })
            .expect("an all row");
        assert_eq!(all.bytes_in, 4 * (5_000 + 5_000 + 3_000));
        let weights = rows
            .iter()
            .find(|r| {
                r.mode == "FULL" && r.dtype == "fp32" && r.group == "weights" && r.codec == "ckvc"
            })
            .expect("a weights row");
        assert!(all.ratio > 0.0 && weights.ratio > 0.0);
        assert!(!rows.iter().any(|r| r.dtype == "u8" && r.group == "all"));
        assert!(rows.iter().any(|r| r.dtype == "u8" && r.group == "weights"));
    }

    /// A safetensors file of f32 tensors.
    fn write_safetensors(path: &Path, tensors: &[(&str, &[u8])]) {
        let mut header = String::from("{");
        let mut at = 0;
        for (i, (name, data)) in tensors.iter().enumerate() {
            let n = data.len() / 4;
            let end = at + data.len();
            let sep = if i > 0 { "," } else { "" };
            header += &format!(
                r#"{sep}"{name}":{{"dtype":"F32","shape":[{n}],"data_offsets":[{at},{end}]}}"#
            );
            at = end;
        }
        header.push('}');
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        for (_, data) in tensors {
            f.extend_from_slice(data);
        }
        std::fs::write(path, f).unwrap();
    }

    /// `codec_bench` reads a run one checkpoint at a time (with the one
    /// before it) and gives the rows of the whole run in memory; a
    /// directory without tensors is still refused.
    #[test]
    fn codec_bench_reads_a_checkpoint_at_a_time_and_gives_the_whole_runs_rows() {
        let tmp = tempfile::tempdir().unwrap();
        for s in 1..=3u64 {
            let d = tmp.path().join(format!("checkpoint-{s}"));
            std::fs::create_dir(&d).unwrap();
            let a = f32_tensor("a", "weights", 3_000, s).data;
            let b = f32_tensor("b", "weights", 2_000, 10 + s).data;
            write_safetensors(&d.join("model.safetensors"), &[("a", &a), ("b", &b)]);
            let m = f32_tensor("m", "optimizer", 2_000, 20 + s).data;
            write_safetensors(&d.join("optimizer.safetensors"), &[("m", &m)]);
        }
        // Not a checkpoint: no step in its name.
        std::fs::create_dir(tmp.path().join("logs")).unwrap();
        let streamed = codec_bench(tmp.path(), &quick()).unwrap();
        let run = corpus::load_run(tmp.path(), corpus::MIN_ELEMENTS).unwrap();
        assert_eq!(run.len(), 3);
        let whole = bench_checkpoints(&run, &quick()).unwrap();
        assert_eq!(sizes(&streamed), sizes(&whole));
        assert!(streamed.iter().any(|r| r.group == "optimizer"));

        let empty = tempfile::tempdir().unwrap();
        std::fs::create_dir(empty.path().join("step-5")).unwrap();
        let err = codec_bench(empty.path(), &quick()).unwrap_err();
        assert!(
            matches!(err, BenchError::Load(LoadError::Empty { .. })),
            "{err}"
        );
    }

    #[test]
    fn odd_runs_give_the_rows_they_hold_and_do_not_panic() {
        let mut u8_tensor = f32_tensor("rng_state.pth/cpu", "weights", 1000, 7);
        u8_tensor.dtype = DType::U8;
        let ck = |s: u64, tensors| Checkpoint {
            dir: PathBuf::from(format!("step-{s}")),
            step: s,
            tensors,
        };
        let run = vec![
            ck(
                1,
                vec![f32_tensor("model.safetensors/w", "weights", 1_000, 1)],
            ),
            ck(2, vec![u8_tensor.clone()]),
            ck(
                3,
                vec![
                    f32_tensor("model.safetensors/w", "weights", 2_000, 2),
                    f32_tensor("optimizer.pt/m", "optimizer", 3_000, 3),
                ],
            ),
            ck(
                4,
                vec![
                    f32_tensor("model.safetensors/w", "weights", 2_000, 4),
                    u8_tensor,
                ],
            ),
        ];
        let rows = bench_checkpoints(
            &run,
            &BenchOptions {
                batch_bytes: 1,
                ..quick()
            },
        )
        .unwrap();
        let get = |m: &str, d: &str, g: &str| {
            rows.iter()
                .find(|r| r.mode == m && r.dtype == d && r.group == g && r.codec == "ckvc")
                .map(|r| r.bytes_in)
        };
        assert_eq!(get("FULL", "fp32", "weights"), Some(4 * 5_000));
        assert_eq!(get("FULL", "fp32", "all"), Some(4 * 8_000));
        assert_eq!(get("DELTA", "fp32", "weights"), Some(4 * 2_000));
        assert_eq!(get("DELTA", "fp32", "optimizer"), None);
        assert_eq!(get("DELTA", "u8", "weights"), None);
        assert!(bench_checkpoints(&[], &quick()).unwrap().is_empty());
    }
}
