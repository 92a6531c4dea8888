//! `commit_buffers` / `commit_parts`: store files held in memory as a new commit, for
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

use super::commit::{add_metrics, Parts, Source};
use super::objects::check_path;
use super::{CommitOptions, CommitReport, RepoError, Repository, StepSource};

/// The name errors about in-memory files carry as their path.
pub(super) const IN_MEMORY: &str = "<in-memory checkpoint>";

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
        let files: Vec<(&str, Vec<&[u8]>)> = files.iter().map(|(r, b)| (*r, vec![*b])).collect();
        self.commit_parts(&files, opts)
    }

    /// [`Repository::commit_buffers`] with each file given as the
    /// concatenation of slices (a header and each tensor where it lives):
    /// nothing is copied into one buffer first. A chunk that lies in one
    /// slice is coded from it in place.
    pub fn commit_parts(
        &self,
        files: &[(&str, Vec<&[u8]>)],
        opts: &CommitOptions,
    ) -> Result<CommitReport, RepoError> {
        self.commit_parts_checked(files, opts, &|| Ok(()))
    }

    /// [`Repository::commit_parts`] that calls `check` once every byte of
    /// `files` has been read and stored, before the commit is published
    /// (the final batch that moves the branch): an `Err(reason)` abandons
    /// the commit ([`RepoError::BadInput`] with that reason; the branch
    /// stays where it was, the chunks stored are gc's). For a caller whose
    /// buffers may have changed while they were read (the Python package's
    /// first background save reads the training state in place and checks
    /// the tensors' version counters here).
    pub fn commit_parts_checked(
        &self,
        files: &[(&str, Vec<&[u8]>)],
        opts: &CommitOptions,
        check: &(dyn Fn() -> Result<(), String> + Sync),
    ) -> Result<CommitReport, RepoError> {
        let here = || PathBuf::from(IN_MEMORY);
        let step = opts.step.ok_or_else(|| RepoError::BadInput {
            path: here(),
            reason: "a commit from memory needs a step".into(),
        })?;
        let mut seen = HashSet::new();
        for (rel, _) in files {
            check_path(rel).map_err(|e| RepoError::BadInput {
                path: PathBuf::from(rel),
                reason: e.to_string(),
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
            .map(|(rel, parts)| (rel.to_string(), Source::Bytes(Parts::new(parts.clone()))))
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
            &super::NoProgress,
            check,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::repo::Config;
    use crate::store::MemStore;

    fn repo() -> Repository {
        Repository::init_store(
            PathBuf::from("/nonexistent-ckvc-test"),
            Arc::new(MemStore::new()),
            Config::default(),
        )
        .expect("init")
    }

    /// A safetensors file of one F32 tensor `w` and one I64 tensor `n`.
    fn safetensors(w: &[f32]) -> Vec<u8> {
        let wb = w.len() * 4;
        let mut h = format!(
            r#"{{"w":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{wb}]}},"n":{{"dtype":"I64","shape":[],"data_offsets":[{wb},{}]}}}}"#,
            w.len(),
            wb + 8
        )
        .into_bytes();
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        for x in w {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&7i64.to_le_bytes());
        out
    }

    #[test]
    fn a_file_given_in_parts_stores_the_same_bytes_and_chunks_as_one_buffer() {
        let w: Vec<f32> = (0..700_000).map(|i| (i as f32 * 0.003).cos()).collect();
        let f = safetensors(&w);
        let whole = repo();
        let one = whole
            .commit_buffers(&[("t.safetensors", &f)], &step(1))
            .expect("commit");
        let chunks = |r: &Repository, id| -> Vec<_> {
            let c = r.commit_object(&id).expect("commit");
            let tree = r.tree(&c.tree).expect("tree");
            let (rel, mid) = &tree.entries[0];
            let m = r.manifest(mid, rel).expect("manifest");
            m.segments
                .iter()
                .flat_map(|s| s.chunks().to_vec())
                .collect()
        };
        let want = chunks(&whole, one.id);
        let h = 8 + u64::from_le_bytes(f[..8].try_into().unwrap()) as usize;
        // Cuts at the header's end (the Python layout), inside the header,
        // inside the tensor data (chunks spanning parts are copied), and
        // empty and one-byte parts.
        let cuts: [&[usize]; 4] = [
            &[h],
            &[3, h - 1, h + 5, 1 << 20, (1 << 20) + 1, f.len() - 2],
            &[0, 0, h, h, f.len()],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        ];
        for cut in cuts {
            let mut parts = Vec::new();
            let mut at = 0;
            for &c in cut {
                parts.push(&f[at..c]);
                at = c;
            }
            parts.push(&f[at..]);
            let r = repo();
            let got = r
                .commit_parts(&[("t.safetensors", parts)], &step(1))
                .expect("commit");
            assert_eq!(got.tensor_bytes, one.tensor_bytes, "cuts {cut:?}");
            assert_eq!(chunks(&r, got.id), want, "cuts {cut:?}");
            assert_eq!(r.read_file(&got.id, "t.safetensors").expect("read"), f);
        }
    }

    fn step(step: u64) -> CommitOptions {
        CommitOptions {
            step: Some(step),
            ..CommitOptions::default()
        }
    }

    #[test]
    fn a_failed_check_before_publishing_leaves_the_branch_where_it_was() {
        let w: Vec<f32> = (0..300_000).map(|i| (i as f32 * 0.01).sin()).collect();
        let f = safetensors(&w);
        let r = repo();
        let first = r
            .commit_buffers(&[("t.safetensors", &f)], &step(1))
            .expect("commit");
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let refuse = || {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err("tensor w changed while it was read".to_string())
        };
        let err = r
            .commit_parts_checked(&[("t.safetensors", vec![&f[..]])], &step(2), &refuse)
            .expect_err("the check refuses");
        assert!(
            matches!(&err, RepoError::BadInput { reason, .. } if reason == "tensor w changed while it was read"),
            "{err}"
        );
        assert_eq!(calls.into_inner(), 1);
        assert_eq!(r.branch_head("main").expect("head"), Some(first.id));
        // A passing check commits, and is called once.
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let pass = || {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        };
        let second = r
            .commit_parts_checked(&[("t.safetensors", vec![&f[..]])], &step(2), &pass)
            .expect("commit");
        assert_eq!(calls.into_inner(), 1);
        assert_eq!(r.branch_head("main").expect("head"), Some(second.id));
    }

    #[test]
    fn buffers_commit_read_back_and_delta() {
        let r = repo();
        let w: Vec<f32> = (0..300_000).map(|i| (i as f32 * 0.001).sin()).collect();
        let f1 = safetensors(&w);
        let opts = |step| CommitOptions {
            step: Some(step),
            metrics: vec![("loss".into(), 1.5)],
            ..CommitOptions::default()
        };
        let first = r
            .commit_buffers(&[("t.safetensors", &f1), ("s.json", b"{}")], &opts(1))
            .expect("commit");
        assert_eq!(first.stats.files, 2);
        assert_eq!(first.tensor_bytes, 300_000 * 4 + 8);
        assert_eq!(r.read_file(&first.id, "t.safetensors").expect("read"), f1);
        assert_eq!(r.read_file(&first.id, "s.json").expect("read"), b"{}");
        let files = r.list_files(&first.id).expect("list");
        assert_eq!(files[1].path, "t.safetensors");
        let names: Vec<&str> = files[1].tensors().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["w", "n"]);
        let mut out = vec![0u8; 300_000 * 4];
        r.read_tensor_into(&first.id, "t.safetensors", "w", &mut out)
            .expect("tensor");
        let hdr = f1.len() - out.len() - 8;
        assert_eq!(out, f1[hdr..hdr + out.len()]);
        let mut short = vec![0u8; 3];
        assert!(matches!(
            r.read_tensor_into(&first.id, "t.safetensors", "w", &mut short),
            Err(RepoError::BadInput { .. })
        ));
        assert!(matches!(
            r.read_tensor_into(&first.id, "t.safetensors", "x", &mut out),
            Err(RepoError::BadInput { .. })
        ));

        // A slightly changed state is coded against the previous one.
        let mut w2 = w.clone();
        for x in w2.iter_mut().take(1000) {
            *x += 1.0;
        }
        let f2 = safetensors(&w2);
        let second = r
            .commit_buffers(&[("t.safetensors", &f2), ("s.json", b"{}")], &opts(2))
            .expect("commit");
        assert!(second.stats.max_depth >= 1, "{:?}", second.stats);
        assert!(second.stats.stored_bytes < first.stats.stored_bytes / 2);
        assert_eq!(r.read_file(&second.id, "t.safetensors").expect("read"), f2);

        // The same state at the same step again: already committed.
        let again = r
            .commit_buffers(&[("s.json", b"{}"), ("t.safetensors", &f2)], &opts(2))
            .expect("commit");
        assert!(again.already_committed);
        assert_eq!(again.id, second.id);
        // An older step is refused; no step at all too.
        assert!(matches!(
            r.commit_buffers(&[("s.json", b"{}")], &opts(1)),
            Err(RepoError::StepOrder { .. })
        ));
        let no_step = CommitOptions::default();
        assert!(matches!(
            r.commit_buffers(&[("s.json", b"{}")], &no_step),
            Err(RepoError::BadInput { .. })
        ));
        assert!(matches!(
            r.commit_buffers(&[("a", b"1"), ("a", b"2")], &opts(3)),
            Err(RepoError::BadInput { .. })
        ));
        assert!(matches!(
            r.commit_buffers(&[("../a", b"1")], &opts(3)),
            Err(RepoError::BadInput { .. })
        ));
    }
}
