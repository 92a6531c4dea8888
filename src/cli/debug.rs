//! `ckvc debug ...`: developer tools.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use ckvc::bench::{self, BenchOptions, Row};

use super::{out, Failure};

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Measure the chunk codec against LMC, zstd and the entropy bound on a
    /// run's checkpoints (directories like step-500/ in one folder).
    CodecBench(CodecBenchArgs),
}

#[derive(Args)]
pub struct CodecBenchArgs {
    /// Folder holding the run's checkpoint directories.
    dir: PathBuf,
    /// Print JSON rows instead of a table.
    #[arg(long)]
    json: bool,
    /// Threads for the all-cores row (default: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed passes per measurement; the fastest counts.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Skip zstd -19 (slow).
    #[arg(long)]
    no_zstd19: bool,
    /// JSON rows of a peer (e.g. from scripts/compare_zipnn.py --json) to
    /// show in the same table.
    #[arg(long, value_name = "FILE")]
    peer: Vec<PathBuf>,
}

pub fn run(cmd: DebugCommand) -> Result<(), Failure> {
    match cmd {
        DebugCommand::CodecBench(a) => codec_bench(a),
    }
}

fn codec_bench(a: CodecBenchArgs) -> Result<(), Failure> {
    let opts = BenchOptions {
        threads: a.threads,
        repeat: a.repeat,
        zstd19: !a.no_zstd19,
        ..BenchOptions::default()
    };
    let mut rows = bench::codec_bench(&a.dir, &opts).map_err(|e| {
        let code = match e {
            bench::BenchError::Mismatch { .. } => super::exit::CORRUPT,
            _ => super::exit::USER,
        };
        Failure {
            code,
            message: e.to_string(),
            hint: None,
        }
    })?;
    for p in &a.peer {
        let text = std::fs::read_to_string(p)
            .map_err(|e| Failure::user(format!("reading {}: {e}", p.display())))?;
        let peer: Vec<Row> = serde_json::from_str(&text).map_err(|e| {
            Failure::user(format!("{}: not a JSON array of rows: {e}", p.display()))
        })?;
        rows.extend(peer);
    }
    if a.json {
        let s = serde_json::to_string_pretty(&rows).expect("rows serialise");
        return out(&(s + "\n"));
    }
    out(&table(&rows))
}

fn table(rows: &[Row]) -> String {
    let mut by: BTreeMap<(u8, String, u8, String), Vec<&Row>> = BTreeMap::new();
    let group_rank = |g: &str| match g {
        "weights" => 0,
        "optimizer" => 1,
        _ => 2,
    };
    for r in rows {
        let key = (
            u8::from(r.mode != "FULL"),
            r.dtype.clone(),
            group_rank(&r.group),
            r.group.clone(),
        );
        by.entry(key).or_default().push(r);
    }
    let codec_rank = |c: &str| match c {
        "ckvc" => 0,
        "lmc" => 2,
        "zstd-3" => 3,
        "zstd-19" => 4,
        "entropy" => 5,
        _ => 1,
    };
    let mut s = String::new();
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    for ((_, dtype, _, group), mut rs) in by {
        rs.sort_by_key(|r| (codec_rank(&r.codec), r.threads));
        let r0 = rs[0];
        let _ = writeln!(
            s,
            "\n{} {} {}  ({:.1} MiB)",
            r0.mode,
            dtype,
            group,
            r0.bytes_in as f64 / (1 << 20) as f64
        );
        let _ = writeln!(
            s,
            "  {:<10} {:>7} {:>8} {:>13} {:>15}",
            "codec", "threads", "ratio", "compress MiB/s", "decompress MiB/s"
        );
        for r in rs {
            let _ = writeln!(
                s,
                "  {:<10} {:>7} {:>8.4} {:>13} {:>15}",
                r.codec,
                r.threads,
                r.ratio,
                f(r.compress_mib_s),
                f(r.decompress_mib_s)
            );
        }
    }
    s
}
