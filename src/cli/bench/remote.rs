//! The remote benchmark (`ckvc debug remote-bench`): a run pushed to a
//! directory remote and brought back, bytes transferred against the
//! checkpoints' logical size and MiB/s beside `cp -r` of the same
//! directories.
//!
//! In a private work directory: all steps but the last are committed into
//! repository A (not timed) and pushed (the first push); a clone B is made
//! from the remote (the first pull); the last step is committed in A and
//! pushed (an incremental push of one step) and B pulls it (an incremental
//! pull). The page cache is warm for every phase; the directory remote
//! fsyncs each pack, `cp -r` does not (a `cp -r` + `sync` row is given).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::BenchError;
use ckvc::remote::{self, DirRemote, NoProgress};
use ckvc::repo::{CommitOptions, Config, Repository};

/// One measured transfer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transfer {
    pub what: String,
    pub commits: u64,
    pub logical_bytes: u64,
    pub transferred_bytes: u64,
    pub secs: f64,
}

impl Transfer {
    /// Logical MiB per second.
    pub fn mib_s(&self) -> f64 {
        self.logical_bytes as f64 / (1 << 20) as f64 / self.secs.max(1e-9)
    }
}

/// What the remote benchmark measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoteBenchReport {
    pub run: PathBuf,
    pub rows: Vec<Transfer>,
}

fn step_dirs(run: &Path) -> Result<Vec<(u64, PathBuf)>, BenchError> {
    let io = |source| BenchError::Io {
        path: run.to_path_buf(),
        source,
    };
    let mut v = Vec::new();
    for e in std::fs::read_dir(run).map_err(io)? {
        let e = e.map_err(io)?;
        let n = e.file_name().to_string_lossy().into_owned();
        if let (true, Some(s)) = (e.path().is_dir(), ckvc::format::step_of_dir_name(&n)) {
            v.push((s, e.path()));
        }
    }
    v.sort();
    if v.len() < 2 {
        return Err(BenchError::Empty {
            path: run.to_path_buf(),
        });
    }
    Ok(v)
}

fn warm(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let _ = std::fs::read(e.path());
        }
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Run the benchmark on the run in `run`, in a work directory under `work`
/// (default: the system temporary directory), removed at the end.
pub fn remote_bench(run: &Path, work: Option<&Path>) -> Result<RemoteBenchReport, BenchError> {
    let steps = step_dirs(run)?;
    let base = work
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let wd = base.join(format!("ckvc-remote-bench-{}", std::process::id()));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| BenchError::Io { path: p, source }
    };
    std::fs::create_dir_all(&wd).map_err(io(&wd))?;
    let result = (|| {
        let (first, last) = steps.split_at(steps.len() - 1);
        for (_, d) in &steps {
            warm(d);
        }
        let a = Repository::init(&wd.join("a"), Config::default())?;
        for (_, d) in first {
            a.commit(d, &CommitOptions::default())?;
        }
        let url = wd.join("remote");
        let r = DirRemote::new(url.clone());
        let mut rows = Vec::new();

        let t = Instant::now();
        let p = remote::push(&a, "origin", &r, &Default::default(), &NoProgress)?;
        rows.push(Transfer {
            what: format!("first push ({} steps)", first.len()),
            commits: p.commits,
            logical_bytes: p.logical_bytes,
            transferred_bytes: p.bytes_sent,
            secs: t.elapsed().as_secs_f64(),
        });

        let t = Instant::now();
        let (b, c) = remote::clone(
            url.to_str().unwrap_or_default(),
            &wd.join("b"),
            &Default::default(),
            &NoProgress,
        )?;
        rows.push(Transfer {
            what: format!("clone ({} steps)", first.len()),
            commits: c.fetch.commits,
            logical_bytes: c.fetch.logical_bytes,
            transferred_bytes: c.fetch.bytes_received,
            secs: t.elapsed().as_secs_f64(),
        });

        a.commit(&last[0].1, &CommitOptions::default())?;
        let t = Instant::now();
        let p = remote::push(&a, "origin", &r, &Default::default(), &NoProgress)?;
        rows.push(Transfer {
            what: format!("incremental push (step {})", last[0].0),
            commits: p.commits,
            logical_bytes: p.logical_bytes,
            transferred_bytes: p.bytes_sent,
            secs: t.elapsed().as_secs_f64(),
        });

        let t = Instant::now();
        let pl = remote::pull(&b, "origin", &r, None, &NoProgress)?;
        rows.push(Transfer {
            what: format!("incremental pull (step {})", last[0].0),
            commits: pl.fetch.commits,
            logical_bytes: pl.fetch.logical_bytes,
            transferred_bytes: pl.fetch.bytes_received,
            secs: t.elapsed().as_secs_f64(),
        });

        // cp -r of the same checkpoint directories.
        let logical: u64 = first.iter().map(|(_, d)| dir_bytes(d)).sum();
        for sync in [false, true] {
            let dest = wd.join(if sync { "cp-sync" } else { "cp" });
            std::fs::create_dir_all(&dest).map_err(io(&dest))?;
            let t = Instant::now();
            let status = Command::new("cp")
                .arg("-r")
                .args(first.iter().map(|(_, d)| d))
                .arg(&dest)
                .status()
                .map_err(io(&dest))?;
            if sync {
                let _ = Command::new("sync").arg("-f").arg(&dest).status();
            }
            if !status.success() {
                return Err(BenchError::Io {
                    path: dest,
                    source: std::io::Error::other("cp -r failed"),
                });
            }
            rows.push(Transfer {
                what: format!(
                    "cp -r{} ({} steps)",
                    if sync { " + sync" } else { "" },
                    first.len()
                ),
                commits: first.len() as u64,
                logical_bytes: logical,
                transferred_bytes: logical,
                secs: t.elapsed().as_secs_f64(),
            });
        }
        Ok(RemoteBenchReport {
            run: run.to_path_buf(),
            rows,
        })
    })();
    let _ = std::fs::remove_dir_all(&wd);
    result
}
