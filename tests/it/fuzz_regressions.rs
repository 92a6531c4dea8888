//! Replays the inputs saved under `tests/fuzz-regressions/<target>/` through
//! the same checks the fuzz targets in `fuzz/` run (`fuzz_checks`), so a
//! crash the fuzzer once found stays fixed without installing cargo-fuzz.
//!
//! Every file in those folders is an input except `README.md` and dot files.

#[path = "../fuzz_checks/mod.rs"]
mod fuzz_checks;

use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-regressions")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.is_file())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name != "README.md" && !name.starts_with('.')
        })
        .collect();
    files.sort();
    files
}

/// Runs `check` on every saved input of `target`, naming the file that fails.
fn replay(target: &str, check: fn(&[u8])) {
    for path in inputs(target) {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let result = std::panic::catch_unwind(|| check(&data));
        if let Err(panic) = result {
            eprintln!("fuzz regression failed: {}", path.display());
            std::panic::resume_unwind(panic);
        }
    }
}

#[test]
fn decode_regressions() {
    replay("decode", fuzz_checks::check_decode);
}

#[test]
fn roundtrip_regressions() {
    replay("roundtrip", fuzz_checks::check_roundtrip);
}

#[test]
fn format_parse_regressions() {
    replay("format_parse", fuzz_checks::check_format_parse);
}

#[test]
fn objects_regressions() {
    replay("objects", fuzz_checks::check_objects);
}

#[test]
fn pack_regressions() {
    replay("pack", fuzz_checks::check_pack);
}
