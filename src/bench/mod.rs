//! Side-by-side measurements on a real training run: the chunk codec here,
//! the whole repository (commit, checkout, bytes on disk) in [`repo`].
//!
//! Owns `ckvc debug codec-bench`: it walks the checkpoint directories of one
//! run in step order, reads every tensor through [`crate::format`], and
//! measures on the very same bytes the ckvc codec, plain LMC (the same
//! code with rotation, rANS and the delta search switched off), zstd -3 and
//! -19 and bzip2 -9 on byte-grouped bytes, and the order-0 entropy of the
//! byte-grouped streams per 64 KiB block. The library only returns rows; printing is the
//! CLI's business.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::codec::{self, DType, Options, Scratch};
use crate::format;

pub mod gc;
pub mod remote;
pub mod repo;

/// A deterministic generator (xorshift64*) for synthetic benchmark inputs
/// and randomised test schedules: the same seed gives the same bytes
/// everywhere. Not for anything that needs unpredictability.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits. The seed must not be zero.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Fill `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            c.copy_from_slice(&self.next_u64().to_le_bytes()[..c.len()]);
        }
    }
}

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
    pub repeat: usize,
    /// Chunk size the tensors are cut into, as the repository does.
    pub chunk_bytes: usize,
    /// Also run zstd -19 (slow: minutes on a large run).
    pub zstd19: bool,
    /// Also run bzip2 -9 (one pass, ~10 MiB/s).
    pub bzip2: bool,
    /// Tensors with fewer elements are skipped (0-d optimizer step counters).
    pub min_elements: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            threads: 0,
            repeat: 3,
            chunk_bytes: 4 << 20,
            zstd19: true,
            bzip2: true,
            min_elements: 16,
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
    #[error("parsing {path}: {source}")]
    Format {
        path: PathBuf,
        source: format::FormatError,
    },
    #[error("{path}: no checkpoint directories with tensors found")]
    Empty { path: PathBuf },
    #[error("round trip failed for {tensor}: the codec returned different bytes")]
    Mismatch { tensor: String },
    #[error(transparent)]
    Repo(#[from] crate::repo::RepoError),
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    #[error("step {step}: checked-out {path} differs from the original at byte {offset}")]
    CheckoutMismatch {
        step: u64,
        path: PathBuf,
        offset: u64,
    },
}

/// One tensor of one checkpoint.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// `file/name`, the key that matches it across checkpoints.
    pub key: String,
    pub dtype: DType,
    pub group: &'static str,
    pub data: Vec<u8>,
}

/// A checkpoint directory of the run with its tensors.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub step: u64,
    pub tensors: Vec<Tensor>,
}

/// How deep below the run directory checkpoint directories are looked
/// for (`run/iter_0000500`, `run/checkpoints/checkpoint-500`, ...).
const MAX_RUN_DEPTH: usize = 3;

