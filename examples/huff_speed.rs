//! Micro-probe: Huffman block encode/decode speed on the exponent stream of
//! the corpus bf16 weights (`cargo run --release --example huff_speed`).

use std::time::Instant;

#[path = "../src/cli/bench/corpus.rs"]
#[allow(dead_code)]
mod corpus;
use ckvc::codec::probe;
use corpus::{load_run, MIN_ELEMENTS};

fn main() {
    let run = load_run("../shared/corpus/gpt-small".as_ref(), MIN_ELEMENTS).expect("corpus");
    let raw: Vec<u8> = run
        .iter()
        .flat_map(|c| c.tensors.iter())
        .filter(|t| t.dtype.short_name() == "bf16")
        .flat_map(|t| t.data.iter().copied())
        .collect();
    let mut s = [Vec::new(), Vec::new()];
    let t = Instant::now();
    for _ in 0..20 {
        probe::group2(&raw, &mut s);
    }
    let g = t.elapsed().as_secs_f64() / 20.0;
    let exp = &s[1];
    let blocks: Vec<&[u8]> = exp.chunks(1 << 16).collect();
    let mut frames = Vec::new();
    let mut scratch = probe::EncodeScratch::default();
    let mut e = f64::MAX;
    for _ in 0..10 {
        let t = Instant::now();
        frames.clear();
        for b in &blocks {
            let mut out = Vec::new();
            probe::huffman_encode(b, &mut out, &mut scratch);
            frames.push(out);
        }
        e = e.min(t.elapsed().as_secs_f64());
    }
    let mut table = probe::DecodeTable::default();
    let mut dst = vec![0u8; 1 << 16];
    // The fastest of 20 passes: noise on a shared machine only slows.
    let mut d = f64::MAX;
    for _ in 0..20 {
        let t = Instant::now();
        for (b, f) in blocks.iter().zip(&frames) {
            probe::huffman_decode(f, &mut dst[..b.len()], &mut table).expect("decodes");
        }
        d = d.min(t.elapsed().as_secs_f64());
    }
    // Each block decoded three times in a row: the table is built once, so
    // the difference to one pass is the cost of the table builds.
    let mut d3 = f64::MAX;
    for _ in 0..10 {
        let t = Instant::now();
        for (b, f) in blocks.iter().zip(&frames) {
            for _ in 0..3 {
                probe::huffman_decode(f, &mut dst[..b.len()], &mut table).expect("decodes");
            }
        }
        d3 = d3.min(t.elapsed().as_secs_f64());
    }
    // rANS on the same blocks.
    let rframes: Vec<Vec<u8>> = blocks
        .iter()
        .map(|b| {
            let mut o = Vec::new();
            probe::rans_encode(b, &mut o);
            o
        })
        .collect();
    let mut slots = Vec::new();
    let mut rd = f64::MAX;
    for _ in 0..10 {
        let t = Instant::now();
        for (b, f) in blocks.iter().zip(&rframes) {
            probe::rans_decode(f, &mut dst[..b.len()], &mut slots).expect("decodes");
        }
        rd = rd.min(t.elapsed().as_secs_f64());
    }
    let rbits: usize = rframes.iter().map(|f| f.len()).sum::<usize>() * 8;
    println!(
        "rans {:.3} bits/sym, dec {:.2} ns/sym",
        rbits as f64 / exp.len() as f64,
        rd * 1e9 / exp.len() as f64
    );
    let mut out = vec![0u8; raw.len()];
    let t = Instant::now();
    for _ in 0..20 {
        probe::ungroup2([&s[0], &s[1]], &mut out);
    }
    let u = t.elapsed().as_secs_f64() / 20.0;
    let n = exp.len() as f64;
    let bits: usize = frames.iter().map(|f| f.len()).sum::<usize>() * 8;
    println!("symbols {n}, {:.3} bits/sym", bits as f64 / n);
    println!("group   {:.2} ns/elem", g * 1e9 / n);
    println!("huff enc {:.2} ns/sym", e * 1e9 / n);
    println!("huff dec {:.2} ns/sym", d * 1e9 / n);
    println!(
        "  of which table builds {:.2} ns/sym ({:.1} us/block), loop {:.2} ns/sym",
        (3.0 * d - d3) / 2.0 * 1e9 / n,
        (3.0 * d - d3) / 2.0 * 1e6 / blocks.len() as f64,
        (d3 - d) / 2.0 * 1e9 / n
    );
    println!("ungroup {:.2} ns/elem", u * 1e9 / n);
}
