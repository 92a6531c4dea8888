//! `ckvc debug ...`: developer tools.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::bench::repo::{PeerSize, RepoBenchOptions, RepoBenchReport};
use super::bench::{self, BenchOptions, Row};

use super::{out, Failure};

// The variant names are the subcommands users type (`codec-bench`, ...).
#[allow(clippy::enum_variant_names)]
#[derive(Subcommand)]
pub enum DebugCommand {
    /// Measure the chunk codec against LMC, zstd and the entropy bound on a
    /// run's checkpoints (directories like step-500/ in one folder).
    CodecBench(CodecBenchArgs),
    /// Commit a whole run into a fresh repository, check every step out and
    /// compare; bytes on disk and speeds beside cp -r and per-file zstd -19.
    RepoBench(RepoBenchArgs),
    /// Commit a run with long delta chains, then `gc --compact` copies of
    /// it with several bounds: bytes on disk and checkout times.
    GcBench(GcBenchArgs),
    /// Push a run to a directory remote, clone it, push and pull one more
    /// step: bytes transferred against the logical size, MiB/s beside cp -r.
    RemoteBench {
        /// Folder holding the run's checkpoint directories.
        dir: PathBuf,
        /// Print the report as JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Create the work directory in DIR (default: the system temporary directory).
        #[arg(long, value_name = "DIR")]
        work: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct GcBenchArgs {
    /// Folder holding the run's checkpoint directories.
    dir: PathBuf,
    /// Longest delta chain while committing.
    #[arg(long, default_value_t = 1000)]
    max_chain: u16,
    /// Compaction bounds to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4")]
    chains: Vec<u16>,
    /// Timed checkouts per measurement; the fastest counts.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Create the work directory in DIR instead of the system temporary directory.
    #[arg(long, value_name = "DIR")]
    work: Option<PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RepoBenchArgs {
    /// Folder holding the run's checkpoint directories.
    dir: PathBuf,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Create the work directory (repository, checkouts, copies) in DIR
    /// instead of the system temporary directory.
    #[arg(long, value_name = "DIR")]
    work: Option<PathBuf>,
    /// Keep the work directory.
    #[arg(long)]
    keep: bool,
    /// Skip the per-file zstd -19 baseline (~4 MiB/s: hours on a large run).
    #[arg(long)]
    no_zstd: bool,
    /// JSON sizes measured by another tool on the same files, e.g.
    /// `{"codec":"zipnn-files","bytes":N}` from
    /// `scripts/compare_zipnn.py --files` (one object or an array).
    #[arg(long, value_name = "FILE")]
    peer: Vec<PathBuf>,
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
    /// Timed passes per measurement; the fastest counts. A row of less
    /// than 32 MiB gets as many as code 32 MiB through each codec (at
    /// most 10,000).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Skip zstd -19 (slow).
    #[arg(long)]
    no_zstd19: bool,
    /// Skip bzip2 -9 (slow).
    #[arg(long)]
    no_bzip2: bool,
    /// Code every chunk without its rows, as `ckvc init --no-row-frames`
    /// repositories do (no row frames).
    #[arg(long)]
    no_row_frames: bool,
    /// JSON rows of a peer (e.g. from scripts/compare_zipnn.py --json) to
    /// show in the same table.
    #[arg(long, value_name = "FILE")]
    peer: Vec<PathBuf>,
}

/// A benchmark that found wrong bytes is corruption (exit 3); anything else
/// (a missing directory, an unreadable file) is the user's to fix.
fn bench_failure(e: bench::BenchError) -> Failure {
    let code = match &e {
        bench::BenchError::Mismatch { .. } | bench::BenchError::CheckoutMismatch { .. } => {
            super::exit::CORRUPT
        }
        bench::BenchError::Repo(r) if r.is_corruption() => super::exit::CORRUPT,
        bench::BenchError::Remote(r) if r.is_corruption() => super::exit::CORRUPT,
        _ => super::exit::USER,
    };
    Failure::from_error(code, &e, None)
}

/// `memory_budget`: the global `--memory-budget` (MiB), for the benchmark
/// repositories.
pub fn run(cmd: DebugCommand, memory_budget: Option<u64>) -> Result<(), Failure> {
    match cmd {
        DebugCommand::CodecBench(a) => codec_bench(a),
        DebugCommand::RepoBench(a) => repo_bench(a, memory_budget),
        DebugCommand::GcBench(a) => gc_bench(a),
        DebugCommand::RemoteBench { dir, json, work } => {
            let r = bench::remote::remote_bench(&dir, work.as_deref()).map_err(bench_failure)?;
            if json {
                let s = serde_json::to_string_pretty(&r).expect("the report serialises");
                return out(&(s + "\n"));
            }
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            let mut s = format!(
                "{}\n  {:<32} {:>7} {:>11} {:>13} {:>8} {:>8} {:>9}\n",
                r.run.display(),
                "transfer",
                "commits",
                "logical MiB",
                "transferred",
                "ratio",
                "secs",
                "MiB/s"
            );
            for t in &r.rows {
                let _ = writeln!(
                    s,
                    "  {:<32} {:>7} {:>11.1} {:>9.1} MiB {:>8.3} {:>8.2} {:>9.1}",
                    t.what,
                    t.commits,
                    mib(t.logical_bytes),
                    mib(t.transferred_bytes),
                    t.transferred_bytes as f64 / t.logical_bytes.max(1) as f64,
                    t.secs,
                    t.mib_s()
                );
            }
            s.push_str("  (MiB/s of logical bytes; the directory remote fsyncs every pack, cp -r does not)\n");
            out(&s)
        }
    }
}

fn gc_bench(a: GcBenchArgs) -> Result<(), Failure> {
    let r = bench::gc::gc_bench(&a.dir, a.work.as_deref(), a.max_chain, &a.chains, a.repeat)
        .map_err(bench_failure)?;
    if a.json {
        let s = serde_json::to_string_pretty(&r).expect("the report serialises");
        return out(&(s + "\n"));
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut s = format!(
        "{} steps, {:.1} MiB logical, committed with max_chain {} in {:.2} s; first step {:.1} MiB, newest {:.1} MiB\n\n",
        r.steps,
        mib(r.logical_bytes),
        r.max_chain,
        r.commit_secs,
        mib(r.first_bytes),
        mib(r.newest_bytes)
    );
    let per_byte = r.first_bytes as f64 / r.newest_bytes.max(1) as f64;
    s.push_str("state             disk MiB  of logical  chain  gc s  checkout newest s  first s  newest/first  per byte\n");
    for row in &r.rows {
        let state = match row.compact_chain {
            None => "committed".to_string(),
            Some(k) => format!("gc --compact {k}"),
        };
        let _ = writeln!(
            s,
            "{state:<16} {:>9.1}  {:>10.4}  {:>5}  {:>4.2}  {:>17.3}  {:>7.3}  {:>12.2}  {:>8.2}",
            mib(row.disk_bytes),
            row.disk_bytes as f64 / r.logical_bytes.max(1) as f64,
            row.longest_chain,
            row.gc_secs,
            row.checkout_newest_secs,
            row.checkout_first_secs,
            row.checkout_newest_secs / row.checkout_first_secs.max(1e-9),
            row.checkout_newest_secs / row.checkout_first_secs.max(1e-9) * per_byte
        );
    }
    out(&s)
}

fn repo_bench(a: RepoBenchArgs, memory_budget: Option<u64>) -> Result<(), Failure> {
    let mut peers = Vec::new();
    for p in &a.peer {
        let text = std::fs::read_to_string(p)
            .map_err(|e| Failure::user(format!("reading {}: {e}", p.display())))?;
        let bad = |e: serde_json::Error| {
            Failure::user(format!(
                "{}: not a {{\"codec\", \"bytes\"}} object or an array of them: {e}",
                p.display()
            ))
        };
        if text.trim_start().starts_with('[') {
            peers.extend(serde_json::from_str::<Vec<PeerSize>>(&text).map_err(bad)?);
        } else {
            peers.push(serde_json::from_str::<PeerSize>(&text).map_err(bad)?);
        }
    }
    let mut opts = RepoBenchOptions {
        work: a.work,
        keep_work: a.keep,
        zstd: !a.no_zstd,
        ..RepoBenchOptions::default()
    };
    if let Some(mib) = memory_budget {
        opts.config.memory_budget = mib << 20;
    }
    let mut report = bench::repo::repo_bench(&a.dir, &opts).map_err(bench_failure)?;
    report.peers = peers;
    if a.json {
        let s = serde_json::to_string_pretty(&report).expect("the report serialises");
        return out(&(s + "\n"));
    }
    out(&repo_table(&report))
}

fn repo_table(r: &RepoBenchReport) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let ratio = |b: u64| b as f64 / r.logical_bytes.max(1) as f64;
    let rss = |v: Option<u64>| v.map_or("n/a".to_string(), |b| format!("{:.0} MiB", mib(b)));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {} checkpoints, {} files, steps {}..{}\n",
        r.run.display(),
        r.checkpoints,
        r.files,
        r.steps.first().map_or(0, |x| x.step),
        r.steps.last().map_or(0, |x| x.step)
    );
    let _ = writeln!(
        s,
        "  {:<28} {:>12} {:>10} {:>8}",
        "kept as", "bytes", "MiB", "ratio"
    );
    let mut size = |name: &str, b: u64| {
        let _ = writeln!(s, "  {name:<28} {b:>12} {:>10.1} {:>8.4}", mib(b), ratio(b));
    };
    size("files (logical)", r.logical_bytes);
    size("ckvc repository on disk", r.disk.total);
    if let Some(z) = r.zstd_files_bytes {
        size(&format!("zstd -{} per file", r.zstd_level), z);
    }
    for p in &r.peers {
        size(&format!("{} (peer)", p.codec), p.bytes);
    }
    let _ = writeln!(
        s,
        "  (repository: blob files {:.1} MiB, sst {:.1} MiB, wal/manifest/logs {:.2} MiB)",
        mib(r.disk.blob),
        mib(r.disk.sst),
        mib(r.disk.other)
    );
    for p in &r.peers {
        if let Some(n) = p.bytes_in.filter(|&n| n != r.logical_bytes) {
            let _ = writeln!(
                s,
                "  note: {} read {n} bytes, not the run's {}",
                p.codec, r.logical_bytes
            );
        }
    }
    let _ = writeln!(
        s,
        "\n  {:<28} {:>9} {:>9} {:>9} {:>9}",
        "speed (logical bytes)", "secs", "MiB/s", "/ cp+sync", "CPU/wall"
    );
    let over = |t: f64| t / r.copy_sync.secs.max(1e-9);
    for (label, t, cpu) in [
        ("ckvc commit (all steps)", &r.commit, r.commit_cpu_util),
        (
            "ckvc checkout (all steps)",
            &r.checkout,
            r.checkout_cpu_util,
        ),
    ] {
        let _ = writeln!(
            s,
            "  {:<28} {:>9.2} {:>9.1} {:>9.2} {:>9.2}",
            label,
            t.secs,
            t.mib_s,
            over(t.secs),
            cpu
        );
    }
    let _ = writeln!(
        s,
        "  {:<28} {:>9.2} {:>9.1} {:>9.2}",
        "cp -r + sync", r.copy_sync.secs, r.copy_sync.mib_s, 1.0
    );
    if let Some(t) = r.zstd_files {
        let _ = writeln!(
            s,
            "  {:<28} {:>9.2} {:>9.1} {:>9.2}",
            format!("zstd -{} per file (1 core)", r.zstd_level),
            t.secs,
            t.mib_s,
            over(t.secs)
        );
    }
    let _ = writeln!(
        s,
        "  checkout of the first step (step {}) {:.3} s, of the newest (step {}) {:.3} s",
        r.steps.first().map_or(0, |x| x.step),
        r.checkout_first_secs,
        r.steps.last().map_or(0, |x| x.step),
        r.checkout_newest_secs
    );
    let _ = writeln!(
        s,
        "  peak RSS{}: commit {}, checkout {}",
        if r.peak_rss_per_phase {
            " per phase"
        } else {
            " (process, cumulative)"
        },
        rss(r.peak_rss_commit),
        rss(r.peak_rss_checkout)
    );
    let _ = writeln!(
        s,
        "  every checkout byte-identical to its original: {}",
        if r.all_verified { "yes" } else { "NO" }
    );
    let _ = writeln!(
        s,
        "\n  {:>6} {:>9} {:>9} {:>7} {:>5} | {:>8} {:>5} {:>5} | {:>8} {:>5} {:>5} | {:>8}",
        "step",
        "MiB",
        "stored",
        "ratio",
        "depth",
        "commit s",
        "/cp",
        "CPU",
        "chkout s",
        "/cp",
        "CPU",
        "cp+sync"
    );
    for x in &r.steps {
        let cp = x.copy_sync_secs.max(1e-9);
        let _ = writeln!(
            s,
            "  {:>6} {:>9.2} {:>9.2} {:>7.4} {:>5} | {:>8.3} {:>5.2} {:>5.2} | {:>8.3} {:>5.2} {:>5.2} | {:>8.3}",
            x.step,
            mib(x.logical_bytes),
            mib(x.stored_bytes),
            x.stored_bytes as f64 / x.logical_bytes.max(1) as f64,
            x.max_depth,
            x.commit_secs,
            x.commit_secs / cp,
            x.commit_cpu_secs / x.commit_secs.max(1e-9),
            x.checkout_secs,
            x.checkout_secs / cp,
            x.checkout_cpu_secs / x.checkout_secs.max(1e-9),
            x.copy_sync_secs
        );
    }
    let _ = writeln!(
        s,
        "  (/cp: seconds over cp -r + sync of the same directory, measured beside it; CPU: CPU seconds over wall seconds, 2 = two cores busy)"
    );
    s
}

fn codec_bench(a: CodecBenchArgs) -> Result<(), Failure> {
    let opts = BenchOptions {
        threads: a.threads,
        repeat: a.repeat,
        zstd19: !a.no_zstd19,
        bzip2: !a.no_bzip2,
        row_frames: !a.no_row_frames,
        ..BenchOptions::default()
    };
    let mut rows = bench::codec_bench(&a.dir, &opts).map_err(bench_failure)?;
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
        "bzip2-9" => 5,
        "entropy" => 6,
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
        for r in &rs {
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
        // Speed ratios of rows timed side by side (interleaved passes):
        // steadier on a shared machine than the MiB/s themselves.
        let find = |codec: &str, many: bool| {
            rs.iter()
                .find(|r| r.codec == codec && (r.threads > 1) == many)
                .copied()
        };
        let x = |a: &Row, b: &Row| match (
            a.compress_mib_s,
            b.compress_mib_s,
            a.decompress_mib_s,
            b.decompress_mib_s,
        ) {
            (Some(ac), Some(bc), Some(ad), Some(bd)) if bc > 0.0 && bd > 0.0 => {
                Some(format!("{:.2}x / {:.2}x", ac / bc, ad / bd))
            }
            _ => None,
        };
        let mut side = Vec::new();
        if let Some(one) = find("ckvc", false) {
            if let Some((m, v)) = find("ckvc", true).and_then(|m| Some((m, x(m, one)?))) {
                side.push(format!("{} threads {v} of 1", m.threads));
            }
            if let Some(v) = find("zstd-3", false).and_then(|z| x(one, z)) {
                side.push(format!("1 thread {v} of zstd-3"));
            }
        }
        if !side.is_empty() {
            let _ = writeln!(
                s,
                "  side by side, compress / decompress: ckvc {}",
                side.join("; ckvc ")
            );
        }
        if let Some(v) = verdict(&rs) {
            let _ = writeln!(s, "  {v}");
        }
    }
    s
}

/// The row group's verdict against the targets: ckvc (one thread) smaller
/// than every peer (every codec but ckvc and the entropy bound), and at
/// least as fast as zstd -3 both ways; what fails is named.
fn verdict(rs: &[&Row]) -> Option<String> {
    let one = rs.iter().find(|r| r.codec == "ckvc" && r.threads <= 1)?;
    let beaten: Vec<String> = rs
        .iter()
        .filter(|r| r.codec != "ckvc" && r.codec != "entropy" && r.ratio <= one.ratio)
        .map(|r| format!("{} {:.4}", r.codec, r.ratio))
        .collect();
    let below = if beaten.is_empty() {
        "yes".to_string()
    } else {
        format!("no ({})", beaten.join(", "))
    };
    let speed = match rs.iter().find(|r| r.codec == "zstd-3") {
        None => "-".to_string(),
        Some(z) => {
            let slow = |a: Option<f64>, b: Option<f64>| a.zip(b).is_some_and(|(a, b)| a < b);
            let mut not = Vec::new();
            if slow(one.compress_mib_s, z.compress_mib_s) {
                not.push("compress");
            }
            if slow(one.decompress_mib_s, z.decompress_mib_s) {
                not.push("decompress");
            }
            if not.is_empty() {
                "yes".to_string()
            } else {
                format!("no ({})", not.join(", "))
            }
        }
    };
    let mut v =
        format!("verdict: ckvc below every peer: {below}; ckvc at least zstd-3's speed: {speed}");
    if let Some(f) = full_floor(one) {
        let _ = write!(v, "; {f}");
    }
    Some(v)
}

/// The one-core speeds issue 16 asks a FULL row to keep, compress and
/// decompress in MiB/s: bf16 1.5 / 3 GiB/s, fp32 2 / 4 GiB/s.
fn full_floor_mib_s(dtype: &str) -> Option<(f64, f64)> {
    match dtype {
        "bf16" => Some((1536.0, 3072.0)),
        "fp32" => Some((2048.0, 4096.0)),
        _ => None,
    }
}

/// A FULL row's one-thread ckvc speeds against [`full_floor_mib_s`]:
/// "FULL floor C / D MiB/s: yes", or "no (...)" naming each direction
/// below it.
fn full_floor(one: &Row) -> Option<String> {
    if one.mode != "FULL" {
        return None;
    }
    let (c, d) = full_floor_mib_s(&one.dtype)?;
    let mut not = Vec::new();
    for (name, got, floor) in [
        ("compress", one.compress_mib_s, c),
        ("decompress", one.decompress_mib_s, d),
    ] {
        if let Some(g) = got.filter(|&g| g < floor) {
            not.push(format!("{name} {g:.0}"));
        }
    }
    let ok = if not.is_empty() {
        "yes".to_string()
    } else {
        format!("no ({})", not.join(", "))
    };
    Some(format!("FULL floor {c:.0} / {d:.0} MiB/s: {ok}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(codec: &str, threads: usize, c: Option<f64>, d: Option<f64>) -> Row {
        Row {
            mode: "FULL".into(),
            dtype: "bf16".into(),
            group: "weights".into(),
            codec: codec.into(),
            threads,
            bytes_in: 1 << 20,
            ratio: 0.5,
            compress_mib_s: c,
            decompress_mib_s: d,
        }
    }

    #[test]
    fn the_table_states_the_speed_ratios_of_rows_timed_side_by_side() {
        let rows = [
            row("ckvc", 1, Some(1000.0), Some(3000.0)),
            row("ckvc", 2, Some(1800.0), Some(4500.0)),
            row("zstd-3", 1, Some(250.0), Some(1000.0)),
            row("entropy", 1, None, None),
        ];
        let t = table(&rows);
        assert!(
            t.contains(
                "side by side, compress / decompress: ckvc 2 threads 1.80x / 1.50x of 1; \
                 ckvc 1 thread 4.00x / 3.00x of zstd-3"
            ),
            "{t}"
        );
        // Without the rows to compare, no line.
        assert!(!table(&rows[3..]).contains("side by side"));
    }

    #[test]
    fn the_verdict_names_the_peers_and_directions_ckvc_loses_to() {
        let with_ratio = |mut r: Row, ratio| {
            r.ratio = ratio;
            r
        };
        let rows = [
            with_ratio(row("ckvc", 1, Some(1000.0), Some(900.0)), 0.45),
            with_ratio(row("zstd-3", 1, Some(250.0), Some(1000.0)), 0.46),
            with_ratio(row("zstd-19", 1, Some(5.0), Some(1000.0)), 0.44),
            with_ratio(row("bzip2-9", 1, Some(5.0), Some(20.0)), 0.47),
            with_ratio(row("entropy", 1, None, None), 0.40),
        ];
        assert!(
            table(&rows).contains(
                "verdict: ckvc below every peer: no (zstd-19 0.4400); \
                 ckvc at least zstd-3's speed: no (decompress)"
            ),
            "{}",
            table(&rows)
        );
        let rows = [
            with_ratio(row("ckvc", 1, Some(1000.0), Some(1900.0)), 0.43),
            rows[1].clone(),
            rows[2].clone(),
        ];
        assert!(table(&rows)
            .contains("verdict: ckvc below every peer: yes; ckvc at least zstd-3's speed: yes"));
    }

    #[test]
    fn the_verdict_of_a_full_row_checks_its_dtypes_speed_floor() {
        let rows = [
            row("ckvc", 1, Some(1500.0), Some(3500.0)),
            row("zstd-3", 1, Some(250.0), Some(1000.0)),
        ];
        assert!(
            table(&rows).contains("; FULL floor 1536 / 3072 MiB/s: no (compress 1500)"),
            "{}",
            table(&rows)
        );
        let mut fast = rows.clone();
        fast[0].compress_mib_s = Some(1600.0);
        assert!(table(&fast).contains("; FULL floor 1536 / 3072 MiB/s: yes"));
        // fp32's floor is 2 / 4 GiB/s; a DELTA row and a u8 row have none.
        let mut fp32 = fast.clone();
        for r in &mut fp32 {
            r.dtype = "fp32".into();
        }
        assert!(table(&fp32)
            .contains("FULL floor 2048 / 4096 MiB/s: no (compress 1600, decompress 3500)"));
        let mut delta = fast.clone();
        for r in &mut delta {
            r.mode = "DELTA".into();
        }
        assert!(!table(&delta).contains("FULL floor"));
        let mut u8s = fast;
        for r in &mut u8s {
            r.dtype = "u8".into();
        }
        assert!(!table(&u8s).contains("FULL floor"));
    }
}