/// Load the checkpoints of a run directory in step order. A checkpoint
/// directory is one whose name ends in its step (`step-500`,
/// `checkpoint-500`, `iter_0000500`), found up to [`MAX_RUN_DEPTH`] levels
/// down; its files are read at any depth below it (Megatron's
/// `iter_0000500/mp_rank_00/model_optim_rng.pt`) and keyed by their path
/// in it. Files that are not tensor formats are skipped; a corrupt tensor
/// file is an error.
pub fn load_run(dir: &Path, opts: &BenchOptions) -> Result<Vec<Checkpoint>, BenchError> {
    let mut dirs = Vec::new();
    find_checkpoint_dirs(dir, 0, &mut dirs)?;
    dirs.sort();
    let mut out = Vec::new();
    for (step, d) in dirs {
        let mut files = Vec::new();
        files_below(&d, &mut files)?;
        files.sort();
        let mut tensors = Vec::new();
        for f in files {
            let name = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let rel = f
                .strip_prefix(&d)
                .map(|r| r.to_string_lossy().into_owned())
                .unwrap_or_else(|_| name.clone());
            let bytes = std::fs::read(&f).map_err(io_error(&f))?;
            let layout =
                format::parse(&name, &mut std::io::Cursor::new(&bytes), bytes.len() as u64)
                    .map_err(|source| BenchError::Format {
                        path: f.clone(),
                        source,
                    })?;
            for t in layout.tensors() {
                if t.len / t.dtype.width() as u64 >= opts.min_elements.max(1) {
                    let (a, b) = (t.offset as usize, (t.offset + t.len) as usize);
                    tensors.push(Tensor {
                        key: format!("{rel}/{}", t.name),
                        dtype: t.dtype,
                        group: group_of(&name, &t.name),
                        data: bytes[a..b].to_vec(),
                    });
                }
            }
        }
        if !tensors.is_empty() {
            out.push(Checkpoint {
                dir: d,
                step,
                tensors,
            });
        }
    }
    if out.is_empty() {
        return Err(BenchError::Empty {
            path: dir.to_path_buf(),
        });
    }
    Ok(out)
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> BenchError {
    let path = path.to_path_buf();
    move |source| BenchError::Io { path, source }
}

/// "optimizer" for the tensors of an optimizer file (`optimizer.pt`,
/// `optim_states.pt`); in a file holding model and optimizer together
/// (Megatron's `model_optim_rng.pt`), for the tensors under its optimizer
/// key; else "weights".
fn group_of(file: &str, tensor: &str) -> &'static str {
    let file = file.to_ascii_lowercase();
    let optimizer = file.contains("optim")
        && (!file.contains("model") || tensor.to_ascii_lowercase().contains("optim"));
    if optimizer {
        "optimizer"
    } else {
        "weights"
    }
}

/// Directories below `dir` (to [`MAX_RUN_DEPTH`]) whose name gives a step;
/// the search does not descend into them.
fn find_checkpoint_dirs(
    dir: &Path,
    depth: usize,
    out: &mut Vec<(u64, PathBuf)>,
) -> Result<(), BenchError> {
    for e in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let e = e.map_err(io_error(dir))?;
        if !e.file_type().map_err(io_error(&e.path()))?.is_dir() {
            continue;
        }
        match format::step_of_dir_name(&e.file_name().to_string_lossy()) {
            Some(step) => out.push((step, e.path())),
            None if depth + 1 < MAX_RUN_DEPTH => find_checkpoint_dirs(&e.path(), depth + 1, out)?,
            None => {}
        }
    }
    Ok(())
}

/// Every file below `dir`, at any depth (symbolic links are not followed).
fn files_below(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), BenchError> {
    for e in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let e = e.map_err(io_error(dir))?;
        let t = e.file_type().map_err(io_error(&e.path()))?;
        if t.is_dir() {
            files_below(&e.path(), out)?;
        } else if t.is_file() {
            out.push(e.path());
        }
    }
    Ok(())
}

/// One unit of work: a chunk and, in DELTA mode, its base.
struct Job<'a> {
    key: &'a str,
    dtype: DType,
    raw: &'a [u8],
    base: Option<&'a [u8]>,
}

/// Run the whole benchmark on a run directory.
pub fn codec_bench(dir: &Path, opts: &BenchOptions) -> Result<Vec<Row>, BenchError> {
    let run = load_run(dir, opts)?;
    bench_checkpoints(&run, opts)
}

