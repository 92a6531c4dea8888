//! What a frame of root rows and row deltas would store, measured with
//! today's codec: for each 2-D float tensor of one checkpoint file, the
//! FULL frame beside (a) the root rows (every 16th row in order of sign
//! along the rows' mean direction, then norm) as a FULL frame, plus (b)
//! the other rows as a DELTA frame against their roots' rows gathered,
//! plus (c) each row's root index and each root's place (bits, rounded
//! up), and the smaller of the FULL frame and that per tensor (what an
//! encoder choosing between them would store). zstd -19 of the
//! byte-grouped tensor beside them (codec-bench's peer). Whole tensors,
//! not 4 MiB chunks. `every` (default 16) sets the roots' spacing.
//!
//! `cargo run --release --example rowref_probe -- RUN/checkpoint-300/optimizer.pt [every]`
//!
//! `scripts/row_structure.py` estimates the same with an order-0 model of
//! the differences; this runs the real coders (delta search, context
//! coding against the root's exponent, element maps).

use ckvc::codec::{self, DType, Options};
use ckvc::format;

/// Element `i` of `raw` as f32 (F32, BF16, F16).
fn value(raw: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(raw[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        DType::BF16 => {
            f32::from_bits((u16::from_le_bytes([raw[2 * i], raw[2 * i + 1]]) as u32) << 16)
        }
        _ => half_to_f32(u16::from_le_bytes([raw[2 * i], raw[2 * i + 1]])),
    }
}

fn half_to_f32(h: u16) -> f32 {
    let s = ((h >> 15) as u32) << 31;
    let e = ((h >> 10) & 0x1f) as i32;
    let m = (h & 0x3ff) as u32;
    let bits = match e {
        0 if m == 0 => s,
        0 => return if s != 0 { -1.0 } else { 1.0 } * m as f32 * 2f32.powi(-24),
        31 => s | 0x7f80_0000 | (m << 13),
        _ => s | (((e - 15 + 127) as u32) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("a checkpoint file");
    let every: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(16);
    let bytes = std::fs::read(path).expect("readable");
    let name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let layout = format::parse(&name, &mut std::io::Cursor::new(&bytes), bytes.len() as u64)
        .expect("a checkpoint file");
    let opts = Options::default();
    let mut tot = [0usize; 5];
    println!(
        "{:40} {:>14} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "tensor", "shape", "bytes", "FULL", "zstd-19", "rowref", "smaller"
    );
    for t in layout.tensors() {
        let float = matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16);
        if !float || t.shape.len() != 2 || t.len / (t.dtype.width() as u64) < 1 << 16 {
            continue;
        }
        let raw = &bytes[t.offset as usize..(t.offset + t.len) as usize];
        let w = t.dtype.width();
        let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize);
        if rows < 2 * every || rows * cols * w != raw.len() {
            continue;
        }
        let full = codec::encode(raw, None, t.dtype, &opts).len();
        let mut grouped = Vec::new();
        codec::group_streams_into(raw, None, t.dtype, &mut grouped);
        let z19 = zstd::bulk::compress(&grouped, 19).expect("zstd").len();
        // Rows by (sign along the mean direction, norm).
        let row = |r: usize| &raw[r * cols * w..(r + 1) * cols * w];
        let mut mean = vec![0f64; cols];
        for r in 0..rows {
            for (j, m) in mean.iter_mut().enumerate() {
                *m += value(row(r), t.dtype, j) as f64;
            }
        }
        let key: Vec<(bool, f64)> = (0..rows)
            .map(|r| {
                let (mut dot, mut norm) = (0f64, 0f64);
                for (j, m) in mean.iter().enumerate() {
                    let v = value(row(r), t.dtype, j) as f64;
                    dot += v * m.signum();
                    norm += v * v;
                }
                (dot >= 0.0, norm)
            })
            .collect();
        let mut order: Vec<usize> = (0..rows).collect();
        order.sort_by(|&a, &b| {
            key[a].0.cmp(&key[b].0).then(
                key[a]
                    .1
                    .partial_cmp(&key[b].1)
                    .unwrap_or(std::cmp::Ordering::Equal),
            )
        });
        let (mut roots, mut deps, mut base) = (Vec::new(), Vec::new(), Vec::new());
        let mut nroots = 0usize;
        for (k, &r) in order.iter().enumerate() {
            if k % every == 0 {
                roots.extend_from_slice(row(r));
                nroots += 1;
            } else {
                deps.extend_from_slice(row(r));
                base.extend_from_slice(row(order[k - k % every]));
            }
        }
        let a = codec::encode(&roots, None, t.dtype, &opts).len();
        let b = codec::encode(&deps, Some(&base), t.dtype, &opts).len();
        let bits =
            |n: usize| usize::BITS as usize - n.max(2).saturating_sub(1).leading_zeros() as usize;
        let index = ((rows - nroots) * bits(nroots) + nroots * bits(rows)).div_ceil(8);
        let rr = a + b + index;
        println!(
            "{:40} {:>14} {:>10} {:>10} {:>10} {:>10} {:>10}",
            &t.name[..t.name.len().min(40)],
            format!("{rows}x{cols}"),
            raw.len(),
            full,
            z19,
            rr,
            full.min(rr)
        );
        for (s, v) in tot.iter_mut().zip([raw.len(), full, z19, rr, full.min(rr)]) {
            *s += v;
        }
    }
    println!(
        "{:40} {:>14} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "total", "", tot[0], tot[1], tot[2], tot[3], tot[4]
    );
}
