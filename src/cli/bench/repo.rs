//! The repository benchmark: a whole training run committed, checked out
//! and measured beside the plain alternatives, in one process.
//!
//! Owns `ckvc debug repo-bench`. In a private work directory (removed at
//! the end) it commits every checkpoint directory of a run in step order
//! into a fresh repository, measures the repository's bytes on disk, checks
//! every step out again and compares it byte for byte with the original,
//! and on the same files in the same run copies them (`cp -r`, with and
//! without fsync) and compresses each file with zstd -19. Peak memory is
//! read from `/proc/self/status` per phase. The library returns a
//! [`RepoBenchReport`]; printing is the CLI's business.
//!
//! Every timed phase sees a warm page cache: the run is read once before
//! anything is timed, so the commit is not charged for cold reads that the
//! copy after it would not pay.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::BenchError;
use ckvc::format;
use ckvc::repo::{CheckoutOptions, CommitOptions, Config, Repository, DOT_DIR};

/// Knobs of the repository benchmark.
#[derive(Debug, Clone)]
pub struct RepoBenchOptions {
    /// Where the private work directory is created (default: the system
    /// temporary directory). Repository, checkouts and copies go there, so
    /// it should be on the disk the numbers are meant for, not a tmpfs.
    pub work: Option<PathBuf>,
    /// Keep the work directory instead of removing it at the end.
    pub keep_work: bool,
    /// Settings of the benchmark repository.
    pub config: Config,
    /// zstd level of the per-file baseline.
    pub zstd_level: i32,
    /// Run the per-file zstd baseline (slow: ~4 MiB/s; skip it on large runs).
    pub zstd: bool,
}

impl Default for RepoBenchOptions {
    fn default() -> Self {
        RepoBenchOptions {
            work: None,
            keep_work: false,
            config: Config::default(),
            zstd_level: 19,
            zstd: true,
        }
    }
}

/// Per-step measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    pub step: u64,
    pub files: u64,
    pub logical_bytes: u64,
    /// Bytes the commit added to the store (as the commit reports them).
    pub stored_bytes: u64,
    /// Deepest delta chain of the commit's chunks (0: full snapshot).
    pub max_depth: u16,
    pub commit_secs: f64,
    /// CPU seconds (user + system, every thread of the process) of the commit.
    pub commit_cpu_secs: f64,
    pub checkout_secs: f64,
    /// CPU seconds of the checkout.
    pub checkout_cpu_secs: f64,
    /// `cp -r` + sync of this checkpoint directory, measured right after its
    /// commit and again right after its checkout (the faster of the two):
    /// the yardstick both are compared with, on the same files in the same run.
    pub copy_sync_secs: f64,
    /// The checkout compared equal to the original, byte for byte.
    pub verified: bool,
}

/// Bytes of the repository directory (`.ckvc`), by kind of file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskUsage {
    pub total: u64,
    /// RocksDB BlobDB files (`*.blob`): the chunk records.
    pub blob: u64,
    /// RocksDB table files (`*.sst`): keys, small values, objects.
    pub sst: u64,
    /// Everything else: write-ahead log, MANIFEST, OPTIONS, info logs.
    pub other: u64,
}

/// A size measured outside ckvc (e.g. ZipNN files, by
/// `scripts/compare_zipnn.py --files`), shown beside the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerSize {
    pub codec: String,
    pub bytes: u64,
    /// Bytes the peer read, when it says (should equal the run's logical bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_in: Option<u64>,
}

/// Seconds and throughput of one timed phase.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub secs: f64,
    pub mib_s: f64,
}

impl Timing {
    fn new(bytes: u64, secs: f64) -> Self {
        Timing {
            secs,
            mib_s: bytes as f64 / (1 << 20) as f64 / secs.max(1e-9),
        }
    }
}

/// Wall and CPU time of a timed stretch.
struct Clock {
    wall: Instant,
    cpu: Option<f64>,
}

impl Clock {
    fn start() -> Clock {
        Clock {
            wall: Instant::now(),
            cpu: cpu_secs(),
        }
    }
    /// (wall seconds, CPU seconds; 0 where unavailable).
    fn stop(&self) -> (f64, f64) {
        let wall = self.wall.elapsed().as_secs_f64();
        let cpu = match (self.cpu, cpu_secs()) {
            (Some(a), Some(b)) => b - a,
            _ => 0.0,
        };
        (wall, cpu)
    }
}

