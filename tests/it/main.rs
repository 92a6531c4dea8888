//! The one integration-test binary (as jj does it): modules per area.

mod cli;
mod codec_corpus;
mod fuzz_regressions;
mod remote;
mod repo_bench;
mod repo_corpus;
mod show_diff;

use std::path::PathBuf;

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
