//! `pull`: a fetch of one branch, then a fast-forward of the local branch
//! to it (a diverged branch is an error and changes nothing).

use crate::repo::{check_branch_name, Repository};
use crate::store::CommitId;

use super::fetch::{fetch, FetchOptions, FetchReport};
use super::{Progress, Remote, RemoteError};

/// What a pull did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PullReport {
    pub fetch: FetchReport,
    pub branch: String,
    pub old: Option<CommitId>,
    pub new: Option<CommitId>,
    /// The local branch already had (or was ahead of) the remote's.
    pub up_to_date: bool,
}

/// Fetch `branch` (default: the current branch) and fast-forward the local
/// branch to it; a diverged branch is an error and changes nothing.
pub fn pull(
    repo: &Repository,
    remote_name: &str,
    remote: &dyn Remote,
    branch: Option<&str>,
    progress: &dyn Progress,
) -> Result<PullReport, RemoteError> {
    let branch = match branch {
        Some(b) => b.to_string(),
        None => repo.current_branch()?,
    };
    check_branch_name(&branch)?;
    let fetch_report = fetch(
        repo,
        remote_name,
        remote,
        &FetchOptions {
            branches: Some(vec![branch.clone()]),
            depth: None,
        },
        progress,
    )?;
    let theirs =
        repo.remote_ref(remote_name, &branch)?
            .ok_or_else(|| RemoteError::NoSuchRemoteBranch {
                branch: branch.clone(),
            })?;
    let ours = repo.branch_head(&branch)?;
    let mut report = PullReport {
        fetch: fetch_report,
        branch: branch.clone(),
        old: ours,
        new: ours,
        up_to_date: false,
    };
    match ours {
        Some(o) if o == theirs || repo.is_ancestor(&theirs, &o)? => {
            report.up_to_date = true;
            return Ok(report);
        }
        Some(o) if !repo.is_ancestor(&o, &theirs)? => {
            return Err(RemoteError::Diverged {
                branch,
                local: o,
                remote: theirs,
            });
        }
        _ => {}
    }
    repo.move_branch(&branch, ours.as_ref(), &theirs, "pull")?;
    report.new = Some(theirs);
    Ok(report)
}
