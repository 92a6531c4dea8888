//! Provenance: which training code produced a checkpoint, read from the git
//! repository around it with git2 (read-only; nothing is run). Built with
//! the `git` feature (default); without it no commit records provenance.

use std::path::Path;

/// The training code's git state at commit time.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct Provenance {
    /// Work tree of the code repository.
    pub repo: String,
    /// Commit id (hex) of the code's `HEAD`; empty for an unborn branch.
    pub commit: String,
    /// Branch name, or empty for a detached `HEAD`.
    pub branch: String,
    /// Uncommitted changes to tracked files (untracked files do not count).
    pub dirty: bool,
}

/// The git state of the repository containing `dir`, or `None` when `dir`
/// is not inside a git repository (or git2 cannot read it: provenance is
/// best effort and never fails a commit). Always `None` without the `git`
/// feature.
#[cfg(feature = "git")]
pub fn git_provenance(dir: &Path) -> Option<Provenance> {
    let repo = git2::Repository::discover(dir).ok()?;
    let root = repo
        .workdir()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| repo.path().display().to_string());
    let (commit, branch) = match repo.head() {
        Ok(head) => (
            head.peel_to_commit()
                .map(|c| c.id().to_string())
                .unwrap_or_default(),
            if head.is_branch() {
                head.shorthand().unwrap_or_default().to_string()
            } else {
                String::new()
            },
        ),
        Err(_) => (String::new(), String::new()),
    };
    let mut opts = git2::StatusOptions::new();
    opts.include_untracked(false).include_ignored(false);
    let dirty = repo
        .statuses(Some(&mut opts))
        .map(|s| s.iter().any(|e| e.status() != git2::Status::CURRENT))
        .unwrap_or(false);
    Some(Provenance {
        repo: root,
        commit,
        branch,
        dirty,
    })
}

/// Without the `git` feature no provenance is read.
#[cfg(not(feature = "git"))]
pub fn git_provenance(_dir: &Path) -> Option<Provenance> {
    None
}
