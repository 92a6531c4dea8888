//! Measurement behind the codec's `literals_pay`: where zstd -3 codes the
//! bytes it finds no match for (its literals) with a Huffman table, and
//! what that saves, beside the two-part-code reckoning the encoder uses to
//! tell zstd not to try (at most `8 N - H` bits saved, against a table of
//! about `(K - 1) / 2 log2 N` bits):
//! `cargo run --release --example zstd_literals`. Literals of 2.5, 16 and
//! 64 KiB from 11 distributions (uniform over 16-256 values, or over 256
//! with exponential skews), followed by as many zeros (the runs of a
//! whole-zstd frame's constant streams).

use zstd::zstd_safe::{CParameter, ParamSwitch};

fn zstd3(data: &[u8], literals: bool) -> usize {
    let mut c = zstd::bulk::Compressor::new(3).expect("zstd level 3");
    if !literals {
        c.set_parameter(CParameter::LiteralCompressionMode(ParamSwitch::Disable))
            .expect("a known parameter");
    }
    c.compress(data).expect("zstd compresses").len()
}

fn main() {
    let mut x: u64 = 88172645463325252;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    println!("| literals | distribution | K | 8N - H (bytes) | table (bytes) | says | zstd's literal coding saved (bytes) |");
    println!("|---|---|---|---|---|---|---|");
    for n in [2528usize, 16384, 65536] {
        for (name, k, skew) in [
            ("uniform 256", 256, 0.0),
            ("skew 0.05", 256, 0.05),
            ("skew 0.1", 256, 0.1),
            ("skew 0.2", 256, 0.2),
            ("skew 0.5", 256, 0.5),
            ("skew 1", 256, 1.0),
            ("skew 2", 256, 2.0),
            ("uniform 200", 200, 0.0),
            ("uniform 128", 128, 0.0),
            ("uniform 64", 64, 0.0),
            ("uniform 16", 16, 0.0),
        ] {
            // Value i with weight exp(-8 skew i / 256).
            let w: Vec<f64> = (0..k)
                .map(|i| (-8.0 * skew * i as f64 / 256.0).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let cdf: Vec<f64> = w
                .iter()
                .scan(0.0, |a, v| {
                    *a += v / total;
                    Some(*a)
                })
                .collect();
            let mut data: Vec<u8> = (0..n)
                .map(|_| {
                    let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
                    cdf.iter().position(|&c| c >= u).unwrap_or(k - 1) as u8
                })
                .collect();
            let mut h = [0u32; 256];
            for &b in &data {
                h[b as usize] += 1;
            }
            let nf = n as f64;
            let kk = h.iter().filter(|&&c| c > 0).count();
            let saved = 8.0 * nf - ckvc::codec::entropy_bits(&h);
            let table = (kk as f64 - 1.0) / 2.0 * nf.log2();
            data.resize(2 * n, 0);
            let gain = zstd3(&data, false) as i64 - zstd3(&data, true) as i64;
            let says = if saved > table { "code" } else { "raw" };
            println!(
                "| {n} | {name} | {kk} | {:.0} | {:.0} | {says} | {gain} |",
                saved / 8.0,
                table / 8.0
            );
        }
    }
}
