//! Maintenance commands: gc, fsck, reflog.

use clap::Subcommand;

use ckvc::remote::{RemoteGcOptions, RemoteGcReport};
use ckvc::repo::{GcOptions, GcReport, KeepPolicy, RepoCounts};

use super::repo::{fail, human, time_str, Where};
use super::{exit, out, out_json, Failure};

#[derive(Subcommand)]
pub enum MaintCommand {
    /// Delete what no ref, tag or recent ref-log entry reaches; with
    /// --compact bound delta chains; with --keep drop commits by policy.
    ///
    /// Examples: `ckvc gc --dry-run --keep last=3 --keep every=1000 --keep best=2:eval_loss`;
    /// `ckvc gc --compact`; `ckvc gc --remote origin --grace 7d`.
    Gc {
        /// Rewrite delta chains so no chunk needs more than the
        /// repository's `compact_chain` delta steps to decode.
        #[arg(long)]
        compact: bool,
        /// Longest chain --compact leaves (default: the repository setting).
        #[arg(long, value_name = "N", requires = "compact")]
        chain: Option<u16>,
        /// Retention: last=N, every=K (steps), best=N[:metric[:min|max]]
        /// (default metric eval_loss), within=30d; comma-separated or
        /// repeated; a commit any rule keeps is kept; branch heads always are.
        #[arg(long, value_name = "POLICY")]
        keep: Vec<String>,
        /// Print what would be removed or rewritten; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Spare unreferenced chunks and ref-log entries younger than this
        /// (30d, 12h, 90m, 0s; default 1h). With --remote: delete a pack
        /// only when a gc this long ago already found it unreachable
        /// (default 7d), so a push running meanwhile loses nothing.
        #[arg(long, value_name = "DURATION")]
        grace: Option<String>,
        /// Collect the packs of this remote (a name from `ckvc remote -v`)
        /// that none of its branches needs, instead of the local store.
        #[arg(long, value_name = "NAME", conflicts_with_all = ["compact", "keep"])]
        remote: Option<String>,
        /// Print the gc report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Prove the repository whole: every object reachable from every ref is
    /// present and every file reassembles to its hash. Exit 3 if damaged.
    ///
    /// Examples: `ckvc fsck`; `ckvc fsck --json` (each damaged object, where it
    /// is used and why, as fields).
    Fsck {
        /// Check presence and headers only, do not decode.
        #[arg(long)]
        quick: bool,
        /// Print the report (counts and every damaged file with its
        /// commits) as JSON; the exit code still says whether it is whole.
        #[arg(long)]
        json: bool,
    },
    /// What moved branches and tags, newest first.
    ///
    /// Example: `ckvc reflog main`.
    Reflog {
        /// A branch or tag (default: every ref).
        name: Option<String>,
        /// Show at most this many entries.
        #[arg(short = 'n', long)]
        max_count: Option<usize>,
        /// Print the entries as a JSON array.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: MaintCommand, w: &Where) -> Result<(), Failure> {
    match cmd {
        MaintCommand::Gc {
            compact,
            chain,
            keep,
            dry_run,
            grace,
            remote,
            json,
        } => {
            if let Some(name) = remote {
                let grace_secs = ckvc::repo::parse_duration(grace.as_deref().unwrap_or("7d"))
                    .map_err(|e| Failure::user(format!("--grace: {e}")))?;
                let repo = w.open(false)?;
                let (_, r) = super::remote::open_named(&repo, &name)?;
                let report = ckvc::remote::gc_remote(
                    r.as_ref(),
                    &RemoteGcOptions {
                        dry_run,
                        grace_secs,
                        now: ckvc_now(),
                    },
                )
                .map_err(super::remote::rfail)?;
                if json {
                    return out_json(&report);
                }
                return out(&remote_gc_text(&name, &report));
            }
            let grace = grace.unwrap_or_else(|| "1h".into());
            let keep = if keep.is_empty() {
                None
            } else {
                Some(KeepPolicy::parse(&keep).map_err(Failure::user)?)
            };
            let grace_secs = ckvc::repo::parse_duration(&grace)
                .map_err(|e| Failure::user(format!("--grace: {e}")))?;
            let repo = w.open(true)?;
            let r = repo
                .gc(&GcOptions {
                    compact,
                    keep,
                    dry_run,
                    grace_secs,
                    compact_chain: chain,
                })
                .map_err(fail)?;
            if json {
                return out_json(&r);
            }
            out(&gc_text(&r))
        }
        MaintCommand::Fsck { quick, json } => {
            let repo = w.open(false)?;
            let r = repo.fsck(quick).map_err(fail)?;
            if json {
                out_json(&r)?;
                return if r.is_clean() {
                    Ok(())
                } else {
                    Err(Failure {
                        code: exit::CORRUPT,
                        message: format!("{} problems found", r.damage.len()),
                        causes: Vec::new(),
                        hint: None,
                    })
                };
            }
            let mut s = format!(
                "checked {} commits, {} files, {} chunks{}\n",
                r.commits,
                r.manifests,
                r.chunks,
                if quick {
                    " (quick: presence and headers)".to_string()
                } else {
                    format!(", {} reassembled and verified", human(r.verified_bytes))
                }
            );
            for d in &r.damage {
                s.push_str(&format!("damaged: {}\n", d.error));
                if !d.commits.is_empty() {
                    let list: Vec<String> = d
                        .commits
                        .iter()
                        .map(|(c, step)| format!("{} (step {step})", c.short(12)))
                        .collect();
                    s.push_str(&format!("  in commits: {}\n", list.join(", ")));
                }
            }
            out(&s)?;
            if r.is_clean() {
                out("repository is whole\n")
            } else {
                Err(Failure {
                    code: exit::CORRUPT,
                    message: format!("{} problems found", r.damage.len()),
                    causes: Vec::new(),
                    hint: Some(
                        "checkout of an intact step still works; a damaged chunk shared by \
                         later steps damages them too"
                            .into(),
                    ),
                })
            }
        }
        MaintCommand::Reflog {
            name,
            max_count,
            json,
        } => {
            let repo = w.open(false)?;
            let mut entries = repo.reflog(name.as_deref()).map_err(fail)?;
            entries.truncate(max_count.unwrap_or(usize::MAX));
            if json {
                return out_json(&entries);
            }
            let mut s = String::new();
            for e in &entries {
                let id = |c: &Option<ckvc::store::CommitId>| {
                    c.map_or("(none)".to_string(), |c| c.short(12))
                };
                s.push_str(&format!(
                    "{} {:<22} {} -> {}  {}\n",
                    time_str(e.time),
                    e.refname,
                    id(&e.old),
                    id(&e.new),
                    e.op
                ));
            }
            out(&s)
        }
    }
}

fn ckvc_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn remote_gc_text(name: &str, r: &RemoteGcReport) -> String {
    let mut s = String::new();
    if r.dry_run {
        s.push_str("dry run: nothing was changed\n");
    }
    for p in &r.deleted {
        s.push_str(&format!(
            "{} pack {}\n",
            if r.dry_run { "would delete" } else { "deleted" },
            p.short(16)
        ));
    }
    s.push_str(&format!(
        "remote {name}: {} branches; {} packs reachable, {} unreachable kept for their grace period, {} {}\n",
        r.branches,
        r.reachable_packs,
        r.pending_packs,
        r.deleted.len(),
        if r.dry_run { "to delete" } else { "deleted" }
    ));
    s.push_str(&format!(
        "before  {:>10} in {} packs\nafter   {:>10} in {} packs\n",
        human(r.bytes_before),
        r.packs_before,
        human(r.bytes_after),
        r.packs_after
    ));
    s
}

fn counts_line(label: &str, c: &RepoCounts) -> String {
    format!(
        "{label:<7} {:>10} on disk, {:>5} commits, {:>6} chunks, longest chain {}\n",
        human(c.disk_bytes),
        c.commits,
        c.chunks,
        c.longest_chain
    )
}

fn gc_text(r: &GcReport) -> String {
    let mut s = String::new();
    if r.dry_run {
        s.push_str("dry run: nothing was changed\n");
    }
    for d in &r.dropped {
        s.push_str(&format!(
            "{} {} (step {}) from {}\n",
            if r.dry_run { "would drop" } else { "dropped" },
            d.commit.short(12),
            d.step,
            d.branch
        ));
    }
    for (b, old, new) in &r.moved {
        s.push_str(&format!(
            "branch {b}: {} -> {} ({} commits re-parented in all)\n",
            old.short(12),
            new.short(12),
            r.rewritten_commits
        ));
    }
    let verb = if r.dry_run { "would " } else { "" };
    s.push_str(&format!(
        "{verb}rewrite {} chunks as full snapshots, rebase {}, relabel {}\n",
        r.keyframes, r.rebased, r.relabelled
    ));
    s.push_str(&format!(
        "{verb}delete {} chunks and {} objects ({}); {} young unreferenced chunks spared\n",
        r.deleted_chunks,
        r.deleted_objects,
        human(r.freed_bytes),
        r.spared_chunks
    ));
    s.push_str(&counts_line("before", &r.before));
    if !r.dry_run {
        s.push_str(&counts_line("after", &r.after));
    }
    s
}
