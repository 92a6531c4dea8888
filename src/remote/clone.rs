//! `clone`: a new repository from a remote: init, the remote added as
//! `origin`, a fetch (shallow with a depth), and the chosen branch created
//! and checked out as the current one. On failure nothing is left behind.

use std::fs;
use std::path::Path;

use crate::repo::{Config, RepoError, Repository, DOT_DIR};
use crate::store::CommitId;

use super::config::add_remote;
use super::fetch::{fetch, FetchOptions, FetchReport};
use super::layout::check_layout;
use super::{open_url, Progress, Remote, RemoteError, S3Options};

/// How to clone.
#[derive(Debug, Clone, Default)]
pub struct CloneOptions {
    /// The branch to check out (default `main` if the remote has it, else
    /// its first branch). Only this branch is fetched when given.
    pub branch: Option<String>,
    /// Only the newest `n` commits (shallow; `Some(0)` is taken as 1).
    pub depth: Option<usize>,
    pub s3: S3Options,
    pub config: Config,
}

/// What a clone did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CloneReport {
    pub fetch: FetchReport,
    /// The local branch created (`None`: the remote has no branches).
    pub branch: Option<String>,
    pub head: Option<CommitId>,
}

/// Create a repository in `dir` (absent or empty) from the remote at
/// `url`, with the remote as `origin`. On failure nothing is left behind.
pub fn clone(
    url: &str,
    dir: &Path,
    opts: &CloneOptions,
    progress: &dyn Progress,
) -> Result<(Repository, CloneReport), RemoteError> {
    let remote = open_url(url, &opts.s3)?;
    check_layout(&*remote, false)?;
    let existed = dir.exists();
    if existed
        && fs::read_dir(dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(RepoError::OutputNotEmpty {
            path: dir.to_path_buf(),
        }
        .into());
    }
    fs::create_dir_all(dir).map_err(|source| RemoteError::Io {
        what: dir.display().to_string(),
        source,
    })?;
    let result = clone_into(url, dir, &*remote, opts, progress);
    if result.is_err() {
        if existed {
            let _ = fs::remove_dir_all(dir.join(DOT_DIR));
        } else {
            let _ = fs::remove_dir_all(dir);
        }
    }
    result
}

fn clone_into(
    url: &str,
    dir: &Path,
    remote: &dyn Remote,
    opts: &CloneOptions,
    progress: &dyn Progress,
) -> Result<(Repository, CloneReport), RemoteError> {
    let repo = Repository::init(dir, opts.config.clone())?;
    add_remote(&repo, "origin", url, opts.s3.clone())?;
    let fetch_report = fetch(
        &repo,
        "origin",
        remote,
        &FetchOptions {
            branches: opts.branch.clone().map(|b| vec![b]),
            depth: opts.depth,
        },
        progress,
    )?;
    let tracking = repo.remote_refs("origin")?;
    let pick = match &opts.branch {
        Some(b) => tracking.iter().find(|(n, _)| n == b),
        None => tracking
            .iter()
            .find(|(n, _)| n == "main")
            .or_else(|| tracking.first()),
    };
    let mut report = CloneReport {
        fetch: fetch_report,
        branch: None,
        head: None,
    };
    if let Some((b, id)) = pick.cloned() {
        repo.move_branch(&b, None, &id, "clone")?;
        repo.switch_branch(&b)?;
        report.branch = Some(b);
        report.head = Some(id);
    }
    Ok((repo, report))
}
