//! `ckvc debug *-bench`: side-by-side measurements on a real training run,
//! compiled only into the binary (they shell out to nothing, but time
//! `cp -r` + sync, call peers and are no API anyone links against). The
//! chunk codec here, the whole repository (commit, checkout, bytes on disk)
//! in [`repo`], gc in [`gc`], remotes in [`remote`]; the run's tensors are
//! loaded by [`corpus`].
//!
//! Owns `ckvc debug codec-bench`: it walks the checkpoint directories of one
//! run in step order, reads every tensor through [`ckvc::format`], and
//! measures on the very same bytes the ckvc codec, plain LMC (the same
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

pub use corpus::{load_run, with_bases, Checkpoint, LoadError};

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
    raw: &'a [u8],
    base: Option<&'a [u8]>,
    /// The chunk's rows in its tensor.
    rows: Option<codec::Rows>,
}

/// Run the whole benchmark on a run directory.
pub fn codec_bench(dir: &Path, opts: &BenchOptions) -> Result<Vec<Row>, BenchError> {
    let run = load_run(dir, opts.min_elements)?;
    bench_checkpoints(&run, opts)
}

/// The benchmark on checkpoints already in memory.
pub fn bench_checkpoints(run: &[Checkpoint], opts: &BenchOptions) -> Result<Vec<Row>, BenchError> {
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
    let mut rows = Vec::new();
    for mode in ["FULL", "DELTA"] {
        let mut jobs: Vec<Job> = Vec::new();
        for (t, base) in with_bases(run, mode == "DELTA") {
            let cb = opts.chunk_bytes / t.dtype.width() * t.dtype.width();
            for (c, raw) in t.data.chunks(cb.max(t.dtype.width())).enumerate() {
                jobs.push(Job {
                    key: &t.key,
                    dtype: t.dtype,
                    raw,
                    base: base.map(|b| &b[c * cb..c * cb + raw.len()]),
                    rows: codec::Rows::of_chunk(&t.shape, (c * cb / t.dtype.width()) as u64)
                        .filter(|_| opts.row_frames),
                });
            }
        }
        let mut groups: Vec<(DType, &'static str)> = Vec::new();
        for ck in run {
            for t in &ck.tensors {
                for g in [t.group, "all"] {
                    if !groups.contains(&(t.dtype, g)) {
                        groups.push((t.dtype, g));
                    }
                }
            }
        }
        groups.sort_by_key(|&(d, g)| (d, g == "all", g));
        for (dtype, group) in groups {
            let sel: Vec<&Job> = jobs
                .iter()
                .filter(|j| {
                    j.dtype == dtype
                        && (group == "all"
                            || run.iter().any(|ck| {
                                ck.tensors
                                    .iter()
                                    .any(|t| t.key == j.key && t.group == group)
                            }))
                })
                .collect();
            if sel.is_empty() {
                continue;
            }
            // "all" equal to the only group adds nothing.
            let distinct_groups = run
                .iter()
                .flat_map(|ck| ck.tensors.iter())
                .filter(|t| t.dtype == dtype)
                .map(|t| t.group)
                .collect::<std::collections::BTreeSet<_>>();
            if group == "all" && distinct_groups.len() < 2 {
                continue;
            }
            let mk = |codec: &str,
                      threads: usize,
                      bytes_in: u64,
                      out: u64,
                      c: Option<f64>,
                      d: Option<f64>| Row {
                mode: mode.to_string(),
                dtype: dtype.short_name().to_string(),
                group: group.to_string(),
                codec: codec.to_string(),
                threads,
                bytes_in,
                ratio: out as f64 / bytes_in.max(1) as f64,
                compress_mib_s: c,
                decompress_mib_s: d,
            };
            let bytes_in: u64 = sel.iter().map(|j| j.raw.len() as u64).sum();
            // ckvc (one thread and all), LMC and zstd -3 are timed side by
            // side: every pass runs each once, in turn, so a busy moment on
            // a shared machine slows them alike, and the fastest pass of
            // each counts. zstd -19 is there for its ratio: one pass.
            let mut timed = vec![Timed::codec("ckvc", Options::default(), None)];
            if let Some(p) = &pool {
                timed.push(Timed::codec("ckvc", Options::default(), Some(p)));
            }
            timed.push(Timed::codec("lmc", Options::lmc(), None));
            timed.push(Timed::zstd(3));
            for _ in 0..passes(opts.repeat, bytes_in) {
                for t in &mut timed {
                    t.pass(&sel);
                }
            }
            if opts.zstd19 {
                let mut t = Timed::zstd(19);
                t.pass(&sel);
                timed.push(t);
            }
            if opts.bzip2 {
                let mut t = Timed::new("bzip2-9".to_string(), Coder::Bzip2);
                t.pass(&sel);
                timed.push(t);
            }
            for t in timed {
                let (name, threads) = (t.name.clone(), t.threads());
                let (out, c, d) = t.finish(&sel)?;
                rows.push(mk(&name, threads, bytes_in, out, Some(c), Some(d)));
            }
            let bits: f64 = sel.iter().map(|j| grouped_entropy_bits(j)).sum();
            rows.push(mk(
                "entropy",
                1,
                bytes_in,
                (bits / 8.0).ceil() as u64,
                None,
                None,
            ));
        }
    }
    Ok(rows)
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
    /// back its input; returns
    /// (compressed bytes, compress MiB/s, decompress MiB/s).
    fn finish(self, jobs: &[&Job]) -> Result<(u64, f64, f64), BenchError> {
        let bytes_in: u64 = jobs.iter().map(|j| j.raw.len() as u64).sum();
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
        let out: u64 = self.frames.iter().map(|f| f.len() as u64).sum();
        Ok((
            out,
            mib_s(bytes_in, self.best_c),
            mib_s(bytes_in, self.best_d),
        ))
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
}
