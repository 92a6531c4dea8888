//! Row frames (format version 8) on a real checkpoint file: for each
//! chunk of each 2-D float tensor, the plain frame's size beside the
//! frame `encode_shaped_into` chooses, and whether it is a row frame;
//! every frame decoded back and compared. Then the whole file's encode
//! and decode speed, one core, plain frames beside chosen ones (the
//! fastest of 5 passes each, alternating).
//!
//! `cargo run --release --example row_frames -- RUN/checkpoint-300/optimizer.pt [chunk MiB]`

use ckvc::codec::{self, FrameInfo, Options, Rows, Scratch};
use ckvc::format;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("a checkpoint file");
    let mib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4);
    let bytes = std::fs::read(path).expect("readable");
    let name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let layout = format::parse(&name, &mut std::io::Cursor::new(&bytes), bytes.len() as u64)
        .expect("a checkpoint file");
    let opts = Options::default();
    let mut s = Scratch::default();
    let (mut plain, mut shaped, mut back) = (Vec::new(), Vec::new(), Vec::new());
    let mut tot = [0usize; 3];
    println!(
        "{:44} {:>12} {:>6} {:>10} {:>10} {:>10} rows",
        "tensor", "shape", "chunk", "bytes", "plain", "chosen"
    );
    for t in layout.tensors() {
        let w = t.dtype.width();
        let raw = &bytes[t.offset as usize..(t.offset + t.len) as usize];
        let cb = (mib << 20) / w * w;
        for (c, chunk) in raw.chunks(cb.max(w)).enumerate() {
            let rows = Rows::of_chunk(&t.shape, (c * cb / w) as u64);
            codec::encode_into(chunk, None, t.dtype, &opts, &mut plain, &mut s);
            codec::encode_shaped_into(chunk, None, t.dtype, rows, &opts, &mut shaped, &mut s);
            codec::decode_into(&shaped, None, chunk.len() as u64, &mut back, &mut s)
                .expect("decodes");
            assert!(
                back == chunk,
                "{}: chunk {c} decodes to other bytes",
                t.name
            );
            let is_rows = FrameInfo::parse(&shaped).expect("a frame").rows;
            for (s, v) in tot.iter_mut().zip([chunk.len(), plain.len(), shaped.len()]) {
                *s += v;
            }
            if rows.is_some() && chunk.len() >= 1 << 16 {
                println!(
                    "{:44} {:>12} {:>6} {:>10} {:>10} {:>10} {}",
                    &t.name[..t.name.len().min(44)],
                    format!("{:?}", t.shape),
                    c,
                    chunk.len(),
                    plain.len(),
                    shaped.len(),
                    if is_rows { "yes" } else { "" }
                );
            }
        }
    }
    timings(&layout, &bytes, mib);
    println!(
        "{:44} {:>12} {:>6} {:>10} {:>10} {:>10} ({:.4} -> {:.4})",
        "total",
        "",
        "",
        tot[0],
        tot[1],
        tot[2],
        tot[1] as f64 / tot[0] as f64,
        tot[2] as f64 / tot[0] as f64
    );
}

/// Encode and decode MiB/s of every chunk of the file's tensors, plain
/// (no rows given) and shaped, the fastest of 5 alternating passes.
fn timings(layout: &format::Layout, bytes: &[u8], mib: usize) {
    let opts = Options::default();
    let mut s = Scratch::default();
    let mut chunks = Vec::new();
    for t in layout.tensors() {
        let w = t.dtype.width();
        let raw = &bytes[t.offset as usize..(t.offset + t.len) as usize];
        let cb = (mib << 20) / w * w;
        for (c, chunk) in raw.chunks(cb.max(w)).enumerate() {
            chunks.push((
                chunk,
                t.dtype,
                Rows::of_chunk(&t.shape, (c * cb / w) as u64),
            ));
        }
    }
    let total: usize = chunks.iter().map(|c| c.0.len()).sum();
    let mut best = [f64::MAX; 4];
    let mut frames: [Vec<Vec<u8>>; 2] = [Vec::new(), Vec::new()];
    let mut out = Vec::new();
    for _ in 0..5 {
        for (k, shaped) in [false, true].into_iter().enumerate() {
            let t = std::time::Instant::now();
            frames[k].resize_with(chunks.len(), Vec::new);
            for (&(raw, dtype, rows), f) in chunks.iter().zip(&mut frames[k]) {
                let rows = if shaped { rows } else { None };
                codec::encode_shaped_into(raw, None, dtype, rows, &opts, f, &mut s);
            }
            best[2 * k] = best[2 * k].min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            for f in &frames[k] {
                codec::decode_into(f, None, 1 << 30, &mut out, &mut s).expect("decodes");
            }
            best[2 * k + 1] = best[2 * k + 1].min(t.elapsed().as_secs_f64());
        }
    }
    let m = |secs: f64| total as f64 / secs / (1 << 20) as f64;
    println!(
        "one core, MiB/s: plain encode {:.0} decode {:.0}; with rows encode {:.0} decode {:.0}",
        m(best[0]),
        m(best[1]),
        m(best[2]),
        m(best[3])
    );
}
