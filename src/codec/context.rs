//! Context modelling for rANS: the classes of a block's context (in a
//! delta frame the base's byte at the same place, for an exponent-change
//! stream the old exponent; in a row-context block the block's own symbol
//! a row up), one frequency table per class, and the context-coded block
//! payloads (`BlockMode::RansCtx`, and `BlockMode::RansUp` behind its
//! distance) built on the interleaved coder in [`super::rans`].
//!
//! Owns: choosing the context values that get a class ([`CtxModel`]),
//! classifying context bytes, planning and sizing a context-coded block
//! ([`ctx_plan`]), and the payload's class header (context values and a
//! presence flag and table per class). Must not: code symbols itself (the
//! coder in `rans` does, with one table per class), or choose between
//! block modes (that is `block`'s).

use super::rans::{
    decode_lanes, decode_up_lanes, enc_table, encode_lanes, grow, lanes_written, read_freqs,
    table_bytes, write_freqs, ClassMap, EncSym, ALL_SLOTS, MAX_CLASSES,
};
use super::simd::CtxClasses;
use super::stats::{coded_bits, entropy_bits, histogram, normalize, sampled_histogram, SCALE_BITS};
use super::DecodeError;

const M: u32 = 1 << SCALE_BITS;

/// A context-modelled rANS plan for one block: symbol `i` is coded with the
/// table of the class of `ctx[i]` (the base chunk's byte at the same place:
/// for an exponent-change stream, the old exponent).
pub struct CtxPlan {
    freqs: Vec<Option<[u32; 256]>>,
    /// Estimated payload bytes.
    pub bytes: f64,
    /// The block's histogram (the classes' summed).
    pub hist: [u32; 256],
}

/// Normalise a class histogram; a class with one symbol lends one slot to
/// a neighbour, since a frequency of 4096 does not fit the slot format.
fn normalize_class(h: &[u32; 256]) -> Option<[u32; 256]> {
    let present = h.iter().filter(|&&c| c > 0).count();
    match present {
        0 => None,
        1 => {
            let s = h.iter().position(|&c| c > 0).expect("one present");
            let mut f = [0u32; 256];
            f[s] = M - 1;
            f[(s + 1) & 255] = 1;
            Some(f)
        }
        _ => Some(normalize(h)),
    }
}

/// `out[i]` = the `j < nv` with `values[j] == ctx[i]` (the values are
/// distinct), else `nv`: seven compares and selects per byte, which the
/// compiler vectorises (a table lookup per byte does not).
#[inline(always)]
fn classes_body(values: &[u8; MAX_CLASSES - 1], nv: u8, ctx: &[u8], out: &mut [u8]) {
    for (o, &c) in out.iter_mut().zip(ctx) {
        let mut k = nv;
        for (j, &v) in values.iter().enumerate() {
            if (j as u8) < nv && c == v {
                k = j as u8;
            }
        }
        *o = k;
    }
}

// `class_bins` masks a class to MAX_CLASSES with `&` and packs it with the
// symbol into a u16.
const _: () = assert!(MAX_CLASSES.is_power_of_two() && MAX_CLASSES * 256 <= 1 << 16);

/// The histogram bin of each symbol with its class: class `c % 8` in the
/// high byte, the symbol in the low one.
fn class_bins_body(syms: &[u8], classes: &[u8], out: &mut [u16]) {
    for ((o, &s), &c) in out.iter_mut().zip(syms).zip(classes) {
        *o = u16::from(c & (MAX_CLASSES as u8 - 1)) << 8 | u16::from(s);
    }
}

dispatch!(class_bins, class_bins_body, (syms: &[u8], classes: &[u8], out: &mut [u16]));

dispatch!(classes_of, classes_body, (values: &[u8; MAX_CLASSES - 1], nv: u8, ctx: &[u8], out: &mut [u8]));

/// Contexts this long or longer (a block's, not a delta search's sample)
/// are ranked on every fourth byte ([`CtxModel::new`]).
const SAMPLED_RANKING_MIN: usize = 16 * 1024;

