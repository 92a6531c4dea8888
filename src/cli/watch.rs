//! `ckvc watch RUN_DIR`: one line per event on stderr, or with `--json` one
//! JSON object per line on stdout.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use ckvc::repo::{watch, WatchEvent, WatchOptions};

use super::repo::{fail, human, Where};
use super::{escape_controls, out, Failure};

#[derive(Args)]
pub struct WatchArgs {
    /// The run's output directory (where `checkpoint-N/`, `step-N/`,
    /// `global_stepN/` or `iter_N/` appear).
    run_dir: PathBuf,
    /// Seconds a checkpoint of no known framework must stay unchanged
    /// before it is committed.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    settle: f64,
    /// Seconds between scans of RUN_DIR.
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    interval: f64,
    /// Keep only the newest K checkpoint directories on disk; older ones are
    /// deleted once their commit is on the branch and verified.
    #[arg(long, value_name = "K")]
    prune_local: Option<usize>,
    /// Commit what is complete now (two scans, --interval apart) and exit.
    #[arg(long)]
    once: bool,
    /// Commit on this branch instead of the current one.
    #[arg(long)]
    branch: Option<String>,
    /// The training code's directory, for provenance.
    #[arg(long, value_name = "DIR")]
    code: Option<PathBuf>,
    /// One JSON object per event on stdout.
    #[arg(long)]
    json: bool,
    /// Lower the watcher's CPU priority by N (its nice value +N, 0 to 19)
    /// before it commits, so the training job on the same machine comes
    /// first when they compete for cores.
    #[arg(long, default_value_t = 10, value_name = "N",
          value_parser = clap::value_parser!(i32).range(0..=19))]
    nice: i32,
}

fn secs(name: &str, v: f64) -> Result<Duration, Failure> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| Failure::user(format!("--{name}: {v} is not a duration")))
}

pub fn run(a: WatchArgs, w: &Where) -> Result<(), Failure> {
    // Find the repository once (reads only); watch opens it for writing
    // only while it commits.
    let root = w.open(false)?.root().to_path_buf();
    // Before any thread starts: each one the commits start inherits it.
    ckvc::repo::lower_thread_priority(a.nice);
    let opts = WatchOptions {
        settle: secs("settle", a.settle)?,
        interval: secs("interval", a.interval)?,
        prune_local: a.prune_local,
        once: a.once,
        branch: a.branch,
        code: a.code,
    };
    let mut busy_said = false;
    let mut failure = None;
    let r = watch(&root, &a.run_dir, &opts, |e| {
        let (json, line) = match e {
            WatchEvent::Committed {
                dir,
                layout,
                report: r,
            } => (
                serde_json::json!({
                    "event": "committed", "step": r.step, "id": r.id.to_string(),
                    "branch": r.branch, "dir": dir, "layout": layout.as_str(),
                    "logical_bytes": r.stats.logical_bytes, "stored_bytes": r.stats.stored_bytes,
                }),
                format!(
                    "[{} {}] step {} ({} {}): {} files, {} logical, {} new stored",
                    r.branch,
                    r.id.short(12),
                    r.step,
                    layout.as_str(),
                    dir.display(),
                    r.stats.files,
                    human(r.stats.logical_bytes),
                    human(r.stats.stored_bytes)
                ),
            ),
            WatchEvent::Skipped { dir, step, reason } => (
                serde_json::json!({"event": "skipped", "step": step, "dir": dir, "reason": reason}),
                format!("skipped step {step} ({}): {reason}", dir.display()),
            ),
            WatchEvent::Pruned { dir, step } => (
                serde_json::json!({"event": "pruned", "step": step, "dir": dir}),
                format!("deleted {} (step {step}: committed and verified)", dir.display()),
            ),
            WatchEvent::Failed { dir, step, error } => (
                serde_json::json!({"event": "failed", "step": step, "dir": dir, "error": error.to_string()}),
                format!("could not commit step {step} ({}): {error}", dir.display()),
            ),
            WatchEvent::Busy => {
                if busy_said {
                    return ControlFlow::Continue(());
                }
                busy_said = true;
                (
                    serde_json::json!({"event": "busy"}),
                    "another ckvc process is writing; trying again at the next scan".to_string(),
                )
            }
            _ => return ControlFlow::Continue(()),
        };
        if !matches!(e, WatchEvent::Busy) {
            busy_said = false;
        }
        eprintln!("{}", escape_controls(&line));
        if a.json {
            if let Err(f) = out(&format!("{json}\n")) {
                failure = Some(f);
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })
    .map_err(fail)?;
    if let Some(f) = failure {
        return Err(f);
    }
    if a.once && !a.json {
        eprintln!("{} committed, {} pruned", r.committed.len(), r.pruned.len());
    }
    Ok(())
}
