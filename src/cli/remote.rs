//! The shared-storage commands: remote, push, fetch, pull, clone. Progress
//! bars on stderr (hidden when stderr is not a terminal), a summary of
//! logical vs transferred bytes on stdout.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};

use ckvc::remote::config::{self, RemoteConfig};
use ckvc::remote::{self, Remote, RemoteError, S3Options};
use ckvc::repo::Repository;

use super::progress::Bars;
use super::repo::{fail, human, Where};
use super::{exit, out, out_json, Failure};

#[derive(Subcommand)]
pub enum RemoteCommand {
    /// List, add or remove remotes.
    ///
    /// Examples: `ckvc remote add origin s3://bucket/ckpts --endpoint http://host:9000`;
    /// `ckvc remote -v`; `ckvc remote remove origin`.
    Remote(RemoteArgs),
    /// Send a branch's commits the remote lacks, then move its branch
    /// (fast-forward only unless --force).
    ///
    /// Examples: `ckvc push` (the current branch to origin); `ckvc push origin exp`.
    Push {
        /// Remote name (default: origin).
        remote: Option<String>,
        /// Branch (default: the current one).
        branch: Option<String>,
        /// Overwrite the remote branch even when it is not an ancestor of
        /// the local one (its commits are then no longer on that branch).
        #[arg(long)]
        force: bool,
        /// Close a pack at this many bytes (default 64 MiB).
        #[arg(long, hide = true)]
        pack_size: Option<usize>,
        /// Print the push report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Download the remote's branches into refs/remotes/<remote>/.
    ///
    /// Example: `ckvc fetch origin`, then `ckvc log origin/main`.
    Fetch {
        /// Remote name (default: origin).
        remote: Option<String>,
        /// Print the fetch report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Fetch a branch and fast-forward the local one to it.
    ///
    /// Example: `ckvc pull origin main`.
    Pull {
        /// Remote name (default: origin).
        remote: Option<String>,
        /// Branch (default: the current one).
        branch: Option<String>,
        /// Print the pull report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Create a repository from a remote (as origin).
    ///
    /// Examples: `ckvc clone /mnt/shared/ckpts repo/`; `ckvc clone s3://bucket/ckpts
    /// repo/ --depth 1` (only the newest commit of each branch).
    Clone {
        /// A directory path, file:///path, or s3://bucket/prefix.
        url: String,
        /// Directory to create the repository in (must not hold one).
        dir: PathBuf,
        /// Branch to check out (and the only one fetched).
        #[arg(long, short = 'b')]
        branch: Option<String>,
        /// Only the newest N commits (N at least 1), with full snapshots
        /// where delta bases are left behind.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        depth: Option<u64>,
        #[command(flatten)]
        s3: S3Args,
        /// Print the clone report as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub struct RemoteArgs {
    #[command(subcommand)]
    action: Option<RemoteAction>,
    /// Show URLs.
    #[arg(short, long)]
    verbose: bool,
    /// Print the remotes (or the one added or removed) as JSON: name, url
    /// and S3 endpoint/region (never credentials).
    #[arg(long, global = true)]
    json: bool,
}

/// A remote as `remote --json` prints it.
#[derive(serde::Serialize)]
struct NamedRemote<'a> {
    name: &'a str,
    #[serde(flatten)]
    config: &'a RemoteConfig,
}

#[derive(Subcommand)]
enum RemoteAction {
    /// Add a remote: a directory path, file:///path, or s3://bucket/prefix.
    Add {
        /// Name to push and fetch by (e.g. origin).
        name: String,
        /// A directory path, file:///path, or s3://bucket/prefix.
        url: String,
        #[command(flatten)]
        s3: S3Args,
    },
    /// Remove a remote and its remote-tracking refs.
    Remove {
        /// The remote to forget (its data on the remote is untouched).
        name: String,
    },
}

/// S3 settings (credentials come from AWS_ACCESS_KEY_ID /
/// AWS_SECRET_ACCESS_KEY and the other standard AWS variables).
#[derive(Args, Clone)]
pub struct S3Args {
    /// Endpoint of a self-hosted S3-compatible store, e.g. http://host:9000.
    #[arg(long)]
    endpoint: Option<String>,
    /// Region (default: AWS_REGION, else us-east-1).
    #[arg(long)]
    region: Option<String>,
}

impl S3Args {
    fn options(&self) -> S3Options {
        S3Options {
            endpoint: self.endpoint.clone(),
            region: self.region.clone(),
            ..S3Options::default()
        }
    }
}

pub(super) fn rfail(e: RemoteError) -> Failure {
    if let RemoteError::Repo(r) = e {
        return fail(r);
    }
    let code = if e.is_corruption() {
        exit::CORRUPT
    } else if matches!(e, RemoteError::Locked { .. }) {
        exit::LOCKED
    } else {
        exit::USER
    };
    let hint = match &e {
        RemoteError::NonFastForward { .. } => Some(
            "run `ckvc pull` to bring in the remote's commits first, or `ckvc push --force` to overwrite them".into(),
        ),
        RemoteError::Diverged { .. } => Some(
            "both sides have new commits; push your branch under another name, or reset it with `ckvc branch`".into(),
        ),
        RemoteError::NoSuchRemote { .. } => Some("see `ckvc remote -v`".into()),
        RemoteError::Corrupt { .. } => Some(
            "nothing was written to the local repository; the remote copy is damaged".into(),
        ),
        _ => None,
    };
    Failure::from_error(code, &e, hint)
}

pub(super) fn open_named(
    repo: &Repository,
    name: &str,
) -> Result<(RemoteConfig, Box<dyn Remote>), Failure> {
    let cfg = config::remote(repo, name).map_err(rfail)?;
    let r = cfg.open().map_err(rfail)?;
    Ok((cfg, r))
}

fn rate(bytes: u64, t: Instant) -> String {
    let s = t.elapsed().as_secs_f64().max(1e-6);
    format!("{:.1} MiB/s", bytes as f64 / (1 << 20) as f64 / s)
}

pub fn run(cmd: RemoteCommand, w: &Where) -> Result<(), Failure> {
    match cmd {
        RemoteCommand::Remote(args) => match args.action {
            None => {
                let repo = w.open(false)?;
                let remotes = config::remotes(&repo).map_err(rfail)?;
                if args.json {
                    let list: Vec<NamedRemote<'_>> = remotes
                        .iter()
                        .map(|(name, config)| NamedRemote { name, config })
                        .collect();
                    return out_json(&list);
                }
                let mut s = String::new();
                for (name, cfg) in remotes {
                    if args.verbose {
                        let mut extra = String::new();
                        if let Some(e) = &cfg.s3.endpoint {
                            extra.push_str(&format!("  (endpoint {e})"));
                        }
                        s.push_str(&format!("{name}\t{}{extra}\n", cfg.url));
                    } else {
                        s.push_str(&format!("{name}\n"));
                    }
                }
                out(&s)
            }
            Some(RemoteAction::Add { name, url, s3 }) => {
                let repo = w.open(true)?;
                let cfg = config::add_remote(&repo, &name, &url, s3.options()).map_err(rfail)?;
                if args.json {
                    return out_json(&NamedRemote {
                        name: &name,
                        config: &cfg,
                    });
                }
                out(&format!("added remote {name} at {}\n", cfg.url))
            }
            Some(RemoteAction::Remove { name }) => {
                let repo = w.open(true)?;
                config::remove_remote(&repo, &name).map_err(rfail)?;
                if args.json {
                    return out_json(&serde_json::json!({ "removed": name }));
                }
                out(&format!("removed remote {name}\n"))
            }
        },
        RemoteCommand::Push {
            remote: name,
            branch,
            force,
            pack_size,
            json,
        } => {
            let repo = w.open(true)?;
            let name = name.unwrap_or_else(|| "origin".into());
            let (cfg, r) = open_named(&repo, &name)?;
            let mut opts = remote::PushOptions {
                branch,
                force,
                ..Default::default()
            };
            if let Some(p) = pack_size {
                opts.pack_bytes = p.max(1);
            }
            let t = Instant::now();
            let rep = remote::push(&repo, &name, &*r, &opts, &Bars::objects()).map_err(rfail)?;
            if json {
                return out_json(&rep);
            }
            if rep.up_to_date {
                return out(&format!(
                    "{} at {}: {} is up to date\n",
                    rep.branch,
                    cfg.url,
                    rep.new.short(12)
                ));
            }
            let old = rep
                .old
                .map(|o| o.short(12))
                .unwrap_or_else(|| "(new branch)".into());
            out(&format!(
                "pushed {} to {} {}: {} -> {}{}\n{} commits, {} logical; sent {} in {} packs ({} objects, {:.3} of logical, {}); {} objects already there\n",
                rep.branch,
                name,
                cfg.url,
                old,
                rep.new.short(12),
                if rep.forced { " (forced)" } else { "" },
                rep.commits,
                human(rep.logical_bytes),
                human(rep.bytes_sent),
                rep.packs_sent,
                rep.objects_sent,
                rep.bytes_sent as f64 / rep.logical_bytes.max(1) as f64,
                rate(rep.bytes_sent, t),
                rep.objects_present,
            ))
        }
        RemoteCommand::Fetch { remote: name, json } => {
            let repo = w.open(true)?;
            let name = name.unwrap_or_else(|| "origin".into());
            let (cfg, r) = open_named(&repo, &name)?;
            let t = Instant::now();
            let rep = remote::fetch(&repo, &name, &*r, &Default::default(), &Bars::objects())
                .map_err(rfail)?;
            if json {
                return out_json(&rep);
            }
            let mut s = fetch_summary(&name, &cfg.url, &rep, t);
            if rep.updated.is_empty() {
                s.push_str("already up to date\n");
            }
            out(&s)
        }
        RemoteCommand::Pull {
            remote: name,
            branch,
            json,
        } => {
            let repo = w.open(true)?;
            let name = name.unwrap_or_else(|| "origin".into());
            let (cfg, r) = open_named(&repo, &name)?;
            let t = Instant::now();
            let rep = remote::pull(&repo, &name, &*r, branch.as_deref(), &Bars::objects())
                .map_err(rfail)?;
            if json {
                return out_json(&rep);
            }
            let mut s = fetch_summary(&name, &cfg.url, &rep.fetch, t);
            if rep.up_to_date {
                s.push_str(&format!("{} is up to date\n", rep.branch));
            } else {
                s.push_str(&format!(
                    "fast-forwarded {}: {} -> {}\n",
                    rep.branch,
                    rep.old
                        .map(|o| o.short(12))
                        .unwrap_or_else(|| "(new)".into()),
                    rep.new.map(|o| o.short(12)).unwrap_or_default()
                ));
            }
            out(&s)
        }
        RemoteCommand::Clone {
            url,
            dir,
            branch,
            depth,
            s3,
            json,
        } => {
            let opts = remote::CloneOptions {
                branch,
                depth: depth.map(|d| usize::try_from(d).unwrap_or(usize::MAX)),
                s3: s3.options(),
                config: Default::default(),
            };
            let t = Instant::now();
            let (repo, rep) = remote::clone(&url, &dir, &opts, &Bars::objects()).map_err(rfail)?;
            if json {
                let mut v = serde_json::to_value(&rep).expect("clone report serialises");
                v["repository"] = serde_json::json!(repo.root());
                return out_json(&v);
            }
            let mut s = fetch_summary("origin", &url, &rep.fetch, t);
            match (&rep.branch, &rep.head) {
                (Some(b), Some(h)) => s.push_str(&format!(
                    "cloned into {}: branch {b} at {}{}\n",
                    repo.root().display(),
                    h.short(12),
                    if rep.fetch.shallow.is_empty() {
                        String::new()
                    } else {
                        " (shallow)".into()
                    }
                )),
                _ => s.push_str(&format!(
                    "cloned an empty remote into {}\n",
                    repo.root().display()
                )),
            }
            out(&s)
        }
    }
}

fn fetch_summary(name: &str, url: &str, rep: &remote::FetchReport, t: Instant) -> String {
    let mut s = String::new();
    for u in &rep.updated {
        s.push_str(&format!(
            "{name}/{}: {} -> {}\n",
            u.branch,
            u.old.map(|o| o.short(12)).unwrap_or_else(|| "(new)".into()),
            u.new.short(12)
        ));
    }
    if rep.commits > 0 {
        s.push_str(&format!(
            "from {url}: {} commits, {} logical; received {} in {} packs ({:.3} of logical, {}), {} objects stored",
            rep.commits,
            human(rep.logical_bytes),
            human(rep.bytes_received),
            rep.packs,
            rep.bytes_received as f64 / rep.logical_bytes.max(1) as f64,
            rate(rep.bytes_received, t),
            rep.objects,
        ));
        if rep.reencoded > 0 {
            s.push_str(&format!(", {} chunks made full snapshots", rep.reencoded));
        }
        s.push('\n');
    }
    s
}
