//! `commit_buffers` / `commit_parts`: store files held in memory as a new commit, for
//! callers that build a checkpoint without writing it to disk (the Python
//! package's `save`); `commit_parts_mirrored` lets go of the caller's
//! memory before the commit is done (see `mirror`).
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
use super::mirror::Mirror;
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
        self.commit_from_memory(files, opts, None, check)
    }

    /// [`Repository::commit_parts_checked`] for a caller that wants the
    /// parts of the file `mirror.0` back before the commit is done (the
    /// Python package's first background save reads the training state
    /// where it lives; training may change it once it is let go). While
    /// the commit reads that file from its start, a thread copies it from
    /// its end into `mirror.1` (a buffer of at least the file's length);
    /// when the two meet, the commit reads the rest from that buffer, and
    /// `release` is called (on the copying thread) once no byte of the
    /// parts will be read again. Its `Err(reason)` abandons the commit as
    /// `check`'s does; no commit is published before it has returned.
    /// If the commit fails first, `release` may never be called.
    pub fn commit_parts_mirrored(
        &self,
        files: &[(&str, Vec<&[u8]>)],
        opts: &CommitOptions,
        mirror: (&str, &mut [u8]),
        release: &(dyn Fn() -> Result<(), String> + Sync),
    ) -> Result<CommitReport, RepoError> {
        self.commit_from_memory(files, opts, Some((mirror, release)), &|| Ok(()))
    }

    fn commit_from_memory(
        &self,
        files: &[(&str, Vec<&[u8]>)],
        opts: &CommitOptions,
        mirror: Option<Mirrored<'_, '_>>,
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
        // The file to mirror: its path, its mirror, its parts (which the
        // copier reads) and the release.
        let mirror = match mirror {
            None => None,
            Some(((name, staging), release)) => {
                let bad = |reason: &str| RepoError::BadInput {
                    path: PathBuf::from(name),
                    reason: reason.into(),
                };
                let parts = files
                    .iter()
                    .find(|(rel, _)| *rel == name)
                    .map(|(_, parts)| Parts::new(parts.clone()))
                    .ok_or_else(|| bad("the file to mirror is not one of the files"))?;
                let m = Mirror::new(staging, parts.len())
                    .ok_or_else(|| bad("the staging buffer is shorter than the file"))?;
                Some((name, m, parts, release))
            }
        };
        let sources = sources(files, mirror.as_ref().map(|(name, m, ..)| (*name, m)));
        std::thread::scope(|s| {
            let copier = match &mirror {
                Some((_, m, parts, release)) => Some(
                    std::thread::Builder::new()
                        .name("ckvc-mirror".into())
                        .spawn_scoped(s, move || m.copy_from_back(parts, *release))
                        .map_err(|source| RepoError::Io {
                            path: PathBuf::from(IN_MEMORY),
                            source,
                        })?,
                ),
                None => None,
            };
            // A mirrored file's release comes first (it may refuse).
            let checked = || match &mirror {
                Some((_, m, ..)) => m.finish().and_then(|()| check()),
                None => check(),
            };
            // Stops the copier however the commit ends, a panic included
            // (the scope joins the copier before the panic goes on).
            let stop = StopOnDrop(mirror.as_ref().map(|(_, m, ..)| m));
            let report = self.commit_sources(
                target,
                &sources,
                &DirContext::default(),
                (step, StepSource::Given),
                metrics,
                opts,
                None,
                &super::NoProgress,
                &checked,
            );
            drop(stop);
            if let Some(c) = copier {
                // (the copier catches its own panics)
                let _ = c.join();
            }
            report
        })
    }
}

/// Stops a mirror's copier when dropped.
struct StopOnDrop<'m, 's>(Option<&'m Mirror<'s>>);

impl Drop for StopOnDrop<'_, '_> {
    fn drop(&mut self) {
        if let Some(m) = self.0 {
            m.stop();
        }
    }
}

/// A file to mirror (its path and the staging buffer) and the release.
type Mirrored<'a, 'b> = (
    (&'a str, &'a mut [u8]),
    &'b (dyn Fn() -> Result<(), String> + Sync),
);