/// Every tensor of the run with its base: with `delta`, the same tensor
/// (key, dtype and length) of the previous checkpoint, tensors without one
/// left out; else no base.
pub fn with_bases(
    run: &[Checkpoint],
    delta: bool,
) -> impl Iterator<Item = (&Tensor, Option<&[u8]>)> + '_ {
    run.iter().enumerate().flat_map(move |(i, ck)| {
        ck.tensors.iter().filter_map(move |t| {
            if !delta {
                return Some((t, None));
            }
            let prev = &run[i.checked_sub(1)?];
            let p = prev
                .tensors
                .iter()
                .find(|p| p.key == t.key && p.dtype == t.dtype && p.data.len() == t.data.len())?;
            Some((t, Some(p.data.as_slice())))
        })
    })
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
            for _ in 0..opts.repeat.max(1) {
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
    /// zstd at this level on the byte-grouped bytes (see [`grouped_input`]).
    Zstd {
        cctx: zstd::bulk::Compressor<'static>,
        dctx: zstd::bulk::Decompressor<'static>,
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
                    codec::encode_into(j.raw, j.base, j.dtype, opts, f, &mut one.0);
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
                            codec::encode_into(j.raw, j.base, j.dtype, opts, f, s)
                        })
                    })
            }),
            Coder::Zstd { cctx, .. } => {
                for (j, f) in jobs.iter().zip(frames.iter_mut()) {
                    let joined = grouped_input(j).concat();
                    *f = cctx.compress(&joined).expect("zstd compresses any input");
                }
            }
            Coder::Bzip2 => {
                for (j, f) in jobs.iter().zip(frames.iter_mut()) {
                    *f = bzip2_compress(&grouped_input(j).concat());
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
            Coder::Zstd { dctx, .. } => {
                for (j, f) in jobs.iter().zip(frames.iter()) {
                    let _ = dctx.decompress(f, j.raw.len());
                }
            }
            Coder::Bzip2 => {
                for (j, f) in jobs.iter().zip(frames.iter()) {
                    let _ = bzip2_decompress(f, j.raw.len());
                }
            }
        }
        self.best_d = self.best_d.min(t.elapsed().as_secs_f64());
    }

    /// Check, once and outside the timed passes, that every frame gives
    /// back its input (for zstd: the byte-grouped input); returns
    /// (compressed bytes, compress MiB/s, decompress MiB/s).
    fn finish(self, jobs: &[&Job]) -> Result<(u64, f64, f64), BenchError> {
        let bytes_in: u64 = jobs.iter().map(|j| j.raw.len() as u64).sum();
        let bad = match self.coder {
            Coder::Ckvc { .. } => jobs
                .par_iter()
                .zip(self.frames.par_iter())
                .find_any(|(j, f)| codec::decode(f, j.base).ok().as_deref() != Some(j.raw))
                .map(|(j, _)| j.key.to_string()),
            Coder::Zstd { mut dctx, .. } => jobs
                .iter()
                .zip(&self.frames)
                .find(|(j, f)| {
                    dctx.decompress(f, j.raw.len()).ok().as_deref()
                        != Some(grouped_input(j).concat().as_slice())
                })
                .map(|(j, _)| j.key.to_string()),
            Coder::Bzip2 => jobs
                .iter()
                .zip(&self.frames)
                .find(|(j, f)| {
                    bzip2_decompress(f, j.raw.len()).ok().as_deref()
                        != Some(grouped_input(j).concat().as_slice())
                })
                .map(|(j, _)| j.key.to_string()),
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

fn bzip2_decompress(frame: &[u8], len: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::with_capacity(len);
    bzip2::read::BzDecoder::new(frame).read_to_end(&mut out)?;
    Ok(out)
}

/// The byte-grouped (not rotated) bytes of a job, XORed with the grouped
/// base in DELTA mode: what zstd and the entropy bound see.
fn grouped_input(j: &Job) -> Vec<Vec<u8>> {
    let w = j.dtype.width();
    let n = j.raw.len() / w;
    let mut s = codec::grouped_streams(j.raw, j.base, j.dtype);
    s[0].extend_from_slice(&j.raw[n * w..]);
    s
}

/// Order-0 entropy of the byte-grouped streams, per 64 KiB block, in bits.
fn grouped_entropy_bits(j: &Job) -> f64 {
    let block = 1 << codec::BLOCK_LOG2;
    grouped_input(j)
        .iter()
        .flat_map(|s| s.chunks(block))
        .map(|b| codec::entropy_bits(&codec::histogram(b)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

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
