//! Quick single-core speed probe of the codec on the corpus, for profiling:
//! `cargo run --release --example codec_speed -- ../shared/corpus/gpt-small bf16 full 20`
//! (dtype: a short name, bf16, fp32, u8, ...; mode: full|delta; passes).
//! Prints MiB/s of encode and decode. THREADS=N times the passes on a
//! pool of N threads. CPU_TIME=1 times by the thread's CPU time instead
//! of the wall clock (on a machine shared with other work; Linux).
//! FRAMES=1 prints each frame's tensor and header (what the encoder
//! chose), PEER=1 beside it zstd -19's size of the byte-grouped bytes;
//! MAX_BYTES=n keeps tensors of at most n bytes; ROWS=1 gives the encoder
//! each chunk's rows (row frames, as a commit does). The real benchmark is
//! `ckvc debug codec-bench`.

use std::time::Instant;

#[path = "../src/cli/bench/corpus.rs"]
#[allow(dead_code)]
mod corpus;
use ckvc::codec::{self, Options, Scratch};
use corpus::{load_run, with_bases, MIN_ELEMENTS};
use rayon::prelude::*;

thread_local! {
    /// Each pool thread's scratch (THREADS=N).
    static SCRATCH: std::cell::RefCell<(Scratch, Vec<u8>)> = Default::default();
}

