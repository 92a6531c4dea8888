//! The gc benchmark: what `gc --compact` buys on a whole run.
//!
//! Owns `ckvc debug gc-bench`. Commits every checkpoint of a run into a
//! fresh repository with a long delta chain allowed (`max_chain`), measures
//! bytes on disk and the checkout time of the newest and the first step,
//! then for each compaction bound K compacts a copy of that repository
//! (`gc --compact`, chains at most K) and measures again. Every checkout is
//! compared byte for byte with the original. Checkout times are the
//! fastest of `repeat` runs, page cache warm.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::repo::{run_checkpoints, WorkDir};
use super::BenchError;
use ckvc::repo::{
    dir_size, CheckoutOptions, CommitOptions, Config, GcOptions, Repository, DOT_DIR,
};

/// One repository state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcBenchRow {
    /// `None`: as committed; `Some(K)`: after `gc --compact` with chains ≤ K.
    pub compact_chain: Option<u16>,
    pub disk_bytes: u64,
    pub longest_chain: u16,
    pub checkout_newest_secs: f64,
    pub checkout_first_secs: f64,
    /// Time of the gc itself (0 for the committed state).
    pub gc_secs: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcBenchReport {
    pub steps: usize,
    pub logical_bytes: u64,
    /// Newest step's logical bytes (what its checkout writes).
    pub newest_bytes: u64,
    /// First step's logical bytes.
    pub first_bytes: u64,
    pub max_chain: u16,
    pub commit_secs: f64,
    pub rows: Vec<GcBenchRow>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BenchError {
    let path = path.to_path_buf();
    move |source| BenchError::Io { path, source }
}

fn copy_tree(from: &Path, to: &Path) -> Result<(), BenchError> {
    std::fs::create_dir_all(to).map_err(io(to))?;
    for e in std::fs::read_dir(from).map_err(io(from))? {
        let e = e.map_err(io(from))?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().map_err(io(&src))?.is_dir() {
            copy_tree(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst).map_err(io(&src))?;
        }
    }
    Ok(())
}

/// Fastest of `repeat` checkouts of `step` (verified against `dir`).
fn time_checkout(
    repo: &Repository,
    step: u64,
    dir: &Path,
    scratch: &Path,
    repeat: usize,
) -> Result<f64, BenchError> {
    let id = repo.resolve(&step.to_string())?;
    let mut best = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let out = scratch.join("checkout");
        let _ = std::fs::remove_dir_all(&out);
        let t = Instant::now();
        repo.checkout(&id, &out, &CheckoutOptions::default())?;
        best = best.min(t.elapsed().as_secs_f64());
        for e in std::fs::read_dir(dir).map_err(io(dir))? {
            let p = e.map_err(io(dir))?.path();
            if p.is_file() {
                let name = p.file_name().expect("a file has a name");
                let (a, b) = (
                    std::fs::read(&p).map_err(io(&p))?,
                    std::fs::read(out.join(name)).map_err(io(&out))?,
                );
                if a != b {
                    let offset = a.iter().zip(&b).position(|(x, y)| x != y);
                    return Err(BenchError::CheckoutMismatch {
                        step,
                        path: p.clone(),
                        offset: offset.unwrap_or(a.len().min(b.len())) as u64,
                    });
                }
            }
        }
    }
    Ok(best)
}

/// Run the gc benchmark on the run directory `run`.
pub fn gc_bench(
    run: &Path,
    work: Option<&Path>,
    max_chain: u16,
    chains: &[u16],
    repeat: usize,
) -> Result<GcBenchReport, BenchError> {
    let ckpts = run_checkpoints(run)?;
    let tmp = WorkDir::create(work, "gc-bench", false)?;
    let root: PathBuf = tmp.path.join("committed");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let config = Config {
        max_chain,
        ..Config::default()
    };
    let mut logical = 0;
    let mut newest_bytes = 0;
    let mut first_bytes = 0;
    let t = Instant::now();
    {
        let repo = Repository::init(&root, config)?;
        for (_, dir) in &ckpts {
            let r = repo.commit(dir, &CommitOptions::default())?;
            logical += r.stats.logical_bytes;
            newest_bytes = r.stats.logical_bytes;
            if first_bytes == 0 {
                first_bytes = r.stats.logical_bytes;
            }
        }
    }
    let commit_secs = t.elapsed().as_secs_f64();
    let (first, newest) = (&ckpts[0], &ckpts[ckpts.len() - 1]);
    let measure = |root: &Path, k: Option<u16>, gc_secs: f64| -> Result<GcBenchRow, BenchError> {
        let repo = Repository::open(root, true)?;
        Ok(GcBenchRow {
            compact_chain: k,
            disk_bytes: dir_size(&root.join(DOT_DIR)),
            longest_chain: repo.counts()?.longest_chain,
            checkout_newest_secs: time_checkout(&repo, newest.0, &newest.1, root, repeat)?,
            checkout_first_secs: time_checkout(&repo, first.0, &first.1, root, repeat)?,
            gc_secs,
        })
    };
    let mut rows = vec![measure(&root, None, 0.0)?];
    for &k in chains {
        let copy = tmp.path.join(format!("compact-{k}"));
        copy_tree(&root.join(DOT_DIR), &copy.join(DOT_DIR))?;
        let t = Instant::now();
        {
            let repo = Repository::open(&copy, true)?;
            repo.gc(&GcOptions {
                compact: true,
                compact_chain: Some(k),
                ..GcOptions::default()
            })?;
        }
        let gc_secs = t.elapsed().as_secs_f64();
        rows.push(measure(&copy, Some(k), gc_secs)?);
        std::fs::remove_dir_all(&copy).map_err(io(&copy))?;
    }
    Ok(GcBenchReport {
        steps: ckpts.len(),
        logical_bytes: logical,
        newest_bytes,
        first_bytes,
        max_chain,
        commit_secs,
        rows,
    })
}
