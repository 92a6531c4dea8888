//! The repository benchmark on a 3-checkpoint subset of the corpus: the
//! report's structure only, never its timings.

use ckvc::bench::repo::{repo_bench, RepoBenchOptions};

#[test]
fn repo_bench_on_three_checkpoints_verifies_every_checkout_and_compresses() {
    let run = tempfile::tempdir().unwrap();
    for step in [0, 60, 120] {
        let name = format!("step-{step}");
        let (from, to) = (super::corpus().join(&name), run.path().join(&name));
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    let work = tempfile::tempdir().unwrap();
    let opts = RepoBenchOptions {
        work: Some(work.path().to_path_buf()),
        ..RepoBenchOptions::default()
    };
    let r = repo_bench(run.path(), &opts).unwrap();

    assert_eq!(r.checkpoints, 3);
    assert_eq!(
        r.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        [0, 60, 120]
    );
    assert_eq!(r.files, r.steps.iter().map(|s| s.files).sum::<u64>());
    assert_eq!(
        r.logical_bytes,
        r.steps.iter().map(|s| s.logical_bytes).sum::<u64>()
    );
    assert!(r.disk.total > 0, "the repository takes some space");
    assert!(
        r.disk.total < r.logical_bytes,
        "the repository is smaller than the files: {} of {}",
        r.disk.total,
        r.logical_bytes
    );
    assert_eq!(r.disk.total, r.disk.blob + r.disk.sst + r.disk.other);
    let z = r.zstd_files_bytes.expect("zstd runs by default");
    assert!(z > 0 && z < r.logical_bytes);
    assert!(r
        .steps
        .iter()
        .all(|s| s.copy_sync_secs > 0.0 && s.commit_secs > 0.0));
    assert!(r.all_verified && r.steps.iter().all(|s| s.verified));
    assert!(r.peers.is_empty());
    if cfg!(target_os = "linux") {
        assert!(r.peak_rss_commit.is_some() && r.peak_rss_checkout.is_some());
    }
    assert!(!r.work_dir.exists(), "the work directory is removed");
    assert_eq!(
        std::fs::read_dir(work.path()).unwrap().count(),
        0,
        "nothing is left in --work"
    );
    // The JSON form reads back (scripts read it).
    let json = serde_json::to_string(&r).unwrap();
    let back: ckvc::bench::repo::RepoBenchReport = serde_json::from_str(&json).unwrap();
    assert_eq!((back.disk, back.logical_bytes), (r.disk, r.logical_bytes));
    assert_eq!(back.steps.len(), 3);
}
