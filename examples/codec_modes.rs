//! Which block modes the encoder picks, per stream, on the corpus:
//! `cargo run --release --example codec_modes -- ../shared/corpus/gpt-small fp32 delta`.
//! Prints, per stream index, the symbols and payload bytes of each mode:
//! the decoder's work is in the Huffman and rANS rows.

#[path = "../src/cli/bench/corpus.rs"]
#[allow(dead_code)]
mod corpus;
use ckvc::codec::{self, FrameInfo, Options, BLOCK_LOG2};
use corpus::{load_run, with_bases, MIN_ELEMENTS};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .map_or("../shared/corpus/gpt-small", |s| s.as_str());
    let dtype = args.get(2).map_or("bf16", |s| s.as_str());
    let delta = args.get(3).is_some_and(|s| s == "delta");
    // GROUP=weights|optimizer: only the tensors of that row.
    let group = std::env::var("GROUP").ok();
    let run = load_run(dir.as_ref(), MIN_ELEMENTS).expect("corpus loads");
    let o = Options::default();
    // [stream][mode] -> (symbols, bytes)
    let mut stats = vec![[(0u64, 0u64); 10]; 8];
    let mut kinds = [0u64; 3];
    let mut whole = 0u64;
    for (t, base) in with_bases(&run, delta)
        .filter(|(t, _)| t.dtype.short_name() == dtype)
        .filter(|(t, _)| group.as_deref().is_none_or(|g| g == t.group))
    {
        let f = codec::encode(&t.data, base, t.dtype, &o);
        let info = FrameInfo::parse(&f).expect("own frame");
        let w = info.group_width;
        let mut n = t.data.len() / w;
        let mut pos = info.header_len + (info.raw_len as usize % w);
        kinds[match info.delta {
            codec::Delta::None => 0,
            codec::Delta::PerStream => {
                pos += w;
                1
            }
            codec::Delta::Ulp => 2,
        }] += 1;
        if info.element_map {
            // Kind, length, data; the streams hold the kept elements only:
            // those not zero (no base) or not equal to the base's.
            let len = u32::from_le_bytes(f[pos + 1..pos + 5].try_into().expect("4")) as usize;
            pos += 5 + len;
            let b = base.filter(|_| info.needs_base());
            n = (0..n)
                .filter(|&i| {
                    let e = &t.data[i * w..(i + 1) * w];
                    match b {
                        Some(b) => e != &b[i * w..(i + 1) * w],
                        None => e.iter().any(|&x| x != 0),
                    }
                })
                .count();
        }
        if info.whole_zstd {
            // One zstd frame of all streams (format version 6): no table.
            whole += 1;
            continue;
        }
        let block = 1usize << BLOCK_LOG2;
        let nb = n.div_ceil(block);
        for (k, st) in stats.iter_mut().enumerate().take(w) {
            for b in 0..nb {
                let at = pos + 4 * (k * nb + b);
                let e = u32::from_le_bytes(f[at..at + 4].try_into().expect("4"));
                let syms = block.min(n - b * block) as u64;
                let s = &mut st[(e & 0xff) as usize];
                s.0 += syms;
                s.1 += (e >> 8) as u64;
            }
        }
    }
    println!(
        "frames: none {} per-stream {} ulp {}; one zstd frame {whole}",
        kinds[0], kinds[1], kinds[2]
    );
    let names = [
        "raw",
        "const",
        "huffman",
        "rans",
        "ctx-rans",
        "packed",
        "zstd",
        "sparse",
        "rans-gamma",
        "rans-up",
    ];
    for (k, st) in stats.iter().enumerate() {
        for (m, &(syms, bytes)) in st.iter().enumerate() {
            if syms > 0 {
                println!(
                    "stream {k} {:>8}: {:>10} symbols  {:.3} bits/symbol",
                    names[m],
                    syms,
                    8.0 * bytes as f64 / syms as f64
                );
            }
        }
    }
}
