//! `status`: where the repository stands.

use std::collections::HashSet;

use crate::store::{CommitId, Space};

use super::{objects, RepoError, Repository, DOT_DIR};

/// The repository at a glance.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    pub branch: String,
    /// `HEAD`'s commit and step, if the branch has commits.
    pub head: Option<(CommitId, u64)>,
    pub branches: usize,
    /// Commits reachable from any branch.
    pub commits: usize,
    /// Stored objects by kind.
    pub manifests: usize,
    pub trees: usize,
    pub commit_objects: usize,
    /// Sum of the checkpoint sizes of the reachable commits.
    pub logical_bytes: u64,
    /// Sum of what those commits added to the store.
    pub stored_bytes: u64,
    /// Bytes of the repository directory on disk (`.ckvc`).
    pub disk_bytes: u64,
}

impl Repository {
    pub fn status(&self) -> Result<Status, RepoError> {
        let branch = self.current_branch()?;
        let head = match self.branch_head(&branch)? {
            Some(id) => Some((id, self.commit_object(&id)?.step)),
            None => None,
        };
        let branches = self.branches()?;
        let mut seen = HashSet::new();
        let (mut logical_bytes, mut stored_bytes) = (0u64, 0u64);
        // A shallow clone's history ends at its boundary commits, whose
        // parents were never fetched.
        let shallow = self.shallow()?;
        let mut todo: Vec<CommitId> = branches.iter().map(|b| b.1).collect();
        while let Some(id) = todo.pop() {
            if !seen.insert(id) {
                continue;
            }
            let c = self.commit_object(&id)?;
            logical_bytes = logical_bytes.saturating_add(c.stats.logical_bytes);
            stored_bytes = stored_bytes.saturating_add(c.stats.stored_bytes);
            if !shallow.contains(&id) {
                todo.extend(c.parents);
            }
        }
        let (mut manifests, mut trees, mut commit_objects) = (0, 0, 0);
        self.store.scan_prefix(Space::Objects, b"", &mut |k, _| {
            match k.first() {
                Some(&objects::KIND_MANIFEST) => manifests += 1,
                Some(&objects::KIND_TREE) => trees += 1,
                Some(&objects::KIND_COMMIT) => commit_objects += 1,
                _ => {}
            }
            Ok(true)
        })?;
        Ok(Status {
            branch,
            head,
            branches: branches.len(),
            commits: seen.len(),
            manifests,
            trees,
            commit_objects,
            logical_bytes,
            stored_bytes,
            disk_bytes: dir_size(&self.root.join(DOT_DIR)),
        })
    }
}

/// Total size of the files under `dir` (0 where unreadable).
pub fn dir_size(dir: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(|e| e.ok())
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
