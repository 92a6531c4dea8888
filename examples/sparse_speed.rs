//! Micro-probe: decode time of one 64 Ki-symbol block coded sparse
//! against the same block coded with rANS, by how many of its symbols are
//! not the dominant one (`cargo run --release --example sparse_speed`).
//! The encoder's `sparse_allowance` (src/codec/block.rs) takes its
//! per-symbol and per-exception costs from here. The blocks are
//! synthetic: zeros with `others` places, drawn at random, set to 1-3
//! (what is timed is the decoders' work per symbol and per exception).

use std::time::Instant;

use ckvc::codec::probe;

/// The fastest of `reps` runs of `f`, in microseconds.
fn best_us(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let n = 1 << 16;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    println!("| others | sparse bytes | sparse us | rANS bytes | rANS us |");
    println!("|---|---|---|---|---|");
    for others in [100usize, 500, 1000, 2000, 4000, 8000] {
        let mut block = vec![0u8; n];
        for _ in 0..others {
            block[(next() % n as u64) as usize] = 1 + (next() % 3) as u8;
        }
        let sparse = probe::sparse_encode(&block).expect("a block with others");
        let mut rans = Vec::new();
        probe::rans_encode(&block, &mut rans);
        let (mut out, mut table, mut buf, mut slots) = (
            vec![0u8; n],
            probe::DecodeTable::default(),
            Vec::new(),
            Vec::new(),
        );
        let s = best_us(500, || {
            probe::sparse_decode(&sparse, &mut out, &mut table, &mut buf).expect("decodes")
        });
        assert_eq!(out, block, "sparse round trip");
        let r = best_us(500, || {
            probe::rans_decode(&rans, &mut out, &mut slots).expect("decodes")
        });
        assert_eq!(out, block, "rANS round trip");
        println!(
            "| {others} | {} | {s:.1} | {} | {r:.1} |",
            sparse.len(),
            rans.len()
        );
    }
}
