//! Measurement for a palette mode (issue 16): what this build makes of
//! tensors with few distinct values, beside the bound a palette mode would
//! reach (the order-0 entropy of the value indices, plus the palette once)
//! and zstd -19: `cargo run --release --example palette_bound`.
//! 2^18 elements of N(0, 0.02), quantized to 16 or 256 uniform levels (an
//! arbitrary step), clustered to 16 arbitrary centroids, or a 0/1 mask.

use std::collections::HashMap;

use ckvc::codec::{encode, DType, Options, Palette};

/// xorshift64*, 32 bits at a time.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }

    fn unit(&mut self) -> f32 {
        self.next() as f32 / u32::MAX as f32
    }

    /// Roughly N(0, scale): the sum of four uniforms, centred.
    fn gaussian(&mut self, scale: f32) -> f32 {
        ((0..4).map(|_| self.unit()).sum::<f32>() - 2.0) * scale
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| {
            let b = x.to_bits();
            (((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16).to_le_bytes()
        })
        .collect()
}

fn main() {
    let n = 1 << 18;
    let mut r = Rng(0x9E37_79B9_7F4A_7C15);
    let g: Vec<f32> = (0..n).map(|_| r.gaussian(0.02)).collect();
    let mut cases: Vec<(String, DType, Vec<u8>)> = Vec::new();
    for levels in [16u32, 256] {
        let q = ckvc::testing::quantize(&g, levels);
        cases.push((format!("f32, {levels} levels"), DType::F32, f32_bytes(&q)));
        cases.push((
            format!("bf16, {levels} levels"),
            DType::BF16,
            bf16_bytes(&q),
        ));
    }
    let centroids: Vec<f32> = (0..16).map(|_| (r.unit() - 0.5) * 0.1).collect();
    let c: Vec<f32> = (0..n)
        .map(|_| centroids[(r.next() % 16) as usize])
        .collect();
    cases.push(("f32, 16 centroids".into(), DType::F32, f32_bytes(&c)));
    let m: Vec<f32> = (0..n)
        .map(|_| if r.next() % 10 == 0 { 1.0 } else { 0.0 })
        .collect();
    cases.push(("f32 0/1 mask, 10% ones".into(), DType::F32, f32_bytes(&m)));
    println!("data                      distinct   ckvc  no palette  palette bound  zstd -19");
    for (name, dtype, raw) in cases {
        let w = dtype.width();
        let mut counts: HashMap<&[u8], u64> = HashMap::new();
        for e in raw.chunks_exact(w) {
            *counts.entry(e).or_default() += 1;
        }
        let total = (raw.len() / w) as f64;
        let h: f64 = counts
            .values()
            .map(|&c| {
                let p = c as f64 / total;
                -p * p.log2()
            })
            .sum();
        let palette = h * total / 8.0 + (counts.len() * w) as f64;
        let f = encode(&raw, None, dtype, &Options::default());
        let plain = Options {
            palette: Palette::Never,
            ..Options::default()
        };
        let p = encode(&raw, None, dtype, &plain);
        let z = zstd::bulk::compress(&raw, 19).expect("zstd").len();
        let len = raw.len() as f64;
        println!(
            "{name:<26} {:>6}  {:.4}  {:.4}      {:.4}         {:.4}",
            counts.len(),
            f.len() as f64 / len,
            p.len() as f64 / len,
            palette / len,
            z as f64 / len
        );
    }
}
