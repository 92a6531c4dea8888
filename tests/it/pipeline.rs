//! The commit pipeline reads the files of a checkpoint on several threads:
//! what it stores must not depend on how many, or on which thread read
//! which file.

use std::path::Path;

use ckvc::repo::{CheckoutOptions, CommitOptions, Config, Repository};
use ckvc::store::ObjectId;

use super::{copy_dir, same_tree, steps};

/// A checkpoint of many files: two corpus steps side by side as two
/// "ranks", one file twice (its chunks are new in two files at once) and
/// a 2-rank DCP save.
fn multi_file_checkpoint(out: &Path, a: &Path, b: &Path) {
    copy_dir(a, &out.join("rank0"));
    copy_dir(b, &out.join("rank1"));
    std::fs::create_dir_all(out.join("rank2")).unwrap();
    std::fs::copy(
        b.join("optimizer.pt"),
        out.join("rank2").join("optimizer.pt"),
    )
    .unwrap();
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dcp/ranks2-step-1"),
        &out.join("dcp"),
    );
}

/// A commit's id, tree, files, chunks and new chunks.
type Row = (ckvc::store::CommitId, ObjectId, u64, u64, u64);

/// Commits `dirs` in order into a fresh repository with `threads` rayon
/// threads (so as many reading threads); each commit's tree, file and
/// chunk counts.
fn commit_with_threads(
    root: &Path,
    threads: usize,
    dirs: &[(u64, std::path::PathBuf)],
) -> (Repository, Vec<Row>) {
    let config = Config {
        // Many chunks per file, a short queue: the readers interleave.
        chunk_bytes: 64 << 10,
        memory_budget: 4 << 20,
        ..Config::default()
    };
    let repo = Repository::init(root, config).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut out = Vec::new();
    for (step, dir) in dirs {
        let opts = CommitOptions {
            step: Some(*step),
            ..CommitOptions::default()
        };
        let r = pool.install(|| repo.commit(dir, &opts)).unwrap();
        let c = repo.commit_object(&r.id).unwrap();
        out.push((
            r.id,
            c.tree,
            r.stats.files,
            r.stats.chunks,
            r.stats.new_chunks,
        ));
    }
    (repo, out)
}

#[test]
fn a_multi_file_commit_stores_the_same_trees_whatever_the_reader_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let s = steps();
    let mut dirs = Vec::new();
    for (n, pair) in s.windows(2).take(3).enumerate() {
        let d = tmp.path().join(format!("step-{n}"));
        multi_file_checkpoint(&d, &pair[0].1, &pair[1].1);
        dirs.push((n as u64 + 1, d));
    }
    let (one, a) = commit_with_threads(&tmp.path().join("one"), 1, &dirs);
    let (four, b) = commit_with_threads(&tmp.path().join("four"), 4, &dirs);
    // Trees (and so manifests) and counts are equal; commit ids differ
    // only by the commit time.
    let trees = |v: &[Row]| {
        v.iter()
            .map(|&(_, t, f, c, n)| (t, f, c, n))
            .collect::<Vec<_>>()
    };
    assert_eq!(trees(&a), trees(&b));
    assert!(a.iter().all(|&(_, _, files, _, _)| files >= 8), "{a:?}");
    for (repo, ids) in [(&one, &a), (&four, &b)] {
        for ((_, dir), (id, ..)) in dirs.iter().zip(ids.iter()) {
            let out = tempfile::tempdir().unwrap();
            repo.checkout(id, out.path(), &CheckoutOptions::default())
                .unwrap();
            same_tree(dir, out.path());
        }
    }
}