/// Seconds on a clock: the wall clock, or with CPU_TIME set this thread's
/// CPU time (Linux).
fn seconds() -> f64 {
    if std::env::var_os("CPU_TIME").is_some() {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec for the call to fill in.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        return t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9;
    }
    thread_local!(static START: Instant = Instant::now());
    START.with(|s| s.elapsed().as_secs_f64())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .map_or("../shared/corpus/gpt-small", |s| s.as_str());
    let dtype = args.get(2).map_or("bf16", |s| s.as_str());
    let delta = args.get(3).is_some_and(|s| s == "delta");
    // GROUP=weights|optimizer: only the tensors of that row.
    let group = std::env::var("GROUP").ok();
    // MAX_BYTES=n: only tensors of at most n bytes (per-frame fixed costs).
    let max_bytes: Option<usize> = std::env::var("MAX_BYTES").ok().and_then(|v| v.parse().ok());
    let passes: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(10);
    let run = load_run(dir.as_ref(), MIN_ELEMENTS).expect("corpus loads");
    let concat = std::env::var("CONCAT").is_ok();
    let mut jobs = Vec::new();
    let mut keys: Vec<&str> = Vec::new();
    // CHUNK=bytes splits tensors into chunks as a repository does.
    let chunk: usize = std::env::var("CHUNK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX);
    for (t, base) in with_bases(&run, delta)
        .filter(|(t, _)| t.dtype.short_name() == dtype)
        .filter(|(t, _)| group.as_deref().is_none_or(|g| g == t.group))
        .filter(|(t, _)| max_bytes.is_none_or(|m| t.data.len() <= m))
    {
        let cb = (chunk / t.dtype.width()).max(1) * t.dtype.width();
        for (i, c) in t.data.chunks(cb).enumerate() {
            let b = base.map(|b| &b[i * cb..(i * cb + c.len()).min(b.len())]);
            let rows = codec::Rows::of_chunk(&t.shape, (i * cb / t.dtype.width()) as u64);
            jobs.push((t.dtype, c, b, rows));
            keys.push(&t.key);
        }
    }
    let joined: Vec<u8>;
    let joined_base: Vec<u8>;
    if concat {
        // One big chunk: the asymptotic speed without per-chunk overheads.
        joined = jobs.iter().flat_map(|j| j.1.iter().copied()).collect();
        joined_base = jobs
            .iter()
            .flat_map(|j| j.2.unwrap_or(j.1).iter().copied())
            .collect();
        let d = jobs[0].0;
        jobs = vec![(
            d,
            joined.as_slice(),
            delta.then_some(joined_base.as_slice()),
            None,
        )];
    }
    let bytes: usize = jobs.iter().map(|j| j.1.len()).sum();
    // NO_SPARSE=1: no sparse blocks; NO_ROW_CONTEXT=1: no row-context
    // blocks (with ROWS=1).
    let mut o = Options {
        sparse: std::env::var_os("NO_SPARSE").is_none(),
        row_context: std::env::var_os("NO_ROW_CONTEXT").is_none(),
        ..Options::default()
    };
    // Knob experiments: RANS_MIN_GAIN=0.05 PLAIN_RANS_MIN_GAIN=0.02 MIN_GAIN=0.01 NO_RANS=1
    // ELEMENT_MAP=never
    // XOR_ONLY=1 (no delta search)
    if let Some(v) = std::env::var("RANS_MIN_GAIN")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        o.rans_min_gain = v;
    }
    if let Some(v) = std::env::var("PLAIN_RANS_MIN_GAIN")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        o.plain_rans_min_gain = v;
    }
    if let Some(v) = std::env::var("MIN_GAIN").ok().and_then(|v| v.parse().ok()) {
        o.min_gain = v;
    }
    o.rans = std::env::var("NO_RANS").is_err();
    // ELEMENT_MAP=never|always (default: auto, the encoder's choice).
    match std::env::var("ELEMENT_MAP").as_deref() {
        Ok("never") => o.element_map = codec::ElementMap::Never,
        Ok("always") => o.element_map = codec::ElementMap::Always,
        _ => {}
    }
    if std::env::var("XOR_ONLY").is_ok() {
        o.delta = codec::DeltaSearch::Xor;
    }
    if std::env::var_os("ROWS").is_none() {
        jobs.iter_mut().for_each(|j| j.3 = None);
    }
    let mut s = Scratch::default();
    let mut frames: Vec<Vec<u8>> = vec![Vec::new(); jobs.len()];
    // The fastest pass counts: on a shared machine noise only slows.
    let mut enc = f64::MAX;
    let enc_passes = if std::env::var("DECODE_ONLY").is_ok() {
        1
    } else {
        passes
    };
    // THREADS=N: every pass on a rayon pool of N threads, back to back
    // (the bench interleaves its codecs' passes instead).
    let pool = std::env::var("THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(|n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("a rayon pool")
        });
    for _ in 0..enc_passes {
        let t = seconds();
        match &pool {
            Some(p) => p.install(|| {
                jobs.par_iter()
                    .zip(frames.par_iter_mut())
                    .for_each(|(j, f)| {
                        SCRATCH.with_borrow_mut(|(s, _)| {
                            codec::encode_shaped_into(j.1, j.2, j.0, j.3, &o, f, s)
                        })
                    })
            }),
            None => {
                for (j, f) in jobs.iter().zip(frames.iter_mut()) {
                    codec::encode_shaped_into(j.1, j.2, j.0, j.3, &o, f, &mut s);
                }
            }
        }
        enc = enc.min(seconds() - t);
    }
    let mut out = Vec::new();
    let mut dec = f64::MAX;
    let dec_passes = if std::env::var("ENCODE_ONLY").is_ok() {
        1
    } else {
        passes
    };
    for _ in 0..dec_passes {
        let t = seconds();
        match &pool {
            Some(p) => p.install(|| {
                jobs.par_iter().zip(&frames).for_each(|(j, f)| {
                    SCRATCH.with_borrow_mut(|(s, out)| {
                        codec::decode_into(f, j.2, codec::HARD_MAX_RAW_LEN, out, s)
                            .expect("decodes");
                    })
                })
            }),
            None => {
                for (j, f) in jobs.iter().zip(&frames) {
                    codec::decode_into(f, j.2, codec::HARD_MAX_RAW_LEN, &mut out, &mut s)
                        .expect("decodes");
                }
            }
        }
        dec = dec.min(seconds() - t);
    }
    // Every frame gives its chunk back (outside the timed passes).
    for (j, f) in jobs.iter().zip(&frames) {
        codec::decode_into(f, j.2, codec::HARD_MAX_RAW_LEN, &mut out, &mut s).expect("decodes");
        assert!(out == j.1, "a frame decodes to its chunk");
    }
    let comp: usize = frames.iter().map(|f| f.len()).sum();
    // FRAMES=1: each frame's tensor, size and header (what the encoder
    // chose); with PEER=1 also zstd -19's size on the byte-grouped bytes
    // (codec-bench's peer), to find the tensors a row loses on.
    if std::env::var_os("FRAMES").is_some() {
        let peer = std::env::var_os("PEER").is_some();
        let mut grouped = Vec::new();
        for ((j, f), key) in jobs.iter().zip(&frames).zip(&keys) {
            let z = if peer {
                codec::group_streams_into(j.1, j.2, j.0, &mut grouped);
                let z = zstd::bulk::compress(&grouped, 19)
                    .expect("zstd compresses")
                    .len();
                format!(" zstd-19 {z}{}", if z < f.len() { " LOSS" } else { "" })
            } else {
                String::new()
            };
            println!(
                "{key} {} bytes -> {}{z} {:?}",
                j.1.len(),
                f.len(),
                codec::FrameInfo::parse(f)
            );
        }
    }
    let mib = bytes as f64 / (1 << 20) as f64;
    println!(
        "{dtype} {} {:.1} MiB ratio {:.4} ({comp} bytes) encode {:.0} MiB/s decode {:.0} MiB/s",
        if delta { "DELTA" } else { "FULL" },
        mib,
        comp as f64 / bytes as f64,
        mib / enc,
        mib / dec
    );
}
