//! `branch` and `tag`: create, list, delete and switch branches; name
//! commits with tags.

use std::collections::{HashSet, VecDeque};

use crate::store::{Batch, CommitId, Space};

use super::{branch_ref, check_branch_name, RepoError, Repository, HEAD, HEADS, TAGS};

impl Repository {
    /// Create branch `name` at `at`.
    pub fn create_branch(&self, name: &str, at: &CommitId) -> Result<(), RepoError> {
        check_branch_name(name)?;
        self.commit_object(at)?;
        let mut b = Batch::new();
        self.move_ref(&mut b, &branch_ref(name), None, Some(at), "branch");
        self.store.write(b).map_err(|e| match e {
            crate::store::StoreError::Conflict { .. } => {
                RepoError::BranchExists { name: name.into() }
            }
            e => e.into(),
        })?;
        self.store.flush()?;
        Ok(())
    }

    /// Move branch `name` from `old` (`None`: create it) to `new`, if it is
    /// still at `old` (a store conflict otherwise); logged as `op`, durable.
    /// `new` must be stored: pull and clone move a branch to a commit they
    /// fetched.
    pub fn move_branch(
        &self,
        name: &str,
        old: Option<&CommitId>,
        new: &CommitId,
        op: &str,
    ) -> Result<(), RepoError> {
        check_branch_name(name)?;
        let mut b = Batch::new();
        self.move_ref(&mut b, &branch_ref(name), old, Some(new), op);
        self.store.write(b)?;
        self.store.flush()?;
        Ok(())
    }

    /// Whether `a` is `b` or an ancestor of `b` (walking every parent,
    /// stopping at a shallow clone's boundary): moving a ref from `a` to
    /// `b` is then a fast-forward.
    pub fn is_ancestor(&self, a: &CommitId, b: &CommitId) -> Result<bool, RepoError> {
        let shallow = self.shallow()?;
        let mut seen = HashSet::new();
        let mut queue = VecDeque::from([*b]);
        while let Some(c) = queue.pop_front() {
            if c == *a {
                return Ok(true);
            }
            if !seen.insert(c) || shallow.contains(&c) {
                continue;
            }
            queue.extend(self.commit_object(&c)?.parents);
        }
        Ok(false)
    }

    /// Delete branch `name` (not the current one). Its commits stay until gc.
    pub fn delete_branch(&self, name: &str) -> Result<CommitId, RepoError> {
        if self.current_branch()? == name {
            return Err(RepoError::CurrentBranch { name: name.into() });
        }
        let head = self
            .branch_head(name)?
            .ok_or(RepoError::NoSuchBranch { name: name.into() })?;
        let mut b = Batch::new();
        self.move_ref(&mut b, &branch_ref(name), Some(&head), None, "branch -d");
        self.store.write(b)?;
        self.store.flush()?;
        Ok(head)
    }

    /// Make `name` the current branch (it must exist, or be the current
    /// unborn branch).
    pub fn switch_branch(&self, name: &str) -> Result<(), RepoError> {
        check_branch_name(name)?;
        if self.branch_head(name)?.is_none() && self.current_branch()? != name {
            return Err(RepoError::NoSuchBranch { name: name.into() });
        }
        let mut b = Batch::new();
        b.put(
            Space::Refs,
            HEAD,
            format!("ref: {HEADS}{name}").into_bytes(),
        );
        self.store.write(b)?;
        self.store.flush()?;
        Ok(())
    }

    /// Tag `at` as `name` (tags never move; names follow the branch rules).
    pub fn create_tag(&self, name: &str, at: &CommitId) -> Result<(), RepoError> {
        check_branch_name(name)?;
        self.commit_object(at)?;
        let mut b = Batch::new();
        self.move_ref(&mut b, &format!("{TAGS}{name}"), None, Some(at), "tag");
        self.store.write(b).map_err(|e| match e {
            crate::store::StoreError::Conflict { .. } => RepoError::TagExists { name: name.into() },
            e => e.into(),
        })?;
        self.store.flush()?;
        Ok(())
    }

    /// The commit a tag names.
    pub fn tag(&self, name: &str) -> Result<Option<CommitId>, RepoError> {
        self.ref_target(TAGS, name)
    }

    /// Every tag with its commit, sorted by name.
    pub fn tags(&self) -> Result<Vec<(String, CommitId)>, RepoError> {
        self.refs_under(TAGS)
    }
}