/// User + system CPU seconds of this process so far (every thread).
fn cpu_secs() -> Option<f64> {
    // SAFETY: rusage is plain integers, for which all-zero bytes are valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage struct, which we own.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return None;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(tv(ru.ru_utime) + tv(ru.ru_stime))
}

/// The whole result (also the `--json` schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepoBenchReport {
    pub run: PathBuf,
    pub checkpoints: usize,
    pub files: u64,
    /// Bytes of every file of every checkpoint.
    pub logical_bytes: u64,
    /// The repository directory after the last commit (store flushed).
    pub disk: DiskUsage,
    pub zstd_level: i32,
    /// Every file compressed on its own with zstd at `zstd_level` (`None`: skipped).
    pub zstd_files_bytes: Option<u64>,
    /// Sizes measured by other tools on the same files (filled by the caller).
    #[serde(default)]
    pub peers: Vec<PeerSize>,
    /// Every commit, in step order (durable: the store fsyncs its log).
    pub commit: Timing,
    /// CPU seconds of every commit over their wall seconds (2.0: both of
    /// two cores busy the whole time).
    pub commit_cpu_util: f64,
    /// Every step checked out into a fresh directory (durable, as
    /// `ckvc checkout` does); verification is not timed.
    pub checkout: Timing,
    /// CPU seconds of every checkout over their wall seconds.
    pub checkout_cpu_util: f64,
    /// `cp -r` + sync of every checkpoint directory: per step the faster of
    /// the copy beside its commit and the copy beside its checkout
    /// (`std::fs::copy` of every file, then each file and directory fsynced).
    pub copy_sync: Timing,
    /// The per-file zstd baseline (one core); `None` when skipped.
    pub zstd_files: Option<Timing>,
    /// Checkout of the first step alone (a full snapshot).
    pub checkout_first_secs: f64,
    /// Checkout of the newest step alone (the end of the delta chains).
    pub checkout_newest_secs: f64,
    /// Peak resident memory during the commit phase, bytes (`None`: not Linux).
    pub peak_rss_commit: Option<u64>,
    /// Peak resident memory during the checkout phase, bytes.
    pub peak_rss_checkout: Option<u64>,
    /// Whether the peak was reset between phases (`/proc/self/clear_refs`);
    /// if not, each figure is the process's peak so far.
    pub peak_rss_per_phase: bool,
    /// Every checkout compared equal to its original.
    pub all_verified: bool,
    pub steps: Vec<StepRow>,
    /// The work directory (already removed unless asked to keep it).
    pub work_dir: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BenchError {
    let path = path.to_path_buf();
    move |source| BenchError::Io { path, source }
}

/// Removes the work directory when the benchmark ends, on error too.
pub(crate) struct WorkDir {
    pub(crate) path: PathBuf,
    keep: bool,
}