/// The classes of a context stream: its most frequent values get a class
/// each, every other value shares the last. One model serves every stream
/// of a block (they share the context), as does its class of each symbol.
pub struct CtxModel {
    /// Context values with a class of their own (classes 0..k-1); all other
    /// values fall in class `k`.
    values: Vec<u8>,
}

impl CtxModel {
    pub fn new(ctx: &[u8]) -> CtxModel {
        // Which values are the most frequent is as clear from every fourth
        // byte of a block: `examples/codec_speed` encode, one core, three
        // alternating runs, gpt-small DELTA bf16 350-358 -> 367-369 MiB/s,
        // DELTA fp32 687-703 -> 708-713, bert-ft DELTA fp32 702-707 ->
        // 719-758; frames -1432, -136 and +843 bytes.
        let ch = if ctx.len() >= SAMPLED_RANKING_MIN {
            sampled_histogram(ctx, 4)
        } else {
            histogram(ctx)
        };
        let mut order: Vec<usize> = (0..256).filter(|&v| ch[v] > 0).collect();
        order.sort_by_key(|&v| std::cmp::Reverse(ch[v]));
        let values: Vec<u8> = order
            .iter()
            .take(MAX_CLASSES - 1)
            .map(|&v| v as u8)
            .collect();
        CtxModel { values }
    }

    /// The class of each context byte, into `out` (cleared first).
    pub fn classes(&self, ctx: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.resize(ctx.len(), 0);
        self.classes_into(ctx, out);
    }

    /// The class of each context byte of `ctx` into `out` (as long).
    pub fn classes_into(&self, ctx: &[u8], out: &mut [u8]) {
        let mut values = [0u8; MAX_CLASSES - 1];
        values[..self.values.len()].copy_from_slice(&self.values);
        classes_of(&values, self.values.len() as u8, ctx, out);
    }

    /// One histogram per class (the first `values.len() + 1` are used);
    /// `classes` from [`CtxModel::classes`]. A long input is turned into
    /// bin indices (class and symbol in one `u16`, a vectorised pass per
    /// 4096 symbols) and counted in four interleaved flat tables, so that
    /// a run of one symbol in one class (a stream of unchanged bytes) is
    /// four chains of increments, not one. Against indexing two tables per
    /// symbol: `examples/codec_speed` encode, one core, alternating, gpt-small
    /// DELTA bf16 306-311 -> 322-325 MiB/s, DELTA fp32 650 -> 672-675,
    /// bert-ft DELTA fp32 677-701 -> 716-722 (same frames).
    fn class_histograms(&self, syms: &[u8], classes: &[u8]) -> [[u32; 256]; MAX_CLASSES] {
        let n = syms.len().min(classes.len());
        let (syms, classes) = (&syms[..n], &classes[..n]);
        let mut h = [[0u32; 256]; MAX_CLASSES];
        if n < 16 * 1024 {
            // One table, `h` itself, indexed by the bins of a vectorised
            // pass: a third of the instructions of indexing by class and
            // symbol, and no more memory to clear or sum.
            let flat = h.as_flattened_mut();
            let mut idx = [0u16; 4096];
            for (s, c) in syms.chunks(idx.len()).zip(classes.chunks(idx.len())) {
                let idx = &mut idx[..s.len()];
                class_bins(s, c, idx);
                for &i in idx.iter() {
                    flat[i as usize & (256 * MAX_CLASSES - 1)] += 1;
                }
            }
            return h;
        }
        // Each (class, symbol) pair as one bin index, a vectorised pass
        // per piece, then counted in four interleaved flat tables.
        let mut flat = [[0u32; 256 * MAX_CLASSES]; 4];
        let mut idx = [0u16; 4096];
        for (s, c) in syms.chunks(idx.len()).zip(classes.chunks(idx.len())) {
            let idx = &mut idx[..s.len()];
            class_bins(s, c, idx);
            let mut quads = idx.chunks_exact(4);
            for q in &mut quads {
                flat[0][q[0] as usize] += 1;
                flat[1][q[1] as usize] += 1;
                flat[2][q[2] as usize] += 1;
                flat[3][q[3] as usize] += 1;
            }
            for &i in quads.remainder() {
                flat[0][i as usize] += 1;
            }
        }
        for (k, hk) in h.iter_mut().enumerate() {
            for (v, p) in hk.iter_mut().enumerate() {
                let i = k * 256 + v;
                *p = flat[0][i] + flat[1][i] + flat[2][i] + flat[3][i];
            }
        }
        h
    }

