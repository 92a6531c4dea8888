//! The repository commands: init, commit, log, checkout, branch, status.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use ckvc::repo::{CheckoutOptions, CommitOptions, Config, RepoError, Repository};

use super::{exit, out, Failure};

/// Where the repository is: `-C DIR` / `CKVC_DIR`, else the current directory.
#[derive(Args, Clone)]
pub struct Where {
    /// Run as if started in DIR (the repository or a directory inside it).
    #[arg(
        short = 'C',
        long = "dir",
        env = "CKVC_DIR",
        global = true,
        value_name = "DIR"
    )]
    pub dir: Option<PathBuf>,
}

impl Where {
    fn start(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| PathBuf::from("."))
    }
    fn open(&self, write: bool) -> Result<Repository, Failure> {
        Repository::discover(&self.start(), write).map_err(fail)
    }
}

#[derive(Subcommand)]
pub enum RepoCommand {
    /// Create a repository (data in DIR/.ckvc).
    Init {
        dir: Option<PathBuf>,
        /// Longest delta chain before a chunk is stored full.
        #[arg(long)]
        max_chain: Option<u16>,
    },
    /// Store a checkpoint directory as a new commit.
    Commit {
        checkpoint: PathBuf,
        #[arg(long)]
        step: Option<u64>,
        #[arg(short, long, default_value = "")]
        message: String,
        /// Commit on this branch (created if missing) instead of the current one.
        #[arg(long)]
        branch: Option<String>,
        /// The training code's directory, for provenance (default: the
        /// current directory's git repository, if any).
        #[arg(long, value_name = "DIR")]
        code: Option<PathBuf>,
    },
    /// Show the history of a branch, newest first.
    Log {
        /// Branch or revision to start from (default: the current branch).
        rev: Option<String>,
        #[arg(short = 'n', long)]
        max_count: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Write a commit's checkpoint files into a directory.
    Checkout {
        /// A step, branch, commit id (prefix), HEAD~N or branch@step.
        rev: String,
        /// Output directory (default: step-<N>).
        #[arg(short, long)]
        output: Option<PathBuf>,
        #[arg(long)]
        force: bool,
        /// Only files matching this glob (repeatable).
        #[arg(long)]
        only: Vec<String>,
        /// Create this branch at the revision and make it current.
        #[arg(short = 'b', value_name = "NEW")]
        new_branch: Option<String>,
    },
    /// List branches, create one (at HEAD or a revision), or delete one.
    Branch {
        name: Option<String>,
        rev: Option<String>,
        #[arg(short, long, value_name = "NAME")]
        delete: Option<String>,
    },
    /// List tags, or tag a revision (default HEAD).
    Tag {
        name: Option<String>,
        rev: Option<String>,
    },
    /// The repository, current branch, HEAD step and sizes.
    Status,
}

pub fn fail(e: RepoError) -> Failure {
    let code = if e.is_corruption() {
        exit::CORRUPT
    } else if matches!(e, RepoError::Store(ckvc::store::StoreError::Locked { .. })) {
        exit::LOCKED
    } else {
        exit::USER
    };
    let hint = match &e {
        RepoError::NotARepository { .. } => {
            Some("run `ckvc init` first, or pass -C <repo>".to_string())
        }
        RepoError::Store(ckvc::store::StoreError::Locked { .. }) => {
            Some("another ckvc process is writing; wait for it to finish".to_string())
        }
        _ => None,
    };
    Failure {
        code,
        message: e.to_string(),
        hint,
    }
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1 << 20) as f64 {
        format!("{:.1} MiB", b / (1 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

pub fn run(cmd: RepoCommand, w: &Where) -> Result<(), Failure> {
    match cmd {
        RepoCommand::Init { dir, max_chain } => {
            let dir = dir.unwrap_or_else(|| w.start());
            std::fs::create_dir_all(&dir)
                .map_err(|e| Failure::user(format!("{}: {e}", dir.display())))?;
            let mut config = Config::default();
            if let Some(m) = max_chain {
                config.max_chain = m;
            }
            Repository::init(&dir, config).map_err(fail)?;
            out(&format!(
                "initialised an empty ckvc repository in {}\n",
                dir.join(".ckvc").display()
            ))
        }
        RepoCommand::Commit {
            checkpoint,
            step,
            message,
            branch,
            code,
        } => {
            let repo = w.open(true)?;
            let opts = CommitOptions {
                step,
                message,
                branch,
                code,
            };
            let r = repo.commit(&checkpoint, &opts).map_err(fail)?;
            let s = r.stats;
            out(&format!(
                "[{} {}] step {}: {} files, {} logical, {} new stored ({} of {} chunks new), ratio {:.4}\n",
                r.branch,
                r.id.short(12),
                r.step,
                s.files,
                human(s.logical_bytes),
                human(s.stored_bytes),
                s.new_chunks,
                s.chunks,
                s.stored_bytes as f64 / s.logical_bytes.max(1) as f64
            ))
        }
        RepoCommand::Log {
            rev,
            max_count,
            json,
        } => {
            let repo = w.open(false)?;
            let entries = repo.log(rev.as_deref(), max_count).map_err(fail)?;
            if json {
                let rows: Vec<serde_json::Value> = entries
                    .iter()
                    .map(|e| {
                        let c = &e.commit;
                        serde_json::json!({
                            "id": e.id.to_string(),
                            "step": c.step,
                            "time": c.time,
                            "branch": c.branch,
                            "message": c.message,
                            "parents": c.parents.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
                            "metrics": c.metrics,
                            "files": c.stats.files,
                            "logical_bytes": c.stats.logical_bytes,
                            "stored_bytes": c.stats.stored_bytes,
                            "chunks": c.stats.chunks,
                            "new_chunks": c.stats.new_chunks,
                            "snapshot": c.stats.max_depth == 0,
                            "chain_depth": c.stats.max_depth,
                            "code": c.provenance.as_ref().map(|p| serde_json::json!({
                                "repo": p.repo, "commit": p.commit, "branch": p.branch, "dirty": p.dirty,
                            })),
                        })
                    })
                    .collect();
                return out(&(serde_json::to_string_pretty(&rows).expect("JSON") + "\n"));
            }
            let mut s = String::new();
            for e in &entries {
                let c = &e.commit;
                let metric = |k: &str| c.metrics.get(k).and_then(|v| v.as_f64());
                let loss = match (metric("loss"), metric("eval_loss")) {
                    (Some(l), Some(v)) => format!("loss {l:.4} eval {v:.4}"),
                    (Some(l), None) => format!("loss {l:.4}"),
                    (None, Some(v)) => format!("eval {v:.4}"),
                    _ => String::new(),
                };
                let kind = if c.stats.max_depth == 0 {
                    "snapshot".to_string()
                } else {
                    format!("delta depth {}", c.stats.max_depth)
                };
                s.push_str(&format!(
                    "{}  step {:>7}  {}  {} files  {} -> {}  {}  {}  {}\n",
                    e.id.short(12),
                    c.step,
                    time_str(c.time),
                    c.stats.files,
                    human(c.stats.logical_bytes),
                    human(c.stats.stored_bytes),
                    kind,
                    loss,
                    c.message
                ));
            }
            out(&s)
        }
        RepoCommand::Checkout {
            rev,
            output,
            force,
            only,
            new_branch,
        } => {
            let repo = w.open(new_branch.is_some())?;
            let id = repo.resolve(&rev).map_err(fail)?;
            if let Some(b) = &new_branch {
                repo.create_branch(b, &id).map_err(fail)?;
                repo.switch_branch(b).map_err(fail)?;
            }
            let step = repo.commit_object(&id).map_err(fail)?.step;
            let dest = output.unwrap_or_else(|| Path::new(&format!("step-{step}")).to_path_buf());
            let r = repo
                .checkout(&id, &dest, &CheckoutOptions { force, only })
                .map_err(fail)?;
            let mut msg = format!(
                "checked out {} (step {}) into {}: {} files, {}\n",
                r.commit.short(12),
                r.step,
                r.out.display(),
                r.files,
                human(r.bytes)
            );
            if let Some(b) = new_branch {
                msg.push_str(&format!("switched to new branch {b}\n"));
            }
            out(&msg)
        }
        RepoCommand::Branch { name, rev, delete } => {
            if let Some(d) = delete {
                let repo = w.open(true)?;
                let id = repo.delete_branch(&d).map_err(fail)?;
                return out(&format!("deleted branch {d} (was {})\n", id.short(12)));
            }
            match name {
                Some(n) => {
                    let repo = w.open(true)?;
                    let id = repo
                        .resolve(rev.as_deref().unwrap_or("HEAD"))
                        .map_err(fail)?;
                    repo.create_branch(&n, &id).map_err(fail)?;
                    out(&format!("created branch {n} at {}\n", id.short(12)))
                }
                None => {
                    let repo = w.open(false)?;
                    let cur = repo.current_branch().map_err(fail)?;
                    let mut s = String::new();
                    for (b, id) in repo.branches().map_err(fail)? {
                        let step = repo.commit_object(&id).map_err(fail)?.step;
                        let mark = if b == cur { "*" } else { " " };
                        s.push_str(&format!("{mark} {b:<20} {}  step {step}\n", id.short(12)));
                    }
                    out(&s)
                }
            }
        }
        RepoCommand::Tag { name, rev } => match name {
            Some(n) => {
                let repo = w.open(true)?;
                let id = repo
                    .resolve(rev.as_deref().unwrap_or("HEAD"))
                    .map_err(fail)?;
                repo.create_tag(&n, &id).map_err(fail)?;
                out(&format!("tagged {} as {n}\n", id.short(12)))
            }
            None => {
                let repo = w.open(false)?;
                let mut s = String::new();
                for (t, id) in repo.tags().map_err(fail)? {
                    let step = repo.commit_object(&id).map_err(fail)?.step;
                    s.push_str(&format!("{t:<20} {}  step {step}\n", id.short(12)));
                }
                out(&s)
            }
        },
        RepoCommand::Status => {
            let repo = w.open(false)?;
            let st = repo.status().map_err(fail)?;
            let mut s = format!(
                "repository {}\non branch {}\n",
                repo.root().display(),
                st.branch
            );
            match st.head {
                Some((id, step)) => s.push_str(&format!("HEAD {} at step {step}\n", id.short(12))),
                None => s.push_str("no commits yet\n"),
            }
            s.push_str(&format!(
                "{} branches, {} commits reachable; objects: {} commits, {} trees, {} file manifests\n",
                st.branches, st.commits, st.commit_objects, st.trees, st.manifests
            ));
            s.push_str(&format!(
                "checkpoints {} logical, {} stored by their commits, {} on disk ({:.3} of logical)\n",
                human(st.logical_bytes),
                human(st.stored_bytes),
                human(st.disk_bytes),
                st.disk_bytes as f64 / st.logical_bytes.max(1) as f64
            ));
            out(&s)
        }
    }
}

fn time_str(secs: u64) -> String {
    // UTC civil time from days since the epoch (Howard Hinnant's algorithm).
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60
    )
}
