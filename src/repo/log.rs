//! `log`: the history of a branch, newest first.

use crate::store::CommitId;

use super::objects::Commit;
use super::{RepoError, Repository};

/// One commit as `log` shows it.
#[derive(Debug, Clone)]
pub struct LogEntry {
    pub id: CommitId,
    pub commit: Commit,
}

impl Repository {
    /// Up to `limit` commits on the first-parent line from `from` (a
    /// revision; default the current branch), newest first.
    pub fn log(
        &self,
        from: Option<&str>,
        limit: Option<usize>,
    ) -> Result<Vec<LogEntry>, RepoError> {
        let head = match from {
            Some(rev) => Some(self.resolve(rev)?),
            None => self.branch_head(&self.current_branch()?)?,
        };
        let shallow = self.shallow()?;
        let mut out = Vec::new();
        let mut cur = head;
        while let Some(id) = cur {
            if limit.is_some_and(|l| out.len() >= l) {
                break;
            }
            let commit = self.commit_object(&id)?;
            // A shallow clone's history ends where its parents were left behind.
            cur = commit
                .parents
                .first()
                .copied()
                .filter(|_| !shallow.contains(&id));
            out.push(LogEntry { id, commit });
        }
        Ok(out)
    }
}