    /// Estimated bits of `syms` coded with this model: per-class order-0
    /// entropy plus the tables.
    pub fn cost_bits(&self, syms: &[u8], classes: &[u8]) -> f64 {
        let hist = self.class_histograms(syms, classes);
        let states = 4 * lanes_written(syms.len());
        let mut bits = 8.0 * (1 + self.values.len() + states + 4) as f64;
        for h in &hist[..self.values.len() + 1] {
            let present = h.iter().filter(|&&c| c > 0).count();
            bits += 8.0 * (1 + if present > 0 { 2 + present } else { 0 }) as f64;
            bits += entropy_bits(h);
        }
        bits
    }

    /// A low estimate of the bytes [`ctx_plan`] would give, from every
    /// `step`-th symbol: each class's order-0 entropy on the sample (an
    /// estimate that runs low on a sample) scaled to the whole, and its
    /// table over the range of symbols the sample holds (within the
    /// block's). A quarter of a class count's work, without the tables'
    /// normalisation.
    pub fn sampled_bytes(&self, syms: &[u8], classes: &[u8], step: usize) -> f64 {
        let n = syms.len().min(classes.len());
        let mut h = [[0u32; 256]; MAX_CLASSES];
        for i in (0..n).step_by(step.max(1)) {
            h[classes[i] as usize & (MAX_CLASSES - 1)][syms[i] as usize] += 1;
        }
        let mut bytes = (1 + self.values.len() + 4 * lanes_written(n) + 4) as f64;
        for hc in &h[..self.values.len() + 1] {
            // The presence byte; then, as `table_bytes`, two bytes and a
            // byte or more per symbol of the range.
            bytes += 1.0;
            let lo = hc.iter().position(|&c| c > 0);
            let hi = hc.iter().rposition(|&c| c > 0);
            if let (Some(lo), Some(hi)) = (lo, hi) {
                bytes += (2 + hi - lo + 1) as f64 + entropy_bits(hc) * step as f64 / 8.0;
            }
        }
        bytes
    }
}

/// Plan context coding of `syms` under `model`, `classes` being the class
/// of each symbol's context.
pub fn ctx_plan(syms: &[u8], model: &CtxModel, classes: &[u8]) -> CtxPlan {
    let hist = model.class_histograms(syms, classes);
    let mut bytes = (1 + model.values.len() + 4 * lanes_written(syms.len()) + 4) as f64;
    let freqs: Vec<Option<[u32; 256]>> = hist[..model.values.len() + 1]
        .iter()
        .map(|h| {
            let f = normalize_class(h);
            bytes += 1.0;
            if let Some(f) = &f {
                bytes += table_bytes(f) as f64 + coded_bits(h, f) / 8.0;
            }
            f
        })
        .collect();
    let mut all = [0u32; 256];
    for h in &hist {
        for (a, &c) in all.iter_mut().zip(h) {
            *a += c;
        }
    }
    CtxPlan {
        freqs,
        bytes,
        hist: all,
    }
}

/// Append the context-modelled payload: `k-1` as u8, the `k-1` context
/// values, per class a presence byte and (if present) its frequency table,
/// then the states and bytes as in plain rANS.
pub fn ctx_encode(
    syms: &[u8],
    model: &CtxModel,
    classes: &[u8],
    plan: &CtxPlan,
    out: &mut Vec<u8>,
) {
    out.push(model.values.len() as u8);
    out.extend_from_slice(&model.values);
    let mut enc = Vec::with_capacity(plan.freqs.len());
    for f in &plan.freqs {
        match f {
            Some(f) => {
                out.push(1);
                write_freqs(f, out);
                enc.push(enc_table(f));
            }
            None => {
                out.push(0);
                enc.push([EncSym::default(); 256]);
            }
        }
    }
    encode_lanes(syms, &enc, Some(&classes[..syms.len()]), out);
}

