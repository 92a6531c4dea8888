//! `watch`: commit each new complete checkpoint a running job writes.
//!
//! A scan lists the checkpoint directories of a run directory and decides,
//! per training framework, whether each is complete ([`RunLayout`]): a
//! framework writes a marker last (HF Trainer's `trainer_state.json`, DCP's
//! `.metadata`, DeepSpeed's `latest`, Megatron's
//! `latest_checkpointed_iteration.txt`); a directory of no known framework
//! is complete once nothing in it has changed for the settle time. Every
//! directory must also look the same (names, lengths, modification times)
//! in two scans in a row, so a file still being written is never read.
//!
//! Complete checkpoints newer than the branch head are committed in step
//! order; steps the branch already has are recognised and skipped, so a
//! restarted watcher goes on where it stopped. With `prune_local`, local
//! checkpoint directories beyond the newest K are deleted, and only after
//! their commit is on the branch and every file of it verified against its
//! blake3 by reading it back from the store.
//!
//! The repository is opened for writing only while committing, so other
//! commands can write between scans; the library reports what happens
//! through a callback and never prints.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::format::step_of_dir_name;
use crate::store::CommitId;

use super::{CommitOptions, CommitReport, RepoError, Repository};

/// Knobs of [`watch`].
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// How long a checkpoint of no known framework must stay unchanged
    /// before it is committed.
    pub settle: Duration,
    /// Time between scans.
    pub interval: Duration,
    /// Keep at most this many local checkpoint directories; older ones are
    /// deleted once committed and verified. `None`: delete nothing.
    pub prune_local: Option<usize>,
    /// Scan, commit what is complete, and return instead of watching on.
    pub once: bool,
    /// The branch to commit on (default: the current branch).
    pub branch: Option<String>,
    /// Training-code directory for provenance (see [`CommitOptions::code`]).
    pub code: Option<PathBuf>,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            settle: Duration::from_secs(30),
            interval: Duration::from_secs(5),
            prune_local: None,
            once: false,
            branch: None,
            code: None,
        }
    }
}

/// How a run directory's checkpoints mark themselves complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunLayout {
    /// HF Trainer: `checkpoint-N/`, `trainer_state.json` written last.
    HfTrainer,
    /// PyTorch distributed checkpoint: `.metadata` written last.
    Dcp,
    /// DeepSpeed: `global_stepN/`, the run's `latest` names the newest.
    DeepSpeed,
    /// Megatron: `iter_NNNNNNN/`, `latest_checkpointed_iteration.txt`.
    Megatron,
    /// Anything else with a step number in its name: complete when it has
    /// not changed for the settle time.
    Plain,
}

impl RunLayout {
    pub fn as_str(self) -> &'static str {
        match self {
            RunLayout::HfTrainer => "hf-trainer",
            RunLayout::Dcp => "dcp",
            RunLayout::DeepSpeed => "deepspeed",
            RunLayout::Megatron => "megatron",
            RunLayout::Plain => "plain",
        }
    }
}

/// What [`watch`] reports as it goes.
#[derive(Debug)]
#[non_exhaustive]
pub enum WatchEvent<'a> {
    /// A checkpoint was committed (durably, with the branch moved).
    Committed {
        dir: &'a Path,
        layout: RunLayout,
        report: &'a CommitReport,
    },
    /// A complete checkpoint the branch already holds (first seen after a
    /// restart), or one older than the branch head: not committed.
    Skipped {
        dir: &'a Path,
        step: u64,
        reason: &'static str,
    },
    /// A committed and verified local checkpoint directory was deleted.
    Pruned { dir: &'a Path, step: u64 },
    /// A complete checkpoint could not be committed (a file vanished, e.g.
    /// the trainer rotated it away, or does not parse); the watcher goes on
    /// with the next one, so this step is then older than the branch head.
    Failed {
        dir: &'a Path,
        step: u64,
        error: &'a RepoError,
    },
    /// Another process holds the repository's write lock; tried again at
    /// the next scan.
    Busy,
    /// A scan found nothing new to commit.
    Idle { waiting: usize },
}

