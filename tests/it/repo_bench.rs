//! The repository benchmark (`ckvc debug repo-bench --json`, a CLI-only
//! command) on a 3-checkpoint subset of the corpus: the report's structure
//! only, never its timings.

use serde_json::Value;

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
    let (code, out, err) = super::run_ckvc(
        run.path(),
        &[
            "debug",
            "repo-bench",
            run.path().to_str().unwrap(),
            "--work",
            work.path().to_str().unwrap(),
            "--json",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let r: Value = serde_json::from_str(&out).expect("one JSON report");
    let u = |v: &Value| v.as_u64().expect("a count");
    let steps = r["steps"].as_array().expect("steps");

    assert_eq!(u(&r["checkpoints"]), 3);
    assert_eq!(
        steps.iter().map(|s| u(&s["step"])).collect::<Vec<_>>(),
        [0, 60, 120]
    );
    assert_eq!(
        u(&r["files"]),
        steps.iter().map(|s| u(&s["files"])).sum::<u64>()
    );
    let logical = u(&r["logical_bytes"]);
    assert_eq!(
        logical,
        steps.iter().map(|s| u(&s["logical_bytes"])).sum::<u64>()
    );
    let disk = &r["disk"];
    assert!(u(&disk["total"]) > 0, "the repository takes some space");
    assert!(
        u(&disk["total"]) < logical,
        "the repository is smaller than the files: {} of {logical}",
        disk["total"]
    );
    assert_eq!(
        u(&disk["total"]),
        u(&disk["blob"]) + u(&disk["sst"]) + u(&disk["other"])
    );
    let z = u(&r["zstd_files_bytes"]);
    assert!(z > 0 && z < logical, "zstd runs by default");
    assert!(steps.iter().all(|s| {
        s["copy_sync_secs"].as_f64() > Some(0.0) && s["commit_secs"].as_f64() > Some(0.0)
    }));
    assert_eq!(r["all_verified"], true);
    assert!(steps.iter().all(|s| s["verified"] == true));
    assert_eq!(r["peers"].as_array().map(Vec::len), Some(0));
    if cfg!(target_os = "linux") {
        assert!(r["peak_rss_commit"].is_u64() && r["peak_rss_checkout"].is_u64());
    }
    let work_dir = r["work_dir"].as_str().expect("work_dir");
    assert!(
        !std::path::Path::new(work_dir).exists(),
        "the work directory is removed"
    );
    assert_eq!(
        std::fs::read_dir(work.path()).unwrap().count(),
        0,
        "nothing is left in --work"
    );
}