/// Decode a context-modelled block; `ctx` is the base's same block.
pub fn ctx_decode(
    payload: &[u8],
    offset: u64,
    ctx: &[u8],
    out: &mut [u8],
    slots: &mut Vec<u32>,
    version: u8,
) -> Result<(), DecodeError> {
    if ctx.len() != out.len() {
        return Err(DecodeError::Corrupt {
            offset,
            reason: "context block length differs",
        });
    }
    let (map, p) = read_classes(payload, offset, slots)?;
    decode_lanes(payload, p, offset, slots, Some((ctx, &map)), out, version)
}

/// Decode a block coded with the symbol `d` places before as context
/// (block mode 9): `payload` is LEB128 `d`, then a context-modelled
/// block's (mode 4's) payload.
pub fn up_decode(
    payload: &[u8],
    offset: u64,
    out: &mut [u8],
    slots: &mut Vec<u32>,
    version: u8,
) -> Result<(), DecodeError> {
    // A distance fits in three bytes: it is below a block's 65,536 symbols.
    let (d, p) =
        super::leb::read(payload, 0, payload.len(), 3).map_err(|_| DecodeError::Corrupt {
            offset,
            reason: "row-context distance truncated or too long",
        })?;
    let (map, q) = read_classes(&payload[p..], offset, slots)?;
    decode_up_lanes(
        payload,
        p + q,
        offset,
        slots,
        d as usize,
        &map,
        out,
        version,
    )
}