/// What a [`watch`] that returned did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct WatchReport {
    pub committed: Vec<(u64, CommitId)>,
    pub pruned: Vec<PathBuf>,
    pub scans: u64,
}

/// A checkpoint directory as a scan sees it.
#[derive(Debug, Clone)]
struct Found {
    step: u64,
    dir: PathBuf,
    layout: RunLayout,
    /// The framework's marker says it is complete (for `Plain`: never).
    marked: bool,
    signature: Signature,
}

/// Every file under a directory with its length and modification time.
type Signature = Vec<(String, u64, Option<SystemTime>)>;

/// Watch `run_dir` and commit its complete checkpoints into the repository
/// at `root`, calling `on_event` for everything that happens, until
/// `on_event` breaks, or after one pass with [`WatchOptions::once`].
pub fn watch(
    root: &Path,
    run_dir: &Path,
    opts: &WatchOptions,
    mut on_event: impl FnMut(WatchEvent<'_>) -> ControlFlow<()>,
) -> Result<WatchReport, RepoError> {
    if !run_dir.is_dir() {
        return Err(RepoError::BadInput {
            path: run_dir.to_path_buf(),
            reason: "not a directory".into(),
        });
    }
    let mut report = WatchReport::default();
    // The signature of each directory at the previous scan, and since when
    // it has not changed.
    let mut seen: HashMap<PathBuf, (Signature, Instant)> = HashMap::new();
    let mut skipped: HashSet<PathBuf> = HashSet::new();
    let mut verified: HashSet<PathBuf> = HashSet::new();
    loop {
        report.scans += 1;
        let now = Instant::now();
        let found = scan(run_dir)?;
        let mut ready = Vec::new();
        let mut waiting = 0;
        for f in &found {
            let stable_since = match seen.get(&f.dir) {
                Some((sig, since)) if *sig == f.signature => *since,
                _ => now,
            };
            seen.insert(f.dir.clone(), (f.signature.clone(), stable_since));
            // Unchanged since the previous scan at least, and marked
            // complete by its framework or unchanged for the settle time.
            let unchanged = stable_since < now;
            let complete = unchanged
                && if f.layout == RunLayout::Plain {
                    now.duration_since(stable_since) >= opts.settle && !f.signature.is_empty()
                } else {
                    f.marked
                };
            if complete {
                ready.push(f);
            } else {
                waiting += 1;
            }
        }
        seen.retain(|d, _| found.iter().any(|f| &f.dir == d));
        if !ready.is_empty() || opts.prune_local.is_some() {
            match commit_ready(root, opts, &ready, &mut skipped, &mut report, &mut on_event) {
                Ok(ControlFlow::Break(())) => return Ok(report),
                Ok(ControlFlow::Continue(())) => {}
                Err(e) if e.is_busy() => {
                    if on_event(WatchEvent::Busy).is_break() {
                        return Ok(report);
                    }
                }
                Err(e) => return Err(e),
            }
            if let Some(keep) = opts.prune_local {
                let pruned = prune(
                    root,
                    opts,
                    &found,
                    keep,
                    &mut verified,
                    &mut report,
                    &mut on_event,
                );
                match pruned {
                    Ok(ControlFlow::Break(())) => return Ok(report),
                    Ok(ControlFlow::Continue(())) => {}
                    Err(e) if e.is_busy() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        // One pass is two scans: the first only records what it sees, so
        // nothing is read while it may still change.
        if opts.once && report.scans >= 2 {
            return Ok(report);
        }
        if on_event(WatchEvent::Idle { waiting }).is_break() {
            return Ok(report);
        }
        std::thread::sleep(opts.interval);
    }
}

/// Commit the complete checkpoints newer than the branch head, in order.
fn commit_ready(
    root: &Path,
    opts: &WatchOptions,
    ready: &[&Found],
    skipped: &mut HashSet<PathBuf>,
    report: &mut WatchReport,
    on_event: &mut impl FnMut(WatchEvent<'_>) -> ControlFlow<()>,
) -> Result<ControlFlow<()>, RepoError> {
    if ready.is_empty() {
        return Ok(ControlFlow::Continue(()));
    }
    let repo = Repository::open(root, true)?;
    let branch = match &opts.branch {
        Some(b) => b.clone(),
        None => repo.current_branch()?,
    };
    let (steps, head_step) = branch_steps(&repo, &branch)?;
    let mut head_step = head_step;
    for f in ready {
        let reason = if steps.contains_key(&f.step) {
            Some("already committed on the branch")
        } else if head_step.is_some_and(|h| f.step <= h) {
            Some("older than the branch head")
        } else {
            None
        };
        if let Some(reason) = reason {
            if skipped.insert(f.dir.clone())
                && on_event(WatchEvent::Skipped {
                    dir: &f.dir,
                    step: f.step,
                    reason,
                })
                .is_break()
            {
                return Ok(ControlFlow::Break(()));
            }
            continue;
        }
        let r = match repo.commit(
            &f.dir,
            &CommitOptions {
                step: Some(f.step),
                branch: Some(branch.clone()),
                code: opts.code.clone(),
                ..CommitOptions::default()
            },
        ) {
            Ok(r) => r,
            Err(error) if is_checkpoint_error(&error, &f.dir) => {
                if on_event(WatchEvent::Failed {
                    dir: &f.dir,
                    step: f.step,
                    error: &error,
                })
                .is_break()
                {
                    return Ok(ControlFlow::Break(()));
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        head_step = Some(f.step);
        report.committed.push((f.step, r.id));
        if on_event(WatchEvent::Committed {
            dir: &f.dir,
            layout: f.layout,
            report: &r,
        })
        .is_break()
        {
            return Ok(ControlFlow::Break(()));
        }
    }
    Ok(ControlFlow::Continue(()))
}

/// True for an error of the checkpoint's own files (gone, unreadable, not
/// parsing), as opposed to an error of the repository.
fn is_checkpoint_error(e: &RepoError, dir: &Path) -> bool {
    match e {
        RepoError::Format { path, .. }
        | RepoError::BadInput { path, .. }
        | RepoError::Io { path, .. } => path.starts_with(dir),
        _ => false,
    }
}

/// Every step on `branch`'s first-parent line with its commit, and the
/// head's step.
fn branch_steps(
    repo: &Repository,
    branch: &str,
) -> Result<(HashMap<u64, CommitId>, Option<u64>), RepoError> {
    let mut steps = HashMap::new();
    let mut head_step = None;
    if repo.branch_head(branch)?.is_some() {
        for e in repo.log(Some(branch), None)? {
            head_step.get_or_insert(e.commit.step);
            steps.entry(e.commit.step).or_insert(e.id);
        }
    }
    Ok((steps, head_step))
}

/// Delete local checkpoint directories beyond the newest `keep`, each only
/// when its step is on the branch and that commit verifies whole.
fn prune(
    root: &Path,
    opts: &WatchOptions,
    found: &[Found],
    keep: usize,
    verified: &mut HashSet<PathBuf>,
    report: &mut WatchReport,
    on_event: &mut impl FnMut(WatchEvent<'_>) -> ControlFlow<()>,
) -> Result<ControlFlow<()>, RepoError> {
    if found.len() <= keep {
        return Ok(ControlFlow::Continue(()));
    }
    let old = &found[..found.len() - keep];
    let repo = Repository::open(root, false)?;
    let branch = match &opts.branch {
        Some(b) => b.clone(),
        None => repo.current_branch()?,
    };
    let (steps, _) = branch_steps(&repo, &branch)?;
    for f in old {
        let Some(id) = steps.get(&f.step) else {
            continue; // not committed: never deleted
        };
        if !verified.contains(&f.dir) {
            if !repo.holds_dir(id, &f.dir)? {
                continue;
            }
            verified.insert(f.dir.clone());
        }
        match std::fs::remove_dir_all(&f.dir) {
            Ok(()) => {}
            // Deleted meanwhile by someone else (the trainer's own
            // rotation): nothing left to prune.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(RepoError::Io {
                    path: f.dir.clone(),
                    source,
                })
            }
        }
        report.pruned.push(f.dir.clone());
        if on_event(WatchEvent::Pruned {
            dir: &f.dir,
            step: f.step,
        })
        .is_break()
        {
            return Ok(ControlFlow::Break(()));
        }
    }
    Ok(ControlFlow::Continue(()))
}

impl Repository {
    /// True when deleting the checkpoint directory `dir` loses nothing:
    /// commit `id` holds exactly its files (paths, lengths and whole-file
    /// blake3) and every file of the commit reads back whole from the
    /// store (each chunk decoded and verified). What `watch`'s
    /// `prune_local` checks before it deletes a directory.
    pub fn holds_dir(&self, id: &CommitId, dir: &Path) -> Result<bool, RepoError> {
        Ok(same_files(self, id, dir)? && self.verify_commit(id)?.is_clean())
    }
}

/// True when commit `id` holds the files of `dir` with their lengths and
/// whole-file blake3 (so deleting `dir` loses nothing). A file or the
/// directory gone while it is read (a trainer's rotation deleting it):
/// false, not an error.
fn same_files(repo: &Repository, id: &CommitId, dir: &Path) -> Result<bool, RepoError> {
    let tree = repo.tree(&repo.commit_object(id)?.tree)?;
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let sig = match signature(dir) {
        Ok(s) => s,
        Err(e) if gone(&e) => return Ok(false),
        Err(source) => {
            return Err(RepoError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    if sig.len() != tree.entries.len() {
        return Ok(false);
    }
    for ((rel, len, _), (path, mid)) in sig.iter().zip(&tree.entries) {
        if rel != path {
            return Ok(false);
        }
        let m = repo.manifest(mid, path)?;
        if m.len != *len {
            return Ok(false);
        }
        let file = dir.join(rel);
        match hash_file(&file) {
            Ok(h) if h == m.hash => {}
            Ok(_) => return Ok(false),
            Err(e) if gone(&e) => return Ok(false),
            Err(source) => return Err(RepoError::Io { path: file, source }),
        }
    }
    Ok(true)
}

fn hash_file(path: &Path) -> std::io::Result<[u8; 32]> {
    // Never blocks on a FIFO put where a committed file was.
    let mut f = crate::format::open_regular(path)?;
    let mut h = blake3::Hasher::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(*h.finalize().as_bytes())
}

/// The checkpoint directories of `run_dir`, in step order.
fn scan(run_dir: &Path) -> Result<Vec<Found>, RepoError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RepoError::Io { path, source }
    };
    // DeepSpeed's and Megatron's trackers: the newest complete step.
    // Trackers and markers are read only when regular files (a FIFO would
    // block the watcher) and small.
    let tracker = |name: &str| {
        crate::format::read_small_file(&run_dir.join(name), 4096)
            .and_then(|b| String::from_utf8(b).ok())
    };
    let deepspeed_latest =
        tracker("latest").and_then(|s| s.trim().strip_prefix("global_step")?.parse::<u64>().ok());
    let megatron_latest =
        tracker("latest_checkpointed_iteration.txt").and_then(|s| s.trim().parse::<u64>().ok());
    let mut by_step: BTreeMap<u64, Found> = BTreeMap::new();
    for e in std::fs::read_dir(run_dir).map_err(io(run_dir))? {
        let e = e.map_err(io(run_dir))?;
        if !e.file_type().map_err(io(&e.path()))?.is_dir() {
            continue;
        }
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        let Some(step) = step_of_dir_name(&name) else {
            continue;
        };
        let dir = e.path();
        let signature = match signature(&dir) {
            Ok(s) => s,
            // Deleted or changed between listing and reading: next scan.
            Err(_) => continue,
        };
        let has = |n: &str| signature.iter().any(|(p, _, _)| p == n);
        let (layout, marked) =
            if has(".metadata") || signature.iter().any(|(p, _, _)| p.ends_with(".distcp")) {
                (RunLayout::Dcp, has(".metadata"))
            } else if name.starts_with("checkpoint-") {
                // Whole (written last, parses), streamed: a long run's
                // log_history passes any fixed size.
                let state_ok = crate::format::is_whole_json(&dir.join("trainer_state.json"));
                (RunLayout::HfTrainer, state_ok)
            } else if name.starts_with("global_step") {
                (
                    RunLayout::DeepSpeed,
                    deepspeed_latest.is_some_and(|l| step <= l),
                )
            } else if name.starts_with("iter_") {
                (
                    RunLayout::Megatron,
                    megatron_latest.is_some_and(|l| step <= l),
                )
            } else {
                (RunLayout::Plain, false)
            };
        let f = Found {
            step,
            dir,
            layout,
            marked,
            signature,
        };
        // Two directories with one step (`step-5` and `checkpoint-5`):
        // the first by name wins, the other waits.
        by_step.entry(step).or_insert(f);
    }
    Ok(by_step.into_values().collect())
}

/// Every regular file under `dir`: relative `/` path, length, mtime; sorted.
fn signature(dir: &Path) -> std::io::Result<Signature> {
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), dir.to_path_buf())];
    while let Some((prefix, d)) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let meta = e.metadata()?;
            if meta.is_dir() {
                stack.push((rel, e.path()));
            } else {
                out.push((rel, meta.len(), meta.modified().ok()));
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of a checkpoint directory that vanishes between the
    /// directory's listing and its hashing (the trainer's rotation
    /// deleting it; here a dangling symlink of the committed file's
    /// length) made `holds_dir` fail, and `watch --keep-local` and the
    /// Trainer callback's prune with it: the directory is simply not held.
    #[test]
    fn holds_dir_of_a_directory_losing_a_file_is_false_not_an_io_error() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("repo");
        let repo = Repository::init(&root, Default::default()).unwrap();
        let d = tmp.path().join("checkpoint-3");
        std::fs::create_dir(&d).unwrap();
        let target = tmp.path().join("gone-0123456789");
        std::fs::write(d.join("model.bin"), vec![7u8; target.as_os_str().len()]).unwrap();
        let id = repo
            .commit(
                &d,
                &CommitOptions {
                    step: Some(3),
                    ..Default::default()
                },
            )
            .unwrap()
            .id;
        assert!(repo.holds_dir(&id, &d).unwrap());
        std::fs::remove_file(d.join("model.bin")).unwrap();
        std::os::unix::fs::symlink(&target, d.join("model.bin")).unwrap();
        assert!(!repo.holds_dir(&id, &d).unwrap());
        std::fs::remove_dir_all(&d).unwrap();
        assert!(!repo.holds_dir(&id, &d).unwrap());
    }

    /// A long HF run's `trainer_state.json` (a `log_history` of ~500k
    /// entries) passes 64 MiB; read with that limit, the checkpoint was
    /// never marked complete.
    #[test]
    fn a_trainer_state_over_64_mib_still_marks_the_checkpoint_complete() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("checkpoint-10");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("model.safetensors"), b"x").unwrap();
        let entry = r#"    {"epoch": 0.0016, "grad_norm": 1.2345678, "learning_rate": 4.9999e-05, "loss": 2.3456, "step": 10},
"#;
        let n = (65 << 20) / entry.len();
        let mut s = String::from("{\"global_step\": 10, \"log_history\": [\n");
        for _ in 0..n {
            s.push_str(entry);
        }
        s.push_str("    {\"step\": 10}\n]}\n");
        std::fs::write(d.join("trainer_state.json"), s).unwrap();
        let found = super::scan(tmp.path()).unwrap();
        assert_eq!(found.len(), 1);
        assert!(
            found[0].marked,
            "a valid trainer_state.json over 64 MiB: never complete"
        );
    }
}