impl WorkDir {
    /// A fresh `ckvc-<name>-...` directory under `base` (default: the
    /// system temporary directory).
    pub(crate) fn create(base: Option<&Path>, name: &str, keep: bool) -> Result<Self, BenchError> {
        let base = base.map_or_else(std::env::temp_dir, Path::to_path_buf);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let work = WorkDir {
            path: base.join(format!("ckvc-{name}-{}-{nanos}", std::process::id())),
            keep,
        };
        std::fs::create_dir_all(&work.path).map_err(io(&work.path))?;
        Ok(work)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The checkpoint directories of a run, in step order.
pub fn run_checkpoints(run: &Path) -> Result<Vec<(u64, PathBuf)>, BenchError> {
    let mut dirs = Vec::new();
    for e in std::fs::read_dir(run).map_err(io(run))? {
        let e = e.map_err(io(run))?;
        if e.file_type().map_err(io(&e.path()))?.is_dir() {
            if let Some(step) = format::step_of_dir_name(&e.file_name().to_string_lossy()) {
                dirs.push((step, e.path()));
            }
        }
    }
    dirs.sort();
    if dirs.is_empty() {
        return Err(BenchError::Empty {
            path: run.to_path_buf(),
        });
    }
    Ok(dirs)
}

/// One checkpoint directory of the run.
struct Input {
    step: u64,
    dir: PathBuf,
    /// (path relative to `dir`, path), sorted.
    files: Vec<(PathBuf, PathBuf)>,
    bytes: u64,
}

/// Every regular file under `dir` as (path relative to `dir`, path), sorted.
fn files_of(dir: &Path) -> Result<Vec<(PathBuf, PathBuf)>, BenchError> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let d = dir.join(&rel);
        for e in std::fs::read_dir(&d).map_err(io(&d))? {
            let e = e.map_err(io(&d))?;
            let t = e.file_type().map_err(io(&e.path()))?;
            let r = rel.join(e.file_name());
            if t.is_dir() {
                stack.push(r);
            } else if t.is_file() {
                out.push((r, e.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Run the repository benchmark on the run directory `run`.
pub fn repo_bench(run: &Path, opts: &RepoBenchOptions) -> Result<RepoBenchReport, BenchError> {
    let ckpts = run_checkpoints(run)?;
    let mut inputs = Vec::new();
    let (mut files, mut logical) = (0u64, 0u64);
    for (step, dir) in &ckpts {
        let fs = files_of(dir)?;
        let mut bytes = 0;
        for (_, p) in &fs {
            // Reading every file once warms the page cache for every phase.
            bytes += read_through(p)?;
        }
        files += fs.len() as u64;
        logical += bytes;
        inputs.push(Input {
            step: *step,
            dir: dir.clone(),
            files: fs,
            bytes,
        });
    }

    let work = WorkDir::create(opts.work.as_deref(), "repo-bench", opts.keep_work)?;
    let repo_root = work.path.join("repo");
    std::fs::create_dir_all(&repo_root).map_err(io(&repo_root))?;

    // 1. Commit every checkpoint; beside each, `cp -r` + sync of the same
    //    directory, so each ratio is measured in one stretch of the run.
    let peak_reset = reset_peak_rss();
    let repo = Repository::init(&repo_root, opts.config.clone())?;
    let cp_dest = work.path.join("cp");
    let mut steps = Vec::new();
    let mut ids = Vec::new();
    let (mut commit_wall, mut commit_cpu) = (0.0, 0.0);
    for input in &inputs {
        let clock = Clock::start();
        let r = repo.commit(
            &input.dir,
            &CommitOptions {
                step: Some(input.step),
                message: format!("repo-bench {}", input.dir.display()),
                ..CommitOptions::default()
            },
        )?;
        let (secs, cpu) = clock.stop();
        commit_wall += secs;
        commit_cpu += cpu;
        ids.push(r.id);
        steps.push(StepRow {
            step: input.step,
            files: input.files.len() as u64,
            logical_bytes: input.bytes,
            stored_bytes: r.stats.stored_bytes,
            max_depth: r.stats.max_depth,
            commit_secs: secs,
            commit_cpu_secs: cpu,
            checkout_secs: 0.0,
            checkout_cpu_secs: 0.0,
            copy_sync_secs: copy_sync(input, &cp_dest)?,
            verified: false,
        });
    }
    let peak_rss_commit = peak_rss();
    let disk = disk_usage(&repo_root.join(DOT_DIR))?;

    // 2. Check every step out into a fresh directory, copy beside it, compare.
    let peak_reset = reset_peak_rss() && peak_reset;
    let co_root = work.path.join("checkout");
    let (mut checkout_wall, mut checkout_cpu) = (0.0, 0.0);
    let mut peak_rss_checkout = None;
    for (i, input) in inputs.iter().enumerate() {
        let (step, fs) = (input.step, &input.files);
        let out = co_root.join(format!("step-{step}"));
        let clock = Clock::start();
        // As `ckvc checkout` does: gigabytes read around the page cache.
        let bulk = repo.checkout_reader(&ids[i])?;
        bulk.as_ref()
            .unwrap_or(&repo)
            .checkout(&ids[i], &out, &CheckoutOptions::default())?;
        drop(bulk);
        let (secs, cpu) = clock.stop();
        checkout_wall += secs;
        checkout_cpu += cpu;
        steps[i].checkout_secs = secs;
        steps[i].checkout_cpu_secs = cpu;
        // The peak of the checkout itself, before verification reads.
        peak_rss_checkout = peak_rss_checkout.max(peak_rss());
        steps[i].copy_sync_secs = steps[i].copy_sync_secs.min(copy_sync(input, &cp_dest)?);
        let got = files_of(&out)?;
        if got.len() != fs.len() {
            return Err(BenchError::CheckoutMismatch {
                step,
                path: out,
                offset: 0,
            });
        }
        for ((rel, orig), (rel2, copy)) in fs.iter().zip(&got) {
            if rel != rel2 {
                return Err(BenchError::CheckoutMismatch {
                    step,
                    path: copy.clone(),
                    offset: 0,
                });
            }
            if let Some(offset) = first_difference(orig, copy)? {
                return Err(BenchError::CheckoutMismatch {
                    step,
                    path: copy.clone(),
                    offset,
                });
            }
        }
        steps[i].verified = true;
        std::fs::remove_dir_all(&out).map_err(io(&out))?;
    }
    drop(repo);

    // 3. Per-file zstd on the same files.
    let zstd = if opts.zstd {
        let t = Instant::now();
        let mut zstd_bytes = 0;
        for input in &inputs {
            for (_, p) in &input.files {
                zstd_bytes += zstd_file(p, opts.zstd_level)?;
            }
        }
        Some((zstd_bytes, Timing::new(logical, t.elapsed().as_secs_f64())))
    } else {
        None
    };

    let all_verified = steps.iter().all(|s| s.verified);
    let copy_secs: f64 = steps.iter().map(|s| s.copy_sync_secs).sum();
    Ok(RepoBenchReport {
        run: run.to_path_buf(),
        checkpoints: inputs.len(),
        files,
        logical_bytes: logical,
        disk,
        zstd_level: opts.zstd_level,
        zstd_files_bytes: zstd.map(|z| z.0),
        peers: Vec::new(),
        commit: Timing::new(logical, commit_wall),
        commit_cpu_util: commit_cpu / commit_wall.max(1e-9),
        checkout: Timing::new(logical, checkout_wall),
        checkout_cpu_util: checkout_cpu / checkout_wall.max(1e-9),
        copy_sync: Timing::new(logical, copy_secs),
        zstd_files: zstd.map(|z| z.1),
        checkout_first_secs: steps.first().map_or(0.0, |s| s.checkout_secs),
        checkout_newest_secs: steps.last().map_or(0.0, |s| s.checkout_secs),
        peak_rss_commit,
        peak_rss_checkout,
        peak_rss_per_phase: peak_reset,
        all_verified,
        steps,
        work_dir: work.path.clone(),
    })
}

/// Read a file to the end in 1 MiB pieces; its length.
fn read_through(p: &Path) -> Result<u64, BenchError> {
    let mut f = std::fs::File::open(p).map_err(io(p))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        match f.read(&mut buf).map_err(io(p))? {
            0 => return Ok(n),
            k => n += k as u64,
        }
    }
}

/// Fill `buf` from `r` as far as the input goes; the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8], p: &Path) -> Result<usize, BenchError> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]).map_err(io(p))? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The first byte offset where two files differ (a length difference
/// counts at the shorter length), or `None` when they are equal. Streams
/// both, so memory stays bounded whatever the file size.
fn first_difference(a: &Path, b: &Path) -> Result<Option<u64>, BenchError> {
    let mut fa = std::fs::File::open(a).map_err(io(a))?;
    let mut fb = std::fs::File::open(b).map_err(io(b))?;
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut off = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba, a)?;
        let nb = read_full(&mut fb, &mut bb, b)?;
        if let Some(i) = ba[..na.min(nb)]
            .iter()
            .zip(&bb[..na.min(nb)])
            .position(|(x, y)| x != y)
        {
            return Ok(Some(off + i as u64));
        }
        if na != nb {
            return Ok(Some(off + na.min(nb) as u64));
        }
        if na == 0 {
            return Ok(None);
        }
        off += na as u64;
    }
}

/// `cp -r` + `sync` of one checkpoint directory into `dest` (removed
/// afterwards): every file copied with `std::fs::copy`, then every file
/// and directory fsynced, as durable as a checkout. Seconds.
fn copy_sync(input: &Input, dest: &Path) -> Result<f64, BenchError> {
    let to = dest.join(input.dir.file_name().unwrap_or_default());
    let t = Instant::now();
    std::fs::create_dir_all(&to).map_err(io(&to))?;
    let mut dirs = vec![to.clone()];
    let mut copies = Vec::with_capacity(input.files.len());
    for (rel, p) in &input.files {
        let q = to.join(rel);
        let parent = q.parent().expect("a joined relative path has a parent");
        if !dirs.iter().any(|d| d == parent) {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
            dirs.push(parent.to_path_buf());
        }
        std::fs::copy(p, &q).map_err(io(&q))?;
        copies.push(q);
    }
    for q in copies.iter().chain(&dirs) {
        std::fs::File::open(q)
            .and_then(|f| f.sync_all())
            .map_err(io(q))?;
    }
    let secs = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(dest).map_err(io(dest))?;
    Ok(secs)
}

/// Counts what is written to it.
struct Count(u64);

impl Write for Count {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The size of `p` as one zstd frame at `level` (as `zstd -19 FILE` writes it).
fn zstd_file(p: &Path, level: i32) -> Result<u64, BenchError> {
    let mut f = std::fs::File::open(p).map_err(io(p))?;
    let len = f.metadata().map_err(io(p))?.len();
    let mut enc = zstd::stream::Encoder::new(Count(0), level).map_err(io(p))?;
    enc.set_pledged_src_size(Some(len)).map_err(io(p))?;
    enc.include_contentsize(true).map_err(io(p))?;
    std::io::copy(&mut f, &mut enc).map_err(io(p))?;
    Ok(enc.finish().map_err(io(p))?.0)
}

/// Sum of the sizes of the files under `dir`, by kind. A file gone
/// between listing and size (RocksDB deletes obsolete files in the
/// background) counts as nothing.
pub fn disk_usage(dir: &Path) -> Result<DiskUsage, BenchError> {
    let mut u = DiskUsage::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && d != dir => continue,
            entries => entries.map_err(io(&d))?,
        };
        for e in entries {
            let e = e.map_err(io(&d))?;
            let meta = match e.metadata() {
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                meta => meta.map_err(io(&e.path()))?,
            };
            if meta.is_dir() {
                stack.push(e.path());
                continue;
            }
            let n = meta.len();
            u.total += n;
            match e.path().extension().and_then(|x| x.to_str()) {
                Some("blob") => u.blob += n,
                Some("sst") => u.sst += n,
                _ => u.other += n,
            }
        }
    }
    Ok(u)
}

/// `VmHWM` of this process, bytes (Linux); `None` where unavailable.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Reset the peak-RSS mark to the current RSS (Linux >= 4.0); whether it worked.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_difference_finds_the_offset_and_length_changes() {
        let d = std::env::temp_dir().join(format!("ckvc-fd-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (a, b) = (d.join("a"), d.join("b"));
        let x: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&a, &x).unwrap();
        std::fs::write(&b, &x).unwrap();
        assert_eq!(first_difference(&a, &b).unwrap(), None);
        let mut y = x.clone();
        y[2_000_001] ^= 1;
        std::fs::write(&b, &y).unwrap();
        assert_eq!(first_difference(&a, &b).unwrap(), Some(2_000_001));
        std::fs::write(&b, &x[..1_500_000]).unwrap();
        assert_eq!(first_difference(&a, &b).unwrap(), Some(1_500_000));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn zstd_file_matches_the_bulk_frame_size_roughly() {
        let d = std::env::temp_dir().join(format!("ckvc-zf-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("x");
        let x: Vec<u8> = (0..200_000u32).map(|i| (i % 7) as u8).collect();
        std::fs::write(&p, &x).unwrap();
        let n = zstd_file(&p, 19).unwrap();
        let bulk = zstd::bulk::compress(&x, 19).unwrap().len() as u64;
        assert!(n > 0 && n < 1000 && n.abs_diff(bulk) < 64, "{n} vs {bulk}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
