//! The repository commands: init, commit, log, checkout, branch, show, diff,
//! status.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use ckvc::codec::DType;
use ckvc::format::FileKind;
use ckvc::repo::{
    CheckoutOptions, CommitOptions, CommitReport, Config, DiffReport, ElementDiff, FileStatus,
    RepoError, Repository, RunItem, SegmentShow, ShowReport, Storage, TensorChange,
};

use super::progress::Bars;
use super::{exit, out, out_json, out_json_line, Failure};

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
    /// MiB of chunk data commit and checkout hold in memory at once
    /// (default: the repository's `memory_budget`, 256 MiB; `init` stores it).
    #[arg(
        long = "memory-budget",
        env = "CKVC_MEMORY_BUDGET",
        global = true,
        value_name = "MIB"
    )]
    pub memory_budget: Option<u64>,
}

impl Where {
    pub fn start(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| PathBuf::from("."))
    }
    pub fn open(&self, write: bool) -> Result<Repository, Failure> {
        let mut repo = Repository::discover(&self.start(), write).map_err(fail)?;
        if let Some(mib) = self.memory_budget {
            repo.set_memory_budget(mib << 20).map_err(fail)?;
        }
        Ok(repo)
    }
}

#[derive(Subcommand)]
pub enum RepoCommand {
    /// Create a repository (data in DIR/.ckvc).
    ///
    /// Example: `ckvc init runs/exp1-repo` (or `ckvc init` in the current directory).
    Init {
        /// Where to create it (default: the current directory, or -C DIR);
        /// the data goes into DIR/.ckvc.
        dir: Option<PathBuf>,
        /// Longest delta chain before a chunk is stored full.
        #[arg(long)]
        max_chain: Option<u16>,
        /// Never store a whole chunk as a row frame (root rows and the
        /// other rows against them): optimizer keyframes 4-15% larger,
        /// encoded about 3x and decoded 2x faster.
        #[arg(long)]
        no_row_frames: bool,
        /// Print {"repository": DIR, "config": {...}} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Store a checkpoint directory as a new commit (or, with --run, every
    /// checkpoint directory of a run in step order).
    ///
    /// Examples: `ckvc commit checkpoint-500`; `ckvc commit --run runs/exp1`;
    /// `ckvc commit ckpt --step 500 --metric eval_loss=0.31`.
    Commit {
        /// The checkpoint directory (with --run: the run directory holding
        /// checkpoint-N/, step-N/, ... directories).
        checkpoint: PathBuf,
        /// The training step (default: trainer_state.json's global_step,
        /// else the trailing number of the directory name).
        #[arg(long)]
        step: Option<u64>,
        /// A message to keep with the commit.
        #[arg(short, long, default_value = "")]
        message: String,
        /// Commit on this existing branch instead of the current one.
        #[arg(long)]
        branch: Option<String>,
        /// Create the --branch given, forked from the current branch's head.
        #[arg(long, requires = "branch")]
        new_branch: bool,
        /// Record a metric with the commit (repeatable), e.g. --metric
        /// eval_loss=0.31, for trainers that write no trainer_state.json.
        #[arg(long, value_name = "KEY=VALUE")]
        metric: Vec<String>,
        /// Accept a step that is not after the branch head's step.
        #[arg(long)]
        allow_step_order: bool,
        /// CHECKPOINT is a run directory: commit each of its checkpoint
        /// directories in step order, skipping steps already on the branch.
        #[arg(long, conflicts_with = "step")]
        run: bool,
        /// The training code's directory, for provenance (default: the
        /// current directory's git repository, if any).
        #[arg(long, value_name = "DIR")]
        code: Option<PathBuf>,
        /// Print the commit report as JSON (with --run: one object per
        /// checkpoint, a line each).
        #[arg(long)]
        json: bool,
    },
    /// Show the history of a branch, newest first.
    ///
    /// Examples: `ckvc log`; `ckvc log exp -n 5`; `ckvc log --json`.
    Log {
        /// Branch or revision to start from (default: the current branch).
        rev: Option<String>,
        /// Show at most this many commits.
        #[arg(short = 'n', long)]
        max_count: Option<usize>,
        /// Print the commits as a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Write a commit's checkpoint files into a directory.
    ///
    /// Examples: `ckvc checkout 500 -o resume/` (a step); `ckvc checkout exp -o out/`
    /// (a branch head); `ckvc checkout 3632c89a -o out/ --force` (a commit id);
    /// `ckvc checkout` (HEAD, e.g. right after `ckvc clone`).
    Checkout {
        /// A step, branch, commit id (prefix), HEAD~N or branch@step
        /// (default HEAD: the current branch's newest commit).
        #[arg(default_value = "HEAD")]
        rev: String,
        /// Output directory (default: step-<N>).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Write into a directory that is not empty (files of the commit
        /// replace what is there; other files stay unless --clean).
        #[arg(long)]
        force: bool,
        /// With --force: delete every file the commit does not hold, so OUT
        /// holds exactly this step (says what it removed).
        #[arg(long, requires = "force", conflicts_with = "only")]
        clean: bool,
        /// Only files matching this glob (repeatable).
        #[arg(long)]
        only: Vec<String>,
        /// Create this branch at the revision and make it current.
        #[arg(short = 'b', value_name = "NEW")]
        new_branch: Option<String>,
        /// Print the checkout report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List branches, create one (at HEAD or a revision), or delete one.
    ///
    /// Examples: `ckvc branch`; `ckvc branch exp 120`; `ckvc branch -d exp`.
    Branch {
        /// The branch to create.
        name: Option<String>,
        /// Where the new branch starts (default HEAD).
        rev: Option<String>,
        /// Delete this branch (recoverable through `ckvc reflog` until gc's
        /// grace period passes).
        #[arg(short, long, value_name = "NAME")]
        delete: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List tags, or tag a revision (default HEAD).
    ///
    /// Example: `ckvc tag best main@120`.
    Tag {
        /// The tag to create (tags never move).
        name: Option<String>,
        /// What to tag (default HEAD).
        rev: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// A commit's metadata, files and tensors, and how they are stored.
    ///
    /// Examples: `ckvc show` (HEAD); `ckvc show 300 --json`.
    Show {
        /// A step, branch, commit id (prefix), HEAD~N or branch@step.
        #[arg(default_value = "HEAD")]
        rev: String,
        /// Print the commit, its files and tensors as JSON.
        #[arg(long)]
        json: bool,
    },
    /// What changed between two commits: files, and per tensor how much.
    ///
    /// Example: `ckvc diff 60 300` (steps), `ckvc diff main exp`.
    Diff {
        /// The older revision (step, branch, tag, id prefix, HEAD~N, branch@step).
        rev_a: String,
        /// The newer revision.
        rev_b: String,
        /// Print the files and per-tensor statistics as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The repository, current branch, HEAD step and sizes.
    ///
    /// Example: `ckvc status --json`.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Commit each new complete checkpoint a running job writes into RUN_DIR,
    /// in step order, and keep watching (HF Trainer, DCP, DeepSpeed, Megatron,
    /// or any `step-N/`).
    ///
    /// Example: `ckvc watch runs/exp1 --prune-local 2` keeps the two newest
    /// checkpoints on disk and the whole run in the repository.
    Watch(super::watch::WatchArgs),
}

pub fn fail(e: RepoError) -> Failure {
    let code = if e.is_corruption() {
        exit::CORRUPT
    } else if e.is_busy() {
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
        RepoError::Store(ckvc::store::StoreError::MissingCurrent { .. }) => Some(
            "the store's files are still there: restore .ckvc/db/CURRENT from a backup \
             (it names the newest MANIFEST-* file, e.g. `MANIFEST-000024` plus a newline), \
             or clone the repository again from a remote"
                .to_string(),
        ),
        RepoError::StepOrder { .. } => Some(
            "pass --allow-step-order to commit it anyway (checkout STEP then picks the newest \
             commit with that step), or commit on another branch"
                .to_string(),
        ),
        RepoError::NoSuchBranch { name } => Some(format!(
            "create it first with `ckvc branch {name}`, or pass --new-branch to commit on a new \
             branch forked from the current one; `ckvc branch` lists the branches"
        )),
        RepoError::MissingMetric { metric, .. } => Some(format!(
            "record {metric:?} with `ckvc commit --metric {metric}=VALUE`, or rank by a metric \
             every commit has (`ckvc log --json` shows them)"
        )),
        RepoError::Received(_) => {
            Some("nothing was written to the local repository; the remote copy is damaged".into())
        }
        RepoError::Store(ckvc::store::StoreError::Full { .. }) => {
            Some("free some space on that device and run the command again".to_string())
        }
        _ if e.is_corruption() => {
            Some("`ckvc fsck` lists every damaged object and the commits it affects".to_string())
        }
        _ => None,
    };
    Failure::from_error(code, &e, hint)
}

/// `KEY=VALUE` of `--metric`.
fn parse_metric(m: &str) -> Result<(String, f64), Failure> {
    let bad = || {
        Failure::user(format!(
            "--metric {m:?}: expected KEY=VALUE with a number, e.g. eval_loss=0.31"
        ))
    };
    let (k, v) = m.split_once('=').ok_or_else(bad)?;
    let v: f64 = v.trim().parse().map_err(|_| bad())?;
    if k.trim().is_empty() || !v.is_finite() {
        return Err(bad());
    }
    Ok((k.trim().to_string(), v))
}

/// The line `commit` prints for one commit.
fn commit_line(r: &CommitReport) -> String {
    if r.already_committed {
        return format!(
            "[{} {}] step {}: already committed as {}; nothing new was stored\n",
            r.branch,
            r.id.short(12),
            r.step,
            r.id
        );
    }
    let s = r.stats;
    format!(
        "[{} {}] step {}: {} files, {} logical, {} new stored ({} of {} chunks new), ratio {:.4}; step {}\n",
        r.branch,
        r.id.short(12),
        r.step,
        s.files,
        human(s.logical_bytes),
        human(s.stored_bytes),
        s.new_chunks,
        s.chunks,
        s.stored_bytes as f64 / s.logical_bytes.max(1) as f64,
        r.step_source.describe()
    ) + &format!(
        "  {} as tensors, {} opaque\n",
        human(r.tensor_bytes),
        human(r.opaque_bytes)
    ) + &r
        .large_opaque
        .iter()
        .map(|(p, n)| {
            format!(
                "  note: {p} ({}) was stored as opaque bytes: no tensor was found in it, so no delta \
                 or float coding applies ({})\n",
                human(*n),
                opaque_hint(p)
            )
        })
        .collect::<String>()
}

/// What to do about a large file kept opaque, by its name.
fn opaque_hint(path: &str) -> &'static str {
    let lower = path.to_ascii_lowercase();
    if lower.ends_with(".pt") || lower.ends_with(".pth") || lower.ends_with(".bin") {
        "save it with torch.save's default zip format, or as safetensors"
    } else if lower.ends_with(".distcp") {
        "keep the checkpoint's .metadata beside it; `ckvc show` says why it was not read"
    } else if lower.ends_with(".ckpt") || lower.ends_with(".pkl") || lower.ends_with(".pickle") {
        "save tensors with torch.save (zip format) or safetensors instead of pickle"
    } else {
        "ckvc reads safetensors, torch.save zips, DCP .distcp and .npy files as tensors"
    }
}

pub fn human(bytes: u64) -> String {
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
        RepoCommand::Init {
            dir,
            max_chain,
            no_row_frames,
            json,
        } => {
            // Repository::init makes the directories (a file in the way is
            // bad input).
            let dir = dir.unwrap_or_else(|| w.start());
            let mut config = Config::default();
            if let Some(m) = max_chain {
                config.max_chain = m;
            }
            config.row_frames = !no_row_frames;
            if let Some(mib) = w.memory_budget {
                config.memory_budget = mib << 20;
            }
            let repo = Repository::init(&dir, config).map_err(fail)?;
            if json {
                return out_json(&serde_json::json!({
                    "repository": repo.root(), "config": repo.config(),
                }));
            }
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
            new_branch,
            metric,
            allow_step_order,
            run,
            code,
            json,
        } => {
            let metrics = metric
                .iter()
                .map(|m| parse_metric(m))
                .collect::<Result<Vec<_>, _>>()?;
            let repo = w.open(true)?;
            let opts = CommitOptions {
                step,
                message,
                branch,
                new_branch,
                allow_step_order,
                code,
                metrics,
                // The parent's directory is usually still there to read
                // bases from; where it is not, the smaller deltas win.
                shallow_bases: false,
                pause: None,
            };
            if run {
                let mut failure = None;
                repo.commit_run(&checkpoint, &opts, |item| {
                    if failure.is_some() {
                        return;
                    }
                    let done = if json {
                        out_json_line(item)
                    } else {
                        out(&match item {
                            RunItem::Committed { report, .. } => commit_line(report),
                            RunItem::Skipped { dir, step } => format!(
                                "skipped {} (step {step}): already on the branch\n",
                                dir.display()
                            ),
                        })
                    };
                    if let Err(f) = done {
                        failure = Some(f);
                    }
                })
                .map_err(fail)?;
                return failure.map_or(Ok(()), Err);
            }
            let r = repo
                .commit_with_progress(&checkpoint, &opts, &Bars::bytes())
                .map_err(fail)?;
            if json {
                return out_json(&r);
            }
            out(&commit_line(&r))
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
                            "snapshot": c.stats.max_depth == 0 && c.stats.new_chunks > 0,
                            "new_data": c.stats.new_chunks > 0,
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
                let kind = if c.stats.new_chunks == 0 {
                    "no new data".to_string()
                } else if c.stats.max_depth == 0 {
                    "snapshot".to_string()
                } else {
                    format!("delta depth {} when committed", c.stats.max_depth)
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
            clean,
            only,
            new_branch,
            json,
        } => {
            let repo = w.open(new_branch.is_some())?;
            let id = repo.resolve(&rev).map_err(fail)?;
            if let Ok(step) = rev.parse::<u64>() {
                let branch = repo.current_branch().map_err(fail)?;
                let all = repo.commits_at_step(&branch, step).map_err(fail)?;
                if all.len() > 1 {
                    let others: Vec<String> = all[1..].iter().map(|c| c.short(12)).collect();
                    eprintln!(
                        "note: {} commits of branch {branch} have step {step}; checking out the newest, {} (the others: {})",
                        all.len(),
                        id.short(12),
                        others.join(", ")
                    );
                }
            }
            if let Some(b) = &new_branch {
                repo.create_branch(b, &id).map_err(fail)?;
                repo.switch_branch(b).map_err(fail)?;
            }
            let step = repo.commit_object(&id).map_err(fail)?.step;
            // Gigabytes are read around the page cache.
            let bulk = repo.checkout_reader(&id).map_err(fail)?;
            let repo = bulk.as_ref().unwrap_or(&repo);
            let dest = output.unwrap_or_else(|| Path::new(&format!("step-{step}")).to_path_buf());
            let opts = CheckoutOptions { force, only, clean };
            let r = match repo.checkout_with_progress(&id, &dest, &opts, &Bars::bytes()) {
                Ok(r) => r,
                Err(e) if e.is_corruption() => {
                    let mut f = fail(e);
                    f.hint = Some(match repo.newest_intact_before(&id) {
                        Ok(Some((good, step))) => format!(
                            "the newest intact earlier step is {step} (commit {}): `ckvc checkout {}`; `ckvc fsck` lists all damage",
                            good.short(12),
                            good.short(12)
                        ),
                        Ok(None) => "no earlier commit on this line is intact; `ckvc fsck` lists all damage".into(),
                        Err(e2) => format!("could not look for an intact earlier step: {e2}"),
                    });
                    return Err(f);
                }
                Err(e) => return Err(fail(e)),
            };
            if json {
                return out_json(&r);
            }
            let mut msg = format!(
                "checked out {} (step {}) into {}: {} files, {}\n",
                r.commit.short(12),
                r.step,
                r.out.display(),
                r.files,
                human(r.bytes)
            );
            for p in &r.removed {
                msg.push_str(&format!("removed {p}\n"));
            }
            if let Some(b) = new_branch {
                msg.push_str(&format!("switched to new branch {b}\n"));
            }
            out(&msg)
        }
        RepoCommand::Branch {
            name,
            rev,
            delete,
            json,
        } => {
            if let Some(d) = delete {
                let repo = w.open(true)?;
                let id = repo.delete_branch(&d).map_err(fail)?;
                if json {
                    return out_json(&serde_json::json!({"deleted": d, "was": id}));
                }
                return out(&format!("deleted branch {d} (was {})\n", id.short(12)));
            }
            match name {
                Some(n) => {
                    let repo = w.open(true)?;
                    let id = repo
                        .resolve(rev.as_deref().unwrap_or("HEAD"))
                        .map_err(fail)?;
                    repo.create_branch(&n, &id).map_err(fail)?;
                    if json {
                        return out_json(&serde_json::json!({"created": n, "at": id}));
                    }
                    out(&format!("created branch {n} at {}\n", id.short(12)))
                }
                None => {
                    let repo = w.open(false)?;
                    let cur = repo.current_branch().map_err(fail)?;
                    let mut rows = Vec::new();
                    for (b, id) in repo.branches().map_err(fail)? {
                        let step = repo.commit_object(&id).map_err(fail)?.step;
                        rows.push((b.clone(), id, step, b == cur));
                    }
                    if json {
                        let v: Vec<serde_json::Value> = rows
                            .iter()
                            .map(|(b, id, step, current)| {
                                serde_json::json!({"name": b, "id": id, "step": step, "current": current})
                            })
                            .collect();
                        return out_json(&v);
                    }
                    let mut s = String::new();
                    for (b, id, step, current) in rows {
                        let mark = if current { "*" } else { " " };
                        s.push_str(&format!("{mark} {b:<20} {}  step {step}\n", id.short(12)));
                    }
                    out(&s)
                }
            }
        }
        RepoCommand::Tag { name, rev, json } => match name {
            Some(n) => {
                let repo = w.open(true)?;
                let id = repo
                    .resolve(rev.as_deref().unwrap_or("HEAD"))
                    .map_err(fail)?;
                repo.create_tag(&n, &id).map_err(fail)?;
                if json {
                    return out_json(&serde_json::json!({"tagged": n, "at": id}));
                }
                out(&format!("tagged {} as {n}\n", id.short(12)))
            }
            None => {
                let repo = w.open(false)?;
                let mut rows = Vec::new();
                for (t, id) in repo.tags().map_err(fail)? {
                    let step = repo.commit_object(&id).map_err(fail)?.step;
                    rows.push((t, id, step));
                }
                if json {
                    let v: Vec<serde_json::Value> = rows
                        .iter()
                        .map(|(t, id, step)| serde_json::json!({"name": t, "id": id, "step": step}))
                        .collect();
                    return out_json(&v);
                }
                let mut s = String::new();
                for (t, id, step) in rows {
                    s.push_str(&format!("{t:<20} {}  step {step}\n", id.short(12)));
                }
                out(&s)
            }
        },
        RepoCommand::Show { rev, json } => {
            let repo = w.open(false)?;
            let id = repo.resolve(&rev).map_err(fail)?;
            let r = repo.show(&id).map_err(fail)?;
            let names = param_names(&repo, &[(&id, r.files.iter().map(|f| f.path.as_str()))])?;
            if json {
                out(&(serde_json::to_string_pretty(&show_json(&r, &names)).expect("JSON") + "\n"))
            } else {
                out(&show_text(&r, &names))
            }
        }
        RepoCommand::Diff { rev_a, rev_b, json } => {
            let repo = w.open(false)?;
            let a = repo.resolve(&rev_a).map_err(fail)?;
            let b = repo.resolve(&rev_b).map_err(fail)?;
            let r = repo.diff(&a, &b).map_err(fail)?;
            // Names as `b` records them (`a`'s for files only `a` has).
            let in_b = r.files.iter().filter(|f| f.len_b.is_some());
            let only_a = r.files.iter().filter(|f| f.len_b.is_none());
            let names = param_names(
                &repo,
                &[
                    (
                        &b,
                        in_b.map(|f| f.path.as_str())
                            .collect::<Vec<_>>()
                            .into_iter(),
                    ),
                    (
                        &a,
                        only_a
                            .map(|f| f.path.as_str())
                            .collect::<Vec<_>>()
                            .into_iter(),
                    ),
                ],
            )?;
            if json {
                out(&(serde_json::to_string_pretty(&diff_json(&r, &names)).expect("JSON") + "\n"))
            } else {
                out(&diff_text(&r, &names))
            }
        }
        RepoCommand::Watch(args) => super::watch::run(args, w),
        RepoCommand::Status { json } => {
            let repo = w.open(false)?;
            let st = repo.status().map_err(fail)?;
            if json {
                let mut v = serde_json::to_value(&st).expect("status serialises");
                v["repository"] = serde_json::json!(repo.root());
                return out_json(&v);
            }
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

pub fn time_str(secs: u64) -> String {
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

/// Why a file whose name promises tensors was stored as opaque bytes
/// (no tensor seen, so no delta coding), or `None`.
fn opaque_warning(path: &str, kind: FileKind) -> Option<String> {
    let lower = path.to_ascii_lowercase();
    let ext = lower.rsplit_once('.').map_or("", |(_, e)| e);
    let what = match ext {
        "distcp" => "a distributed-checkpoint file ckvc could not split into torch archives",
        "pt" | "pth" | "bin" => {
            "not a torch.save zip archive (a legacy torch.save pickle, or another format)"
        }
        "npy" => "an npy file ckvc does not read as a tensor",
        _ => return None,
    };
    (kind == FileKind::Opaque)
        .then(|| format!("{what}: stored as opaque bytes, without tensor deltas"))
}

fn kind_name(k: FileKind) -> &'static str {
    match k {
        FileKind::Safetensors => "safetensors",
        FileKind::TorchZip => "torch-zip",
        FileKind::Npy => "npy",
        FileKind::DistCp => "distcp",
        FileKind::TorchLegacy => "torch-legacy",
        _ => "opaque",
    }
}

fn shape_str(shape: &[u64]) -> String {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

fn storage_str(s: &Storage) -> String {
    if s.is_delta() {
        format!("delta d{}", s.max_depth)
    } else {
        "full".to_string()
    }
}

fn storage_json(s: &Storage) -> serde_json::Value {
    serde_json::json!({
        "chunks": s.chunks,
        "stored_as": if s.is_delta() { "delta" } else { "full" },
        "delta_chunks": s.delta_chunks,
        "max_depth": s.max_depth,
        "stored_bytes": s.stored_bytes,
    })
}

/// Optimizer parameter names by file path (index -> name), for the files
/// that record them (`Repository::optimizer_param_names`).
type ParamNames = HashMap<String, BTreeMap<u64, String>>;

fn param_names<'a, I: Iterator<Item = &'a str> + Clone>(
    repo: &ckvc::repo::Repository,
    files: &[(&ckvc::store::CommitId, I)],
) -> Result<ParamNames, Failure> {
    let mut out = ParamNames::new();
    for (commit, paths) in files {
        for p in paths.clone() {
            if let Some(n) = repo.optimizer_param_names(commit, p).map_err(fail)? {
                out.insert(p.to_string(), n);
            }
        }
    }
    Ok(out)
}

/// The parameter an optimizer state tensor `state.<i>.…` of `path` belongs
/// to, when the file records it.
fn param_of<'a>(names: &'a ParamNames, path: &str, tensor: &str) -> Option<&'a str> {
    let rest = tensor.strip_prefix("state.")?;
    let i = rest.split_once('.').map_or(rest, |(i, _)| i);
    names.get(path)?.get(&i.parse().ok()?).map(String::as_str)
}

/// A tensor's name, with its parameter's beside an optimizer index.
fn tensor_label(names: &ParamNames, path: &str, tensor: &str) -> String {
    match param_of(names, path, tensor) {
        Some(p) => format!("{tensor} ({p})"),
        None => tensor.to_string(),
    }
}

fn show_json(r: &ShowReport, names: &ParamNames) -> serde_json::Value {
    let c = &r.commit;
    let files: Vec<serde_json::Value> = r
        .files
        .iter()
        .map(|f| {
            let mut tensors = Vec::new();
            let mut opaque = Vec::new();
            for s in &f.segments {
                match s {
                    SegmentShow::Tensor(t) => {
                        let mut v = serde_json::json!({
                            "name": t.name,
                            "dtype": t.dtype.safetensors_name(),
                            "shape": t.shape,
                            "bytes": t.bytes,
                            "storage": storage_json(&t.storage),
                        });
                        if let Some(p) = param_of(names, &f.path, &t.name) {
                            v["param"] = p.into();
                        }
                        tensors.push(v)
                    }
                    SegmentShow::Opaque { bytes, storage } => opaque.push(serde_json::json!({
                        "bytes": bytes,
                        "storage": storage_json(storage),
                    })),
                }
            }
            serde_json::json!({
                "path": f.path,
                "kind": kind_name(f.kind),
                "warning": opaque_warning(&f.path, f.kind),
                "bytes": f.len,
                "blake3": f.hash_hex(),
                "mode": format!("{:o}", f.mode),
                "storage": storage_json(&f.storage()),
                "tensors": tensors,
                "opaque": opaque,
            })
        })
        .collect();
    serde_json::json!({
        "id": r.id.to_string(),
        "step": c.step,
        "branch": c.branch,
        "parents": c.parents.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        "time": c.time,
        "message": c.message,
        "metrics": c.metrics,
        "code": c.provenance.as_ref().map(|p| serde_json::json!({
            "repo": p.repo, "commit": p.commit, "branch": p.branch, "dirty": p.dirty,
        })),
        "stats": {
            "files": c.stats.files,
            "logical_bytes": c.stats.logical_bytes,
            "stored_bytes": c.stats.stored_bytes,
            "chunks": c.stats.chunks,
            "new_chunks": c.stats.new_chunks,
            "max_depth": c.stats.max_depth,
        },
        "files": files,
    })
}

fn show_text(r: &ShowReport, names: &ParamNames) -> String {
    let c = &r.commit;
    let mut s = format!(
        "commit   {}\nstep     {}\nbranch   {}\n",
        r.id, c.step, c.branch
    );
    let parents: Vec<String> = c.parents.iter().map(|p| p.short(12)).collect();
    s.push_str(&format!(
        "parents  {}\n",
        if parents.is_empty() {
            "(none)".to_string()
        } else {
            parents.join(" ")
        }
    ));
    s.push_str(&format!("date     {} UTC\n", time_str(c.time)));
    if !c.message.is_empty() {
        s.push_str(&format!("message  {}\n", c.message));
    }
    if !c.metrics.is_empty() {
        let m: Vec<String> = c.metrics.iter().map(|(k, v)| format!("{k} {v}")).collect();
        s.push_str(&format!("metrics  {}\n", m.join(", ")));
    }
    if let Some(p) = &c.provenance {
        s.push_str(&format!(
            "code     {} {}{}{}\n",
            p.repo,
            if p.commit.is_empty() {
                "(no commit yet)"
            } else {
                &p.commit
            },
            if p.branch.is_empty() {
                String::new()
            } else {
                format!(" on {}", p.branch)
            },
            if p.dirty {
                " (dirty: uncommitted changes)"
            } else {
                ""
            }
        ));
    }
    let st = &c.stats;
    s.push_str(&format!(
        "stats    {} files, {} logical, {} new stored ({} of {} chunks new), {}\n",
        st.files,
        human(st.logical_bytes),
        human(st.stored_bytes),
        st.new_chunks,
        st.chunks,
        if st.new_chunks == 0 {
            "no new data".to_string()
        } else if st.max_depth == 0 {
            "snapshot".to_string()
        } else {
            format!("delta depth {}", st.max_depth)
        }
    ));
    for f in &r.files {
        let fs = f.storage();
        s.push_str(&format!(
            "\n{}  {}  {}  mode {:o}  stored {} ({})  blake3 {}\n",
            f.path,
            kind_name(f.kind),
            human(f.len),
            f.mode,
            human(fs.stored_bytes),
            storage_str(&fs),
            f.hash_hex()
        ));
        if let Some(w) = opaque_warning(&f.path, f.kind) {
            s.push_str(&format!("  warning: {w}\n"));
        }
        let labels: Vec<String> = f
            .tensors()
            .map(|t| tensor_label(names, &f.path, &t.name))
            .collect();
        let nw = labels.iter().map(String::len).chain([8]).max().unwrap_or(8);
        let mut labels = labels.into_iter();
        let shapes: Vec<String> = f.tensors().map(|t| shape_str(&t.shape)).collect();
        let sw = shapes.iter().map(String::len).chain([5]).max().unwrap_or(5);
        s.push_str(&format!(
            "  {:<nw$}  {:<7}  {:<sw$}  {:>10}  {:>6}  {:<9}  {:>10}\n",
            "segment", "dtype", "shape", "bytes", "chunks", "stored as", "stored"
        ));
        let mut shapes = shapes.into_iter();
        for seg in &f.segments {
            let (name, dtype, shape, bytes, st) = match seg {
                SegmentShow::Tensor(t) => (
                    labels.next().unwrap_or_default(),
                    t.dtype.safetensors_name(),
                    shapes.next().unwrap_or_default(),
                    t.bytes,
                    &t.storage,
                ),
                SegmentShow::Opaque { bytes, storage } => (
                    "(opaque)".to_string(),
                    "-",
                    "-".to_string(),
                    *bytes,
                    storage,
                ),
            };
            s.push_str(&format!(
                "  {:<nw$}  {:<7}  {:<sw$}  {:>10}  {:>6}  {:<9}  {:>10}\n",
                name,
                dtype,
                shape,
                human(bytes),
                st.chunks,
                storage_str(st),
                human(st.stored_bytes)
            ));
        }
    }
    s
}

/// A float for JSON: non-finite values (which JSON cannot hold) as null.
fn num(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x)
        .map(serde_json::Value::Number)
        .unwrap_or(serde_json::Value::Null)
}

fn element_json(d: &ElementDiff) -> serde_json::Value {
    serde_json::json!({
        "elements": d.elements,
        "changed": d.changed,
        "nonfinite": d.nonfinite,
        "fraction_changed": num(d.fraction_changed()),
        "max_abs_diff": num(d.max_abs),
        "mean_abs_diff": num(d.mean_abs),
        "rel_l2": d.rel_l2().map(num),
        "norm_a": num(d.norm_a),
        "norm_diff": num(d.norm_diff),
    })
}

fn diff_json(r: &DiffReport, names: &ParamNames) -> serde_json::Value {
    let files: Vec<serde_json::Value> = r
        .files
        .iter()
        .map(|f| {
            let tensors: Vec<serde_json::Value> = f
                .tensors
                .iter()
                .map(|t| {
                    let mut v = serde_json::json!({
                        "name": t.name,
                        "status": t.change.as_str(),
                    });
                    if let Some(p) = param_of(names, &f.path, &t.name) {
                        v["param"] = p.into();
                    }
                    let o = v.as_object_mut().expect("an object");
                    let mut put = |k: &str, x: serde_json::Value| {
                        o.insert(k.to_string(), x);
                    };
                    match &t.change {
                        TensorChange::Unchanged { dtype, shape }
                        | TensorChange::Added { dtype, shape }
                        | TensorChange::Removed { dtype, shape } => {
                            put("dtype", dtype.safetensors_name().into());
                            put("shape", serde_json::json!(shape));
                        }
                        TensorChange::Changed { dtype, shape, diff } => {
                            put("dtype", dtype.safetensors_name().into());
                            put("shape", serde_json::json!(shape));
                            if let serde_json::Value::Object(m) = element_json(diff) {
                                for (k, x) in m {
                                    put(&k, x);
                                }
                            }
                        }
                        TensorChange::Reshaped {
                            dtype_a,
                            shape_a,
                            dtype_b,
                            shape_b,
                        } => {
                            put("dtype_a", dtype_a.safetensors_name().into());
                            put("shape_a", serde_json::json!(shape_a));
                            put("dtype", dtype_b.safetensors_name().into());
                            put("shape", serde_json::json!(shape_b));
                        }
                    }
                    v
                })
                .collect();
            serde_json::json!({
                "path": f.path,
                "status": f.status.as_str(),
                "kind": kind_name(f.kind),
                "bytes_a": f.len_a,
                "bytes_b": f.len_b,
                "opaque_changed": f.opaque_changed,
                "tensors": tensors,
            })
        })
        .collect();
    serde_json::json!({
        "a": { "id": r.a.to_string(), "step": r.step_a },
        "b": { "id": r.b.to_string(), "step": r.step_b },
        "summary": {
            "added": r.count(FileStatus::Added),
            "removed": r.count(FileStatus::Removed),
            "changed": r.count(FileStatus::Changed),
            "unchanged": r.count(FileStatus::Unchanged),
        },
        "files": files,
    })
}

fn dtype_shape(d: DType, shape: &[u64]) -> String {
    format!("{} {}", d.safetensors_name(), shape_str(shape))
}

fn diff_text(r: &DiffReport, names: &ParamNames) -> String {
    let mut s = format!(
        "diff {} (step {}) -> {} (step {}): {} changed, {} added, {} removed, {} unchanged files\n",
        r.a.short(12),
        r.step_a,
        r.b.short(12),
        r.step_b,
        r.count(FileStatus::Changed),
        r.count(FileStatus::Added),
        r.count(FileStatus::Removed),
        r.count(FileStatus::Unchanged),
    );
    for f in &r.files {
        let mark = match f.status {
            FileStatus::Added => "A",
            FileStatus::Removed => "D",
            FileStatus::Changed => "M",
            FileStatus::Unchanged => "=",
        };
        let size = match (f.len_a, f.len_b) {
            (Some(a), Some(b)) if a == b => human(a),
            (Some(a), Some(b)) => format!("{} -> {}", human(a), human(b)),
            (Some(a), None) => human(a),
            (None, Some(b)) => human(b),
            (None, None) => String::new(),
        };
        let count = |k: &str| f.tensors.iter().filter(|t| t.change.as_str() == k).count();
        let mut line = format!("{mark} {}  {}  {size}", f.path, kind_name(f.kind));
        if !f.tensors.is_empty() {
            line.push_str(&format!("  {} tensors", f.tensors.len()));
            for k in ["changed", "unchanged", "added", "removed", "reshaped"] {
                let n = count(k);
                if n > 0 && !(k == "unchanged" && n == f.tensors.len()) {
                    line.push_str(&format!(", {n} {k}"));
                }
            }
        }
        if f.opaque_changed && !f.tensors.is_empty() {
            line.push_str(", other bytes changed");
        }
        s.push_str(&line);
        s.push('\n');
        let shown: Vec<_> = f
            .tensors
            .iter()
            .filter(|t| !matches!(t.change, TensorChange::Unchanged { .. }))
            .map(|t| (tensor_label(names, &f.path, &t.name), t))
            .collect();
        if shown.is_empty() {
            continue;
        }
        let nw = shown
            .iter()
            .map(|(l, _)| l.len())
            .chain([6])
            .max()
            .unwrap_or(6);
        if shown
            .iter()
            .any(|(_, t)| matches!(t.change, TensorChange::Changed { .. }))
        {
            s.push_str(&format!(
                "    {:<nw$}  {:>8}  {:>10}  {:>10}  {:>10}  {}\n",
                "tensor", "changed", "max |d|", "mean |d|", "rel L2", "dtype shape"
            ));
        }
        for (label, t) in shown {
            match &t.change {
                TensorChange::Changed { dtype, shape, diff } => {
                    let rel = diff
                        .rel_l2()
                        .map(|x| format!("{x:.3e}"))
                        .unwrap_or_else(|| "n/a".into());
                    let nonfinite = if diff.nonfinite > 0 {
                        format!("  ({} non-finite)", diff.nonfinite)
                    } else {
                        String::new()
                    };
                    s.push_str(&format!(
                        "    {:<nw$}  {:>7.2}%  {:>10.3e}  {:>10.3e}  {:>10}  {}{}\n",
                        label,
                        100.0 * diff.fraction_changed(),
                        diff.max_abs,
                        diff.mean_abs,
                        rel,
                        dtype_shape(*dtype, shape),
                        nonfinite
                    ));
                }
                TensorChange::Added { dtype, shape } => s.push_str(&format!(
                    "    {:<nw$}  added {}\n",
                    label,
                    dtype_shape(*dtype, shape)
                )),
                TensorChange::Removed { dtype, shape } => s.push_str(&format!(
                    "    {:<nw$}  removed (was {})\n",
                    label,
                    dtype_shape(*dtype, shape)
                )),
                TensorChange::Reshaped {
                    dtype_a,
                    shape_a,
                    dtype_b,
                    shape_b,
                } => s.push_str(&format!(
                    "    {:<nw$}  {} -> {}\n",
                    label,
                    dtype_shape(*dtype_a, shape_a),
                    dtype_shape(*dtype_b, shape_b)
                )),
                TensorChange::Unchanged { .. } => {}
            }
        }
    }
    s
}
