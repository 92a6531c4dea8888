//! Time `Repository::commit_buffers` (the Python package's save) on files
//! dumped to disk: `cargo run --release --example save_speed -- REPO DIR1
//! [DIR2 ...]`. Each DIR's files are read into memory first, then committed
//! in turn (step 1, 2, ...) into a fresh repository at REPO, so the first
//! is a full encode and the later ones are deltas. Prints per commit: wall
//! time, process CPU time / wall (how busy the cores were) and MiB/s.

use std::path::Path;
use std::time::Instant;

use std::sync::Arc;

use ckvc::repo::{CommitOptions, Config, Repository};
use ckvc::store::{Mode, RocksOptions, RocksStore};

fn cpu_secs() -> f64 {
    // utime + stime of this process, in clock ticks (100 Hz on Linux).
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((repo_dir, dirs)) = args.split_first() else {
        eprintln!("usage: save_speed REPO DIR1 [DIR2 ...]");
        std::process::exit(2);
    };
    let _ = std::fs::remove_dir_all(repo_dir);
    let options = RocksOptions {
        direct_writes: std::env::var_os("SAVE_SPEED_BUFFERED").is_none(),
        ..RocksOptions::default()
    };
    let store = RocksStore::open_with(Path::new(repo_dir).join("db"), Mode::ReadWrite, &options)
        .expect("open store");
    let repo = Repository::init_store(
        Path::new(repo_dir).into(),
        Arc::new(store),
        Config::default(),
    )
    .expect("init");
    for (i, d) in dirs.iter().enumerate() {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
            .expect("read dir")
            .map(|e| {
                let e = e.expect("entry");
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).expect("read"))
            })
            .collect();
        files.sort();
        let total: usize = files.iter().map(|f| f.1.len()).sum();
        let slices: Vec<(&str, &[u8])> = files
            .iter()
            .map(|(n, b)| (n.as_str(), b.as_slice()))
            .collect();
        let opts = CommitOptions {
            step: Some(i as u64 + 1),
            ..CommitOptions::default()
        };
        let (c0, t0) = (cpu_secs(), Instant::now());
        let report = repo.commit_buffers(&slices, &opts).expect("commit");
        let wall = t0.elapsed().as_secs_f64();
        let cpu = cpu_secs() - c0;
        println!(
            "{d}: {wall:.3} s, cpu {cpu:.2} s, cpu/wall {:.2}, {:.0} MiB/s, stored {:.1} MiB, new chunks {}, max depth {}",
            cpu / wall,
            total as f64 / (1 << 20) as f64 / wall,
            report.stats.stored_bytes as f64 / (1 << 20) as f64,
            report.stats.new_chunks,
            report.stats.max_depth,
        );
    }
}
