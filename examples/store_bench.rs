//! RocksStore with BlobDB vs plain SST files on chunk-like values:
//! `cargo run --release --example store_bench -- [MiB=200] [DIR] [ROUNDS=1]`.
//! Rounds interleave the configurations, so load from other processes on a
//! shared machine spreads over all of them.
//!
//! Writes MiB of incompressible values of 64-512 KiB (what encoded chunks
//! look like) in batches of about 8 MiB, each batch synced like a commit,
//! then flushes; then reads every value back in a shuffled order. Prints per
//! configuration: write MiB/s (including the final flush), bytes the process
//! wrote to the block device (`/proc/self/io`: WAL + tables + blob files +
//! compaction, i.e. write amplification), bytes on disk, and read MiB/s.
//! Rewriting half the values and deleting a quarter (what gc does) shows the
//! cost of compaction over large values.

use std::time::Instant;

use ckvc::store::{Batch, Mode, RocksOptions, RocksStore, Space, Store};
use ckvc::testing::Rng;

fn disk_write_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes: "))
        .and_then(|v| v.trim().parse().ok())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

struct Row {
    name: &'static str,
    write_mibs: f64,
    written: Option<u64>,
    on_disk: u64,
    read_mibs: f64,
    churn_written: Option<u64>,
    churn_on_disk: u64,
}

fn run(name: &'static str, options: &RocksOptions, dir: &std::path::Path, total: u64) -> Row {
    let path = dir.join(name);
    let store = RocksStore::open_with(&path, Mode::ReadWrite, options).expect("open");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // sizes and contents are the same for every configuration (same seed)
    let mut values: Vec<(Vec<u8>, usize)> = Vec::new();
    let mut sum = 0u64;
    while sum < total {
        let len = (64 << 10) + (rng.next_u64() % (448 << 10)) as usize;
        let mut key = [0u8; 32];
        rng.fill(&mut key);
        values.push((key.to_vec(), len));
        sum += len as u64;
    }
    let mut buf = vec![0u8; 512 << 10];

    let w0 = disk_write_bytes();
    let t = Instant::now();
    let mut batch = Batch::new();
    for (key, len) in &values {
        rng.fill(&mut buf[..*len]);
        batch.put(Space::Chunks, key, buf[..*len].to_vec());
        if batch.payload_bytes() >= 8 << 20 {
            store.write(std::mem::take(&mut batch)).expect("write");
        }
    }
    store.write(batch).expect("write");
    store.flush().expect("flush");
    let write_secs = t.elapsed().as_secs_f64();
    let written = w0.zip(disk_write_bytes()).map(|(a, b)| b - a);
    let on_disk = store.size_on_disk().expect("size");

    let mut order: Vec<usize> = (0..values.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let t = Instant::now();
    let mut out = Vec::new();
    let mut read = 0u64;
    for &i in &order {
        assert!(store
            .get(Space::Chunks, &values[i].0, &mut out)
            .expect("get"));
        read += out.len() as u64;
    }
    let read_secs = t.elapsed().as_secs_f64();
    assert_eq!(read, sum);

    // churn: overwrite every second value, delete every fourth
    let w0 = disk_write_bytes();
    let mut batch = Batch::new();
    for (i, (key, len)) in values.iter().enumerate() {
        if i % 4 == 3 {
            batch.delete(Space::Chunks, key);
        } else if i % 2 == 0 {
            rng.fill(&mut buf[..*len]);
            batch.put(Space::Chunks, key, buf[..*len].to_vec());
        }
        if batch.payload_bytes() >= 8 << 20 {
            store.write(std::mem::take(&mut batch)).expect("write");
        }
    }
    store.write(batch).expect("write");
    store.flush().expect("flush");
    let churn_written = w0.zip(disk_write_bytes()).map(|(a, b)| b - a);
    let churn_on_disk = store.size_on_disk().expect("size");
    drop(store);
    let _ = std::fs::remove_dir_all(&path);
    Row {
        name,
        write_mibs: mib(sum) / write_secs,
        written,
        on_disk,
        read_mibs: mib(read) / read_secs,
        churn_written,
        churn_on_disk,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let total_mib: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    let tmp = match args.get(2) {
        Some(d) => tempfile::Builder::new().prefix("store-bench").tempdir_in(d),
        None => tempfile::Builder::new().prefix("store-bench").tempdir(),
    }
    .expect("temp dir");
    let rounds: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let total = total_mib << 20;
    let configs: [(&'static str, RocksOptions); 3] = [
        ("blobdb", RocksOptions::default()),
        (
            "plain-sst",
            RocksOptions {
                blob_files: false,
                ..RocksOptions::default()
            },
        ),
        (
            "blobdb-nosync",
            RocksOptions {
                sync: false,
                ..RocksOptions::default()
            },
        ),
    ];
    println!(
        "{total_mib} MiB of 64-512 KiB incompressible values, 8 MiB batches, in {}",
        tmp.path().display()
    );
    println!(
        "{:<14} {:>10} {:>14} {:>12} {:>10} | {:>16} {:>14}",
        "config",
        "write MiB/s",
        "disk writes MiB",
        "on disk MiB",
        "read MiB/s",
        "churn writes MiB",
        "churn disk MiB"
    );
    let fmt_opt = |b: Option<u64>| b.map_or("-".to_string(), |b| format!("{:.1}", mib(b)));
    for (name, options) in (0..rounds).flat_map(|_| configs.iter()) {
        let r = run(name, options, tmp.path(), total);
        println!(
            "{:<14} {:>10.1} {:>14} {:>12.1} {:>10.1} | {:>16} {:>14.1}",
            r.name,
            r.write_mibs,
            fmt_opt(r.written),
            mib(r.on_disk),
            r.read_mibs,
            fmt_opt(r.churn_written),
            mib(r.churn_on_disk)
        );
    }
}
