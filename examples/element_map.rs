//! How much the element map (format version 4) finds and saves on a run:
//! `cargo run --release --example element_map -- ../shared/corpus/bert-ft`.
//! Per mode, dtype and group (chunks of 4 MiB, as the repository cuts
//! them): the share of skipped elements (zero, or equal to the base in
//! DELTA), the runs they form, the chunks whose map the encoder chooses,
//! and the frame bytes with the map never, as chosen (auto) and always.

#[path = "../src/cli/bench/corpus.rs"]
#[allow(dead_code)]
mod corpus;
use ckvc::codec::{encode, DType, ElementMap, Options};
use corpus::{load_run, with_bases, MIN_ELEMENTS};

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "../shared/corpus/gpt-small".into());
    let run = load_run(dir.as_ref(), MIN_ELEMENTS).expect("the run loads");
    let with = |m| Options {
        element_map: m,
        ..Options::default()
    };
    let chunk = 4 << 20;
    println!(
        "{:<6} {:<5} {:<10} {:>9} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "mode",
        "dtype",
        "group",
        "MiB",
        "skipped",
        "elem/run",
        "map chks",
        "never",
        "auto",
        "always"
    );
    for delta in [false, true] {
        let mut groups: Vec<(DType, &str)> = Vec::new();
        for ck in &run {
            for t in &ck.tensors {
                if !groups.contains(&(t.dtype, t.group)) {
                    groups.push((t.dtype, t.group));
                }
            }
        }
        for (dtype, group) in groups {
            let (mut raw, mut elems, mut skipped, mut runs, mut chunks, mut mapped) =
                (0usize, 0usize, 0usize, 0usize, 0usize, 0usize);
            let mut size = [0usize; 3];
            for (t, base) in
                with_bases(&run, delta).filter(|(t, _)| t.dtype == dtype && t.group == group)
            {
                let w = dtype.width();
                let cb = chunk / w * w;
                for (i, c) in t.data.chunks(cb).enumerate() {
                    let b = base.map(|b| &b[i * cb..i * cb + c.len()]);
                    raw += c.len();
                    let n = c.len() / w;
                    elems += n;
                    let mut prev = false;
                    for (j, e) in c.chunks_exact(w).enumerate() {
                        let s = match b {
                            Some(b) => e == &b[j * w..(j + 1) * w],
                            None => e.iter().all(|&x| x == 0),
                        };
                        skipped += s as usize;
                        runs += (s && !prev) as usize;
                        prev = s;
                    }
                    chunks += 1;
                    for (k, m) in [ElementMap::Never, ElementMap::Auto, ElementMap::Always]
                        .into_iter()
                        .enumerate()
                    {
                        let f = encode(c, b, dtype, &with(m));
                        if k == 1 && f[5] & 8 != 0 {
                            mapped += 1;
                        }
                        size[k] += f.len();
                    }
                }
            }
            if raw == 0 {
                continue;
            }
            println!(
                "{:<6} {:<5} {:<10} {:>9.1} {:>7.1}% {:>10.1} {:>4}/{:<4} {:>9.4} {:>9.4} {:>9.4}",
                if delta { "DELTA" } else { "FULL" },
                dtype.short_name(),
                group,
                raw as f64 / (1 << 20) as f64,
                100.0 * skipped as f64 / elems.max(1) as f64,
                skipped as f64 / runs.max(1) as f64,
                mapped,
                chunks,
                size[0] as f64 / raw as f64,
                size[1] as f64 / raw as f64,
                size[2] as f64 / raw as f64,
            );
        }
    }
}
