//! `commit_buffers`: store files held in memory as a new commit, for
//! callers that build a checkpoint without writing it to disk (the Python
//! package's `save`).
//!
//! The bytes go through the same pipeline as [`Repository::commit`]: the
//! format layer sees every tensor, new chunks are coded against the same
//! tensor of the branch head, and the objects and the branch move are one
//! final atomic batch. What a directory commit derives from its directory
//! is not there: the step must be given, metrics come only from
//! [`CommitOptions::metrics`], and no `Meta/commit-source` is recorded (the
//! next commit decodes its delta bases from the store).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::format::DirContext;

use super::commit::{add_metrics, Source};
use super::objects::check_path;
use super::{CommitOptions, CommitReport, RepoError, Repository, StepSource};

/// The name errors about in-memory files carry as their path.
const IN_MEMORY: &str = "<in-memory checkpoint>";

impl Repository {
    /// Commit the files `files` (relative `/` paths and their bytes) as one
    /// checkpoint at step `opts.step`, which is required (`None` is
    /// [`RepoError::BadInput`]). The step order, branch and
    /// already-committed rules are those of [`Repository::commit`]; paths
    /// must be valid committed paths and distinct. Files get mode `0o644`.
    pub fn commit_buffers(
        &self,
        files: &[(&str, &[u8])],
        opts: &CommitOptions,
    ) -> Result<CommitReport, RepoError> {
        let here = || PathBuf::from(IN_MEMORY);
        let step = opts.step.ok_or_else(|| RepoError::BadInput {
            path: here(),
            reason: "a commit from memory needs a step".into(),
        })?;
        let mut seen = HashSet::new();
        for (rel, _) in files {
            check_path(rel).map_err(|reason| RepoError::BadInput {
                path: PathBuf::from(rel),
                reason,
            })?;
            if !seen.insert(*rel) {
                return Err(RepoError::BadInput {
                    path: PathBuf::from(rel),
                    reason: "the same path is given twice".into(),
                });
            }
        }
        let target = self.commit_target(opts)?;
        let mut metrics = serde_json::Map::new();
        add_metrics(&mut metrics, &opts.metrics, Path::new(IN_MEMORY))?;
        let mut sources: Vec<(String, Source<'_>)> = files
            .iter()
            .map(|(rel, bytes)| (rel.to_string(), Source::Bytes(bytes)))
            .collect();
        // Trees list their files sorted, as a directory commit sees them.
        sources.sort_by(|a, b| a.0.cmp(&b.0));
        self.commit_sources(
            target,
            &sources,
            &DirContext::default(),
            (step, StepSource::Given),
            metrics,
            opts,
            None,
        )
    }
}

