//! The one integration-test binary (as jj does it): modules per area.

mod cli;
mod codec_corpus;
mod fuzz_regressions;
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