/// The class header of a context-modelled payload (`nv`, the values, a
/// flag and table per class) read into `slots` (one 4096-slot table per
/// class); the class of each context byte, and where the states start.
fn read_classes(
    payload: &[u8],
    offset: u64,
    slots: &mut Vec<u32>,
) -> Result<(ClassMap, usize), DecodeError> {
    let corrupt = |reason: &'static str| DecodeError::Corrupt { offset, reason };
    let nv = *payload
        .first()
        .ok_or(corrupt("rans context header truncated"))? as usize;
    if nv >= MAX_CLASSES {
        return Err(corrupt("too many rans context classes"));
    }
    let values = payload
        .get(1..1 + nv)
        .ok_or(corrupt("rans context header truncated"))?;
    let mut p = 1 + nv;
    grow(slots, ALL_SLOTS);
    let mut present = [false; MAX_CLASSES];
    for (c, pr) in present.iter_mut().enumerate().take(nv + 1) {
        let flag = *payload
            .get(p)
            .ok_or(corrupt("rans context table truncated"))?;
        p += 1;
        match flag {
            0 => {}
            1 => {
                *pr = true;
                let tbl = &mut slots[c << SCALE_BITS..(c + 1) << SCALE_BITS];
                read_freqs(payload, &mut p, offset, tbl)?;
            }
            _ => return Err(corrupt("bad rans class flag")),
        }
    }
    // A context whose class has no table only occurs in a corrupt frame:
    // point it at a class that has one, so decoding stays in bounds and the
    // final-state check (and the caller's blake3) reports the damage.
    let fallback = present
        .iter()
        .position(|&p| p)
        .ok_or(corrupt("rans context block without tables"))? as u8;
    let table = |c: usize| if present[c] { c as u8 } else { fallback };
    let offset_of = |class: u8| (class as u32) << SCALE_BITS;
    let mut map = ClassMap {
        lookup: CtxClasses {
            nv,
            values: [0; MAX_CLASSES - 1],
            classes: [0; MAX_CLASSES - 1],
            other: table(nv),
        },
        coff: [offset_of(table(nv)); 256],
    };
    // The first of equal values wins (an encoder never repeats one).
    for (c, &v) in values.iter().enumerate().rev() {
        map.lookup.values[c] = v;
        map.lookup.classes[c] = table(c);
        map.coff[v as usize] = offset_of(table(c));
    }
    Ok((map, p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A block's context (`SAMPLED_RANKING_MIN` bytes or more) is ranked on a quarter
    /// sample: its seven most frequent values get classes of their own,
    /// most frequent first, as a full count would give them.
    #[test]
    fn a_long_contexts_model_takes_its_seven_most_frequent_values() {
        // Value 100 + v (v < 10) is 10 - v of every 55 bytes, scattered by
        // a stride prime to 55, so every phase of the sample sees the same
        // mix: 100 the most frequent, 109 the least.
        let n = 4 * SAMPLED_RANKING_MIN;
        let weights: Vec<u8> = (0..10u8).flat_map(|v| vec![v; 10 - v as usize]).collect();
        let ctx: Vec<u8> = (0..n)
            .map(|i| weights[(i * 7919) % weights.len()] + 100)
            .collect();
        let model = CtxModel::new(&ctx);
        assert_eq!(model.values, (100..107).collect::<Vec<u8>>());
    }

    proptest! {
        /// The vectorised class of each context byte is the model's table's.
        #[test]
        fn classes_match_the_table(ctx in proptest::collection::vec(any::<u8>(), 0..2000), spread in 1u8..=255) {
            let ctx: Vec<u8> = ctx.iter().map(|&c| c % spread).collect();
            let model = CtxModel::new(&ctx);
            let mut got = Vec::new();
            model.classes(&ctx, &mut got);
            let nv = model.values.len();
            let want: Vec<u8> = ctx
                .iter()
                .map(|c| model.values.iter().position(|v| v == c).unwrap_or(nv) as u8)
                .collect();
            prop_assert_eq!(got, want);
        }

        /// Counted on every symbol, the screen's estimate is at most the
        /// plan's bytes: no table codes a class below its entropy, and a
        /// table spans at least its class's symbols.
        #[test]
        fn sampled_bytes_of_every_symbol_are_at_most_the_plans(
            len in 0usize..6000,
            seed in any::<u64>(),
            skew in 1u8..=255,
            spread in 1u8..=40,
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let ctx: Vec<u8> = (0..len).map(|_| (rng.next_u64() as u8) % spread).collect();
            // Symbols leaning on their context, with noise of `skew`.
            let syms: Vec<u8> = ctx
                .iter()
                .map(|&c| c.wrapping_mul(37).wrapping_add((rng.next_u64() >> 8) as u8 % skew))
                .collect();
            let model = CtxModel::new(&ctx);
            let mut classes = Vec::new();
            model.classes(&ctx, &mut classes);
            let low = model.sampled_bytes(&syms, &classes, 1);
            let plan = ctx_plan(&syms, &model, &classes).bytes;
            prop_assert!(low <= plan * (1.0 + 1e-9), "{} > {}", low, plan);
        }

        /// The per-class histograms count each symbol once in its class,
        /// in the one-table path below 16 Ki and the interleaved one above,
        /// across their 4096-symbol pieces (classes past the model's fold
        /// modulo MAX_CLASSES).
        #[test]
        fn class_histograms_count_every_symbol_in_its_class(
            len in prop_oneof![
                0usize..300,
                4_090usize..4_200,
                16_000usize..16_500,
                20_470usize..20_490,
            ],
            seed in any::<u64>(),
            skew in 1u8..=255,
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let syms: Vec<u8> = (0..len).map(|_| (rng.next_u64() as u8) % skew).collect();
            let classes: Vec<u8> = (0..len).map(|_| (rng.next_u64() >> 8) as u8 % 11).collect();
            let model = CtxModel::new(&classes);
            let got = model.class_histograms(&syms, &classes);
            let mut want = [[0u32; 256]; MAX_CLASSES];
            for (&s, &c) in syms.iter().zip(&classes) {
                want[c as usize % MAX_CLASSES][s as usize] += 1;
            }
            prop_assert_eq!(got, want);
        }
    }
}