/// The sources of `files`, sorted by path as a directory commit sees them
/// (trees list their files sorted); the file `mirror` names read through
/// its mirror.
fn sources<'a>(
    files: &[(&str, Vec<&'a [u8]>)],
    mirror: Option<(&str, &'a Mirror<'a>)>,
) -> Vec<(String, Source<'a>)> {
    let mut sources: Vec<(String, Source<'a>)> = files
        .iter()
        .map(|(rel, parts)| {
            let mut p = Parts::new(parts.clone());
            if let Some((_, m)) = mirror.filter(|(name, _)| name == rel) {
                p = p.mirrored(m);
            }
            (rel.to_string(), Source::Bytes(p))
        })
        .collect();
    sources.sort_by(|a, b| a.0.cmp(&b.0));
    sources
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

    /// A repository cutting chunks of `chunk_bytes` (to cut across a
    /// mirror's units).
    fn repo_cutting(chunk_bytes: u64) -> Repository {
        let config = Config {
            chunk_bytes,
            ..Config::default()
        };
        let store = Arc::new(MemStore::new());
        Repository::init_store(PathBuf::from("/nonexistent-ckvc-test"), store, config)
            .expect("init")
    }

    /// Commits `f` mirrored, its memory overwritten by the release (as
    /// training changes a tensor once a save has let go of it); the commit
    /// and how many times the release ran.
    fn commit_mirrored_then_overwrite(
        r: &Repository,
        f: &[u8],
        at: u64,
    ) -> Result<(CommitReport, usize), RepoError> {
        let mut live = f.to_vec();
        let addr = live.as_mut_ptr() as usize;
        // SAFETY: `live` outlives the commit. The slices alias the writes
        // below, as a tensor's memory aliases training's writes to it in
        // the Python package: the commit must not read it after the
        // release, which is what this pins.
        let head = unsafe { std::slice::from_raw_parts(addr as *const u8, 100) };
        // SAFETY: as above; `f` is longer than 100 bytes.
        let rest = unsafe { std::slice::from_raw_parts((addr + 100) as *const u8, f.len() - 100) };
        let mut staging = vec![0u8; f.len() + 3];
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let release = || {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // SAFETY: as above; in bounds.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0xAB, f.len()) };
            Ok(())
        };
        let report = r.commit_parts_mirrored(
            &[("t.safetensors", vec![head, rest]), ("s.json", vec![b"{}"])],
            &step(at),
            ("t.safetensors", &mut staging),
            &release,
        )?;
        assert!(live.iter().all(|&b| b == 0xAB), "the release ran");
        Ok((report, calls.into_inner()))
    }

    #[test]
    fn a_mirrored_file_is_stored_as_it_was_whatever_its_memory_holds_after_the_release() {
        // Chunks of 300,000 bytes cut across the mirror's units (1/64 of
        // the file each); where reader and copier meet varies from run to
        // run, so several runs, each a full commit and then a delta.
        let w: Vec<f32> = (0..3_000_000).map(|i| (i as f32 * 0.0007).sin()).collect();
        let f = safetensors(&w);
        let w2: Vec<f32> = w.iter().map(|x| x * 1.001).collect();
        let f2 = safetensors(&w2);
        for _ in 0..4 {
            let r = repo_cutting(300_000);
            let (one, calls) = commit_mirrored_then_overwrite(&r, &f, 1).expect("commit");
            assert_eq!(calls, 1);
            assert_eq!(r.read_file(&one.id, "t.safetensors").expect("read"), f);
            assert_eq!(r.read_file(&one.id, "s.json").expect("read"), b"{}");
            let (two, calls) = commit_mirrored_then_overwrite(&r, &f2, 2).expect("commit");
            assert_eq!(calls, 1);
            assert_eq!(r.read_file(&two.id, "t.safetensors").expect("read"), f2);
            assert_eq!(r.branch_head("main").expect("head"), Some(two.id));
            // the same tree as a commit that reads the memory throughout
            let plain = repo_cutting(300_000);
            let p1 = plain
                .commit_buffers(&[("t.safetensors", &f), ("s.json", b"{}")], &step(1))
                .expect("commit");
            let tree = |r: &Repository, id| r.commit_object(&id).expect("commit").tree;
            assert_eq!(tree(&r, one.id), tree(&plain, p1.id));
            assert_eq!(p1.stats.new_chunks, one.stats.new_chunks);
        }
    }

    #[test]
    fn a_failed_release_abandons_the_mirrored_commit() {
        let w: Vec<f32> = (0..400_000).map(|i| (i as f32 * 0.01).cos()).collect();
        let f = safetensors(&w);
        let r = repo_cutting(100_000);
        let first = r
            .commit_buffers(&[("t.safetensors", &f)], &step(1))
            .expect("commit");
        let mut staging = vec![0u8; f.len()];
        let refuse = || Err("tensor w changed while it was read".to_string());
        let err = r
            .commit_parts_mirrored(
                &[("t.safetensors", vec![&f[..]])],
                &step(2),
                ("t.safetensors", &mut staging),
                &refuse,
            )
            .expect_err("the release refuses");
        assert!(
            matches!(&err, RepoError::BadInput { reason, .. } if reason == "tensor w changed while it was read"),
            "{err}"
        );
        assert_eq!(r.branch_head("main").expect("head"), Some(first.id));
    }

    #[test]
    fn a_mirror_needs_a_staging_buffer_as_long_as_a_file_given() {
        let f = safetensors(&[1.0, 2.0]);
        let r = repo();
        let ok = || Ok(());
        for (name, len, why) in [
            ("t.safetensors", f.len() - 1, "shorter than the file"),
            ("u.safetensors", f.len(), "not one of the files"),
        ] {
            let mut staging = vec![0u8; len];
            let err = r
                .commit_parts_mirrored(
                    &[("t.safetensors", vec![&f[..]])],
                    &step(1),
                    (name, &mut staging),
                    &ok,
                )
                .expect_err("refused");
            assert!(
                matches!(&err, RepoError::BadInput { reason, .. } if reason.contains(why)),
                "{err}"
            );
        }
        assert_eq!(r.branch_head("main").expect("head"), None);
    }

    #[test]
    fn a_panic_in_a_mirrored_commit_reaches_the_caller_instead_of_hanging() {
        // A panic in the commit (here the mirrored file's reader, on its
        // first chunk: a bug) must reach the caller. It did not: the
        // copier, waiting for the reader to meet it, was never stopped,
        // and the scope joining it waited for ever.
        let w: Vec<f32> = (0..16_000_000).map(|i| (i as f32 * 0.0007).sin()).collect();
        let f = safetensors(&w);
        let store = Arc::new(crate::testing::Instrumented::new(MemStore::new()));
        let r = Repository::init_store(
            PathBuf::from("/nonexistent-ckvc-test"),
            store.clone(),
            Config::default(),
        )
        .expect("init");
        store
            .panic_on_index
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut staging = vec![0u8; f.len()];
            let ok = || Ok(());
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                r.commit_parts_mirrored(
                    &[("t.safetensors", vec![&f[..]])],
                    &step(1),
                    ("t.safetensors", &mut staging),
                    &ok,
                )
                .map(drop)
            }));
            let _ = tx.send(got.is_err());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(panicked) => assert!(panicked, "the panic reaches the caller"),
            Err(_) => panic!("the mirrored commit hung after a panic in its pipeline"),
        }
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
