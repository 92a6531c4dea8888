//! The `ckvc` binary end to end.

use std::process::Command;

fn ckvc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ckvc"))
}

#[test]
fn codec_bench_json_has_every_row_the_table_promises() {
    let out = ckvc()
        .args([
            "debug",
            "codec-bench",
            "--json",
            "--repeat",
            "1",
            "--no-zstd19",
            "--no-bzip2",
        ])
        .arg(super::corpus())
        .output()
        .expect("ckvc runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("JSON rows");
    let has = |mode: &str, dtype: &str, group: &str, codec: &str| {
        rows.iter().any(|r| {
            r["mode"] == mode && r["dtype"] == dtype && r["group"] == group && r["codec"] == codec
        })
    };
    for mode in ["FULL", "DELTA"] {
        for (dtype, group) in [
            ("bf16", "weights"),
            ("fp32", "weights"),
            ("fp32", "optimizer"),
            ("fp32", "all"),
        ] {
            for codec in ["ckvc", "lmc", "zstd-3", "entropy"] {
                assert!(
                    has(mode, dtype, group, codec),
                    "{mode} {dtype} {group} {codec}"
                );
            }
        }
    }
    for r in &rows {
        let ratio = r["ratio"].as_f64().unwrap();
        assert!(ratio > 0.3 && ratio < 1.1, "{r}");
        assert!(r["bytes_in"].as_u64().unwrap() > 1 << 20);
    }
}

#[test]
fn codec_bench_on_a_missing_directory_is_a_clear_error() {
    let out = ckvc()
        .args(["debug", "codec-bench", "/nonexistent/run"])
        .output()
        .expect("ckvc runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/run"), "{err}");
}
