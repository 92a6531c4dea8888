//! The one integration-test binary (as jj does it): modules per area.

mod cli;
mod cli_trainers;
mod codec_corpus;
mod crash;
mod dcp;
mod fuzz_regressions;
mod gc_fsck;
mod gc_model;
mod golden;
mod heads;
mod hostile;
mod layers;
mod pipeline;
mod remote;
mod repo_bench;
mod repo_corpus;
mod show_diff;
mod special_inputs;
mod watch;

use std::path::{Path, PathBuf};

use ckvc::store::Space;

/// The shared developer corpus: a real training run.
pub fn corpus() -> PathBuf {
    std::env::var_os("CKVC_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus/gpt-small")
        })
}

/// Run the `ckvc` binary in `dir`: exit code, stdout, stderr.
pub fn run_ckvc(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ckvc"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("ckvc runs");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The corpus's checkpoint directories with their steps, in step order.
pub fn steps() -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(corpus())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            ckvc::format::step_of_dir_name(&n).map(|s| (s, e.path()))
        })
        .collect();
    v.sort();
    v
}

/// Assert two directories hold the same files, byte for byte (recursively).
pub fn same_tree(a: &Path, b: &Path) {
    let mut names: Vec<_> = std::fs::read_dir(a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    let mut other: Vec<_> = std::fs::read_dir(b)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    other.sort();
    assert_eq!(names, other, "{} vs {}", a.display(), b.display());
    for n in names {
        if a.join(&n).is_dir() {
            same_tree(&a.join(&n), &b.join(&n));
            continue;
        }
        let (x, y) = (
            std::fs::read(a.join(&n)).unwrap(),
            std::fs::read(b.join(&n)).unwrap(),
        );
        assert!(x == y, "{} differs", b.join(&n).display());
    }
}

/// Assert `repo` stores each chunk as a repository that committed only
/// `dir` stores it (payload, base and frame byte for byte; a chunk stored
/// whole by gc or a shallow fetch encoded as a commit would, rows and
/// all); returns how many of them are row frames.
pub fn records_as_a_fresh_commit(repo: &ckvc::repo::Repository, dir: &Path) -> usize {
    use ckvc::codec::FrameInfo;
    use ckvc::repo::objects::{ChunkRecord, Payload};
    use ckvc::repo::{CommitOptions, Config, Repository};
    use ckvc::store::StoreExt;
    let tmp = tempfile::tempdir().unwrap();
    let fresh = Repository::init(tmp.path(), Config::default()).unwrap();
    fresh.commit(dir, &CommitOptions::default()).unwrap();
    let records = |r: &Repository| {
        let mut v: Vec<(Vec<u8>, ChunkRecord)> = r
            .store()
            .collect_prefix(Space::Chunks, &[])
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, ChunkRecord::decode(&v).unwrap()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (got, want) = (records(repo), records(&fresh));
    let ids = |v: &[(Vec<u8>, ChunkRecord)]| v.iter().map(|r| r.0.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&got), ids(&want), "the same chunks");
    let mut rows = 0;
    for ((k, a), (_, b)) in got.iter().zip(&want) {
        assert!(
            (a.payload, a.base, &a.data) == (b.payload, b.base, &b.data),
            "chunk {:02x?}: {} bytes stored, {} by a fresh commit",
            &k[..8],
            a.data.len(),
            b.data.len()
        );
        rows += usize::from(a.payload == Payload::Codec && FrameInfo::parse(&a.data).unwrap().rows);
    }
    rows
}

/// Copy a flat directory.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

pub use ckvc::testing::Instrumented;
