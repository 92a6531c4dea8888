//! Canonical, length-limited Huffman coding of one block (the LMC design),
//! with a decoder that resolves up to four symbols per table lookup.
//!
//! Block payload (see docs/format/codec.md):
//! `lo u8, hi u8, (hi-lo+1) code lengths as 4-bit nibbles (low nibble first),
//! three u32 LE sizes of sub-streams 0..3, then the four bit streams`.
//! The block's `n` symbols are split into four runs of `ceil(n/4)` (the last
//! shorter), each its own LSB-first bit stream, so the decoder can interleave
//! four independent dependency chains.
//!
//! Owns: code lengths from a histogram, the Huffman block payload, its
//! encoder and its table-driven decoder. Must not: choose whether a block
//! is Huffman coded (`block` does).

use super::bits::BitReader;
use super::DecodeError;

/// Longest code length; also the decode table's index width.
pub const MAX_BITS: u32 = 11;
const TABLE_SIZE: usize = 1 << MAX_BITS;

/// Optimal Huffman code lengths for `hist`, limited to `max_bits`, forming a
/// complete prefix code (Kraft sum exactly 1). Needs at least two symbols
/// with a non-zero count; symbols with count 0 get length 0.
pub fn code_lengths(hist: &[u32; 256], max_bits: u32) -> [u8; 256] {
    let mut lens = [0u8; 256];
    // (count, symbol) as one u64 key: sorts as the pair does, faster.
    let mut keys: Vec<u64> = (0..256)
        .filter(|&s| hist[s] > 0)
        .map(|s| (hist[s] as u64) << 8 | s as u64)
        .collect();
    keys.sort_unstable();
    let syms: Vec<(u32, u8)> = keys.iter().map(|&k| ((k >> 8) as u32, k as u8)).collect();
    debug_assert!(syms.len() >= 2, "Huffman needs two symbols");
    if syms.len() < 2 {
        for &(_, s) in &syms {
            lens[s as usize] = 1;
        }
        return lens;
    }
    // Two-queue Huffman over sorted leaves: nodes 0..m are leaves, internal
    // nodes are appended; `parent` records the tree, depths follow.
    let m = syms.len();
    let mut weight: Vec<u64> = syms.iter().map(|&(c, _)| c as u64).collect();
    weight.reserve(m);
    let mut parent = vec![0usize; 2 * m - 1];
    let (mut leaf, mut node) = (0usize, m);
    let pick = |weight: &Vec<u64>, leaf: &mut usize, node: &mut usize| -> usize {
        if *leaf < m && (*node >= weight.len() || weight[*leaf] <= weight[*node]) {
            *leaf += 1;
            *leaf - 1
        } else {
            *node += 1;
            *node - 1
        }
    };
    for _ in 0..m - 1 {
        let a = pick(&weight, &mut leaf, &mut node);
        let b = pick(&weight, &mut leaf, &mut node);
        let id = weight.len();
        weight.push(weight[a] + weight[b]);
        parent[a] = id;
        parent[b] = id;
    }
    let root = 2 * m - 2;
    let mut depth = vec![0u32; 2 * m - 1];
    for i in (0..root).rev() {
        depth[i] = depth[parent[i]] + 1;
    }
    // Limit lengths: clamp, then lengthen the cheapest symbols until the
    // Kraft sum fits, then shorten the most frequent while it still fits,
    // then fill any gap by shortening the longest codes (exact completion).
    let cap: u64 = 1 << max_bits;
    let mut len: Vec<u32> = (0..m).map(|i| depth[i].min(max_bits)).collect();
    let mut kraft: u64 = len.iter().map(|&l| 1u64 << (max_bits - l)).sum();
    while kraft > cap {
        // syms is sorted by count ascending: the first with len < max is cheapest.
        let i = (0..m)
            .find(|&i| len[i] < max_bits)
            .expect("kraft > cap implies a code shorter than max");
        len[i] += 1;
        kraft -= 1 << (max_bits - len[i]);
    }
    for i in (0..m).rev() {
        while len[i] > 1 && kraft + (1u64 << (max_bits - len[i])) <= cap {
            kraft += 1 << (max_bits - len[i]);
            len[i] -= 1;
        }
    }
    while kraft < cap {
        let i = (0..m).max_by_key(|&i| (len[i], m - i)).expect("m >= 2");
        kraft += 1 << (max_bits - len[i]);
        len[i] -= 1;
    }
    for (i, &(_, s)) in syms.iter().enumerate() {
        lens[s as usize] = len[i] as u8;
    }
    lens
}

/// Total coded bits of `hist` under `lens`.
pub fn coded_bits(hist: &[u32; 256], lens: &[u8; 256]) -> u64 {
    hist.iter()
        .zip(lens)
        .map(|(&c, &l)| c as u64 * l as u64)
        .sum()
}

/// Bytes the code-length table takes in the payload.
pub fn table_bytes(lens: &[u8; 256]) -> usize {
    match symbol_range(lens) {
        Some((lo, hi)) => 2 + (hi - lo + 1).div_ceil(2),
        None => 2,
    }
}

fn symbol_range(lens: &[u8; 256]) -> Option<(usize, usize)> {
    let lo = lens.iter().position(|&l| l > 0)?;
    let hi = 255 - lens.iter().rev().position(|&l| l > 0)?;
    Some((lo, hi))
}

/// Canonical codes, bit-reversed for an LSB-first stream.
fn canonical_codes(lens: &[u8; 256]) -> [u16; 256] {
    let mut codes = [0u16; 256];
    let Some((lo, hi)) = symbol_range(lens) else {
        return codes;
    };
    let mut count = [0u32; MAX_BITS as usize + 2];
    for &l in &lens[lo..=hi] {
        count[l as usize] += 1;
    }
    count[0] = 0;
    let mut next = [0u32; MAX_BITS as usize + 2];
    let mut code = 0u32;
    for l in 1..=MAX_BITS as usize {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    for s in lo..=hi {
        let l = lens[s] as u32;
        if l > 0 {
            let c = next[l as usize];
            next[l as usize] += 1;
            codes[s] = (c.reverse_bits() >> (32 - l)) as u16;
        }
    }
    codes
}

/// Split of `n` symbols into four sub-streams.
fn quarter(n: usize) -> usize {
    n.div_ceil(4)
}

/// Memory the encoder keeps between blocks: the pair table, and the four
/// lanes' regions, which are written before they are read and so are
/// never cleared.
#[derive(Default)]
pub struct EncodeScratch {
    pair_codes: Vec<u32>,
    pair_lens: Vec<u8>,
    lanes: Vec<u8>,
}

/// Append the Huffman payload of `syms` under `lens` to `out`.
pub fn encode(syms: &[u8], lens: &[u8; 256], out: &mut Vec<u8>, scratch: &mut EncodeScratch) {
    let (first, last) = symbol_range(lens).expect("at least two symbols");
    out.push(first as u8);
    out.push(last as u8);
    for pair in lens[first..=last].chunks(2) {
        out.push(pair[0] | (pair.get(1).copied().unwrap_or(0) << 4));
    }
    let codes = canonical_codes(lens);
    let codes64: [u64; 256] = std::array::from_fn(|s| codes[s] as u64);
    let lens64: [u64; 256] = std::array::from_fn(|s| lens[s] as u64);
    let sizes_at = out.len();
    out.extend_from_slice(&[0u8; 12]);
    // The four sub-streams are written side by side in scratch, each in a
    // region of `cap` bytes (its bound plus room for the last 8-byte
    // store), then appended.
    let n = syms.len();
    let q = quarter(n).max(1);
    let lo = [0, q.min(n), (2 * q).min(n), (3 * q).min(n)];
    let hi = [lo[1], lo[2], lo[3], n];
    let max_len = lens.iter().copied().max().unwrap_or(0) as usize;
    let cap = q * max_len / 8 + 16;
    if scratch.lanes.len() < 4 * cap {
        scratch.lanes.resize(4 * cap, 0);
    }
    let lanes: [&[u8]; 4] = std::array::from_fn(|j| &syms[lo[j]..hi[j]]);
    let pairs = (last - first < 64 && n >= PAIR_MIN_SYMBOLS).then(|| {
        pair_table(
            lens,
            &codes,
            first,
            &mut scratch.pair_codes,
            &mut scratch.pair_lens,
        )
    });
    let used = encode_lanes(
        &codes64,
        &lens64,
        pairs.map(|(c, l)| (&*c, &*l, first as u32 * 0x0101_0101)),
        lanes,
        &mut scratch.lanes[..4 * cap],
        cap,
    );
    for (j, &u) in used.iter().enumerate() {
        out.extend_from_slice(&scratch.lanes[j * cap..j * cap + u]);
    }
    for (j, &u) in used.iter().take(3).enumerate() {
        let at = sizes_at + 4 * j;
        out[at..at + 4].copy_from_slice(&(u as u32).to_le_bytes());
    }
}

/// Blocks shorter than this are coded a symbol at a time: the pair table
/// costs a few thousand instructions to fill.
const PAIR_MIN_SYMBOLS: usize = 2048;

/// Entries of the pair table: two symbols `a`, `b` of a code spanning
/// `first .. first + 64` are at `(a - first) + 256 * (b - first)`.
const PAIRS: usize = 1 << 14;

/// Codes of two symbols at once, for a code whose symbols span fewer than
/// 64 values (an exponent stream): the entry of `a` then `b` (see
/// [`PAIRS`]) is the code of `a` then that of `b` (at most 22 bits), and
/// beside it, in a table of its own (one load instead of two operations to
/// unpack), their total length. Only pairs of coded symbols are written;
/// the rest of the tables is left as it was (never read).
fn pair_table<'a>(
    lens: &[u8; 256],
    codes: &[u16; 256],
    first: usize,
    pair_codes: &'a mut Vec<u32>,
    pair_lens: &'a mut Vec<u8>,
) -> (&'a mut [u32; PAIRS], &'a mut [u8; PAIRS]) {
    if pair_codes.len() < PAIRS {
        pair_codes.resize(PAIRS, 0);
        pair_lens.resize(PAIRS, 0);
    }
    let tc: &mut [u32; PAIRS] = (&mut pair_codes[..PAIRS]).try_into().expect("PAIRS long");
    let tl: &mut [u8; PAIRS] = (&mut pair_lens[..PAIRS]).try_into().expect("PAIRS long");
    let present: Vec<usize> = (first..256).filter(|&s| lens[s] > 0).collect();
    for &b in &present {
        for &a in &present {
            let (la, lb) = (lens[a] as u32, lens[b] as u32);
            let at = 256 * (b - first) + (a - first);
            tc[at] = codes[a] as u32 | (codes[b] as u32) << la;
            tl[at] = (la + lb) as u8;
        }
    }
    (tc, tl)
}

/// Write each lane's codes as an LSB-first bit stream into its region
/// `dst[j * cap..]`; returns the bytes each took. Five codes of at most 11
/// bits (or two pairs of at most 22) go into the 64-bit buffer between
/// stores of it (at most 7 bits are left over from the last store), so the
/// loop has no branch but its own.
#[inline(always)]
fn encode_lanes_body(
    codes: &[u64; 256],
    lens: &[u64; 256],
    pairs: Option<(&[u32; PAIRS], &[u8; PAIRS], u32)>,
    lanes: [&[u8]; 4],
    dst: &mut [u8],
    cap: usize,
) -> [usize; 4] {
    let mut used = [0usize; 4];
    for (j, lane) in lanes.into_iter().enumerate() {
        let region = &mut dst[j * cap..(j + 1) * cap];
        let (mut acc, mut nbits, mut pos) = (0u64, 0u64, 0usize);
        let mut flush = |acc: &mut u64, nbits: &mut u64| {
            region[pos..pos + 8].copy_from_slice(&acc.to_le_bytes());
            pos += (*nbits >> 3) as usize;
            // nbits <= 62, so the shift is at most 56.
            *acc >>= *nbits & 56;
            *nbits &= 7;
        };
        let rest = match pairs {
            Some((pc, pl, first4)) => {
                // Four symbols read as a u32, less `first` in every byte
                // (no borrows: every symbol is in `first .. first + 64`),
                // are two pair indices in its halves.
                let mut it = lane.chunks_exact(4);
                for c in &mut it {
                    let v =
                        u32::from_le_bytes(c.try_into().expect("4 symbols")).wrapping_sub(first4);
                    let (a, b) = ((v & 0xffff) as usize, (v >> 16) as usize);
                    let (a, b) = (a & (PAIRS - 1), b & (PAIRS - 1));
                    acc |= (pc[a] as u64) << nbits;
                    nbits += pl[a] as u64;
                    acc |= (pc[b] as u64) << nbits;
                    nbits += pl[b] as u64;
                    flush(&mut acc, &mut nbits);
                }
                it.remainder()
            }
            None => {
                let mut it = lane.chunks_exact(5);
                for c in &mut it {
                    for &s in c {
                        acc |= codes[s as usize] << nbits;
                        nbits += lens[s as usize];
                    }
                    flush(&mut acc, &mut nbits);
                }
                it.remainder()
            }
        };
        for &s in rest {
            acc |= codes[s as usize] << nbits;
            nbits += lens[s as usize];
        }
        flush(&mut acc, &mut nbits);
        flush(&mut acc, &mut nbits);
        used[j] = pos + (nbits > 0) as usize;
    }
    used
}

dispatch!(encode_lanes, encode_lanes_body, (codes: &[u64; 256], lens: &[u64; 256], pairs: Option<(&[u32; PAIRS], &[u8; PAIRS], u32)>, lanes: [&[u8]; 4], dst: &mut [u8], cap: usize) -> [usize; 4]);

/// Decode `out.len()` symbols from the payload `frame[start..start+len]`.
/// Bytes of `frame` after the payload may be read (never used) by the fast
/// path; this avoids copying each block into a padded buffer.
pub fn decode(
    frame: &[u8],
    start: usize,
    len: usize,
    out: &mut [u8],
    table: &mut DecodeTable,
) -> Result<(), DecodeError> {
    let payload = &frame[start..start + len];
    let corrupt = |reason: &'static str| DecodeError::Corrupt {
        offset: start as u64,
        reason,
    };
    if payload.len() < 2 {
        return Err(corrupt("huffman block shorter than its header"));
    }
    let (lo, hi) = (payload[0] as usize, payload[1] as usize);
    if lo > hi {
        return Err(corrupt("huffman symbol range is empty"));
    }
    let nl = hi - lo + 1;
    let tb = 2 + nl.div_ceil(2);
    if payload.len() < tb + 12 {
        return Err(corrupt("huffman block shorter than its table"));
    }
    let mut lens = [0u8; 256];
    for i in 0..nl {
        let b = payload[2 + i / 2];
        let l = if i % 2 == 0 { b & 15 } else { b >> 4 };
        if l as u32 > MAX_BITS {
            return Err(corrupt("huffman code length above 11"));
        }
        lens[lo + i] = l;
    }
    // Per-block work stays within lo..=hi: a small block's decode is
    // comparable to these loops over all 256 symbols.
    let used = &lens[lo..=hi];
    let kraft: u64 = used
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| 1u64 << (MAX_BITS - l as u32))
        .sum();
    if kraft != 1 << MAX_BITS {
        return Err(corrupt("huffman code lengths do not form a complete code"));
    }
    let sizes: [usize; 3] = std::array::from_fn(|j| {
        let at = tb + 4 * j;
        u32::from_le_bytes(payload[at..at + 4].try_into().expect("4 bytes")) as usize
    });
    let data_start = tb + 12;
    let total: usize = sizes.iter().sum();
    if total > payload.len() - data_start {
        return Err(corrupt("huffman sub-stream sizes exceed the block"));
    }
    let bounds = [
        data_start,
        data_start + sizes[0],
        data_start + sizes[0] + sizes[1],
        data_start + total,
        payload.len(),
    ];
    let n = out.len();
    let q = quarter(n).max(1);
    let mk = |j: usize| BitReader::new(frame, start + bounds[j], start + bounds[j + 1]);
    let mut r = [mk(0), mk(1), mk(2), mk(3)];
    // Lane j decodes symbols [lo[j], hi[j]) of `out`; pos[j] is how far
    // the fast loop got.
    let lo = [0, q.min(n), (2 * q).min(n), (3 * q).min(n)];
    let hi = [lo[1], lo[2], lo[3], n];
    let mut pos = lo;
    // Two codes fit one 11-bit lookup only if the shortest is at most 5
    // bits; else (a near-noise mantissa stream) the multi-symbol table would
    // be the single-symbol one, built at greater cost.
    let min_len = used.iter().copied().filter(|&l| l > 0).min().unwrap_or(1) as u32;
    let multi = n >= MULTI_MIN_SYMBOLS && 2 * min_len <= MAX_BITS;
    let fast = n >= FAST_MIN_SYMBOLS;
    // The fast loop indexes with 11 bits; a small block's single-symbol
    // table only needs as many as the longest code.
    let bits = if fast {
        MAX_BITS
    } else {
        used.iter().copied().max().unwrap_or(1) as u32
    };
    table.build(&lens, multi, bits);
    let table = &table.entries;
    if fast {
        let t: &[u64; TABLE_SIZE] = table.as_slice().try_into().expect("table size");
        let mut at = r.each_ref().map(|r| r.position());
        decode_fast(t, frame, &mut at, out, &mut pos, &hi);
        for (rj, &a) in r.iter_mut().zip(&at) {
            rj.set_position(a);
        }
    }
    // Tails (and small blocks): one symbol per lookup with bounded reads;
    // an entry's first symbol and its own length.
    for (j, rj) in r.iter_mut().enumerate() {
        for o in &mut out[pos[j]..hi[j]] {
            let s = (table[rj.peek_safe(bits) as usize] >> 16) as u8;
            *o = s;
            rj.consume(lens[s as usize] as u32);
        }
        if rj.overrun() {
            return Err(corrupt("huffman sub-stream ends before its symbols"));
        }
    }
    Ok(())
}

/// Blocks shorter than this use a single-symbol table: building the
/// multi-symbol one (2048 entries, up to four codes each) costs more than it
/// saves on fewer symbols.
const MULTI_MIN_SYMBOLS: usize = 8192;
/// Blocks shorter than this skip the four-lane loop altogether.
const FAST_MIN_SYMBOLS: usize = 256;

/// A decode table and the code it was built for, kept between blocks:
/// consecutive blocks of a stream (the exponents of one tensor) often have
/// the very same code lengths, and then the table is reused as it is.
#[derive(Default)]
pub struct DecodeTable {
    entries: Vec<u64>,
    /// What `entries` holds: the code lengths, `multi` and `bits` it was
    /// built with; `None` before the first build.
    built: Option<([u8; 256], bool, u32)>,
    /// Scratch for the multi-symbol build's sub-tables.
    store: Vec<u64>,
}

impl DecodeTable {
    /// Make the table the one for `lens` (see [`build_table`]), building it
    /// only if it is not that already.
    fn build(&mut self, lens: &[u8; 256], multi: bool, bits: u32) {
        if self
            .built
            .as_ref()
            .is_some_and(|(l, m, b)| l == lens && *m == multi && *b == bits)
        {
            return;
        }
        build_table(lens, multi, bits, &mut self.entries, &mut self.store);
        self.built = Some((*lens, multi, bits));
    }
}

/// Decode table, indexed by the next 11 bits of a stream. Entry: the bits
/// its symbols take in bits 0..8 (so the entry itself is the shift
/// amount), their count in 8..16, the symbols in 16..48 (first in the
/// lowest byte). With `multi`, an entry resolves as many whole codes (up to
/// four) as fit in 11 bits; without, only the first (cheaper to build for a
/// small block).
fn build_table(
    lens: &[u8; 256],
    multi: bool,
    bits: u32,
    table: &mut Vec<u64>,
    store: &mut Vec<u64>,
) {
    let codes = canonical_codes(lens);
    if table.len() < TABLE_SIZE {
        table.resize(TABLE_SIZE, 0);
    }
    if multi {
        build_multi(lens, &codes, table, store);
        return;
    }
    // One symbol per entry: each code fills every entry whose low bits it
    // is. Entries depend only on the low `max` bits (the longest code), so
    // the first 2^max are filled and then repeated by doubling copies.
    let Some((lo, hi)) = symbol_range(lens) else {
        return;
    };
    let max = lens[lo..=hi].iter().copied().max().unwrap_or(1) as u32;
    let (size, base) = (1usize << bits, 1usize << max.min(bits));
    let table = &mut table[..size];
    for s in lo..=hi {
        let l = lens[s] as usize;
        if l > 0 {
            let e = l as u64 | 1 << 8 | (s as u64) << 16;
            let mut i = codes[s] as usize;
            while i < base {
                table[i] = e;
                i += 1 << l;
            }
        }
    }
    let mut filled = base;
    while filled < size {
        table.copy_within(..filled, filled);
        filled *= 2;
    }
}

/// Entries of the multi-symbol table, built by prefix: the entries that
/// start with code `c` (symbol `s`, length `l`) are `c + (r << l)` for every
/// `r` of `11 - l` bits, and each is `s` followed by the decode of `r`
/// within `11 - l` bits and up to three codes. That decode is itself a
/// table of `2^(11-l)` entries built the same way (up to two codes within
/// fewer bits, and so on), shared by every code of length `l`. A table of
/// up to `k` codes holds its symbols where they land in a final entry
/// (from byte `4 - k` of the symbol bytes on), so putting a code in front
/// of an entry is one addition: its bits, a count of one, its symbol.
fn build_multi(lens: &[u8; 256], codes: &[u16; 256], table: &mut [u64], store: &mut Vec<u64>) {
    // `sub(level, b)`: up to `level` codes (1..=3) within `b` bits (0..=10),
    // at `(level - 1) * TABLE_SIZE + 2^b - 1` in `store`.
    let mut all = [(0u64, 0u32, 0usize); 256];
    let mut k = 0;
    for s in 0..256 {
        if lens[s] > 0 {
            all[k] = (s as u64, lens[s] as u32, codes[s] as usize);
            k += 1;
        }
    }
    let syms = &all[..k];
    const STORE: usize = 4 * TABLE_SIZE;
    if store.len() < STORE {
        store.resize(STORE, 0);
    }
    let store: &mut [u64; STORE] = (&mut store[..STORE]).try_into().expect("store size");
    let table: &mut [u64; TABLE_SIZE] = (&mut table[..TABLE_SIZE]).try_into().expect("table size");
    let at = |level: usize, b: u32| (level - 1) * TABLE_SIZE + (1usize << b) - 1;
    // Code `s` of length `l` as the first of a level's entry (level 4: the
    // final table).
    let code = |s: u64, l: u32, level: usize| l as u64 + (1 << 8) + (s << (16 + 8 * (4 - level)));
    // Levels are filled bottom up: a level's tables need the ones below.
    let mut need = [[false; MAX_BITS as usize]; 3];
    for &(_, l, _) in syms {
        need[2][(MAX_BITS - l) as usize] = true;
    }
    for level in (2..=3).rev() {
        for b in 0..MAX_BITS as usize {
            if need[level - 1][b] {
                for &(_, l, _) in syms {
                    if l as usize <= b {
                        need[level - 2][b - l as usize] = true;
                    }
                }
            }
        }
    }
    // Entries at `dst + c + (r << l)`; the masks only keep the indexing
    // visibly in bounds (every index is below STORE or TABLE_SIZE already).
    for level in 1..=3 {
        for b in 0..MAX_BITS {
            if !need[level - 1][b as usize] {
                continue;
            }
            let dst = at(level, b);
            store[dst..dst + (1 << b)].fill(0);
            for &(s, l, c) in syms {
                if l > b {
                    continue;
                }
                let (n, e, mut i) = (1usize << (b - l), code(s, l, level), dst + c);
                if level == 1 {
                    for _ in 0..n {
                        store[i & (STORE - 1)] = e;
                        i += 1 << l;
                    }
                } else {
                    let src = at(level - 1, b - l);
                    for r in src..src + n {
                        store[i & (STORE - 1)] = store[r & (STORE - 1)] + e;
                        i += 1 << l;
                    }
                }
            }
        }
    }
    for &(s, l, c) in syms {
        let src = at(3, MAX_BITS - l);
        let (e, mut i) = (code(s, l, 4), c);
        for &sub in &store[src..src + (1 << (MAX_BITS - l))] {
            table[i & (TABLE_SIZE - 1)] = sub + e;
            i += 1 << l;
        }
    }
}

/// The hot loop: four lanes interleaved so four independent dependency
/// chains (bit buffer -> table load -> shift) overlap. A round loads 8
/// bytes per lane (56 bits used, a sentinel bit above them) and makes 5
/// lookups of up to 4 symbols (at most 55 bits); the sentinel's place then
/// says how many bits the round consumed. So a lane needs 20 symbols of
/// room and 8 readable input bytes per round, and advances at most 7. The
/// loop runs as many rounds at a time as all lanes certainly have room
/// for, then checks again.
///
/// `at[j]`: lane j's next bit (absolute, in `buf`); `pos[j]`: its next
/// output symbol, below `end[j]`. Lanes' output ranges must not overlap.
#[inline(always)]
fn decode_fast_body(
    t: &[u64; TABLE_SIZE],
    buf: &[u8],
    at: &mut [usize; 4],
    out: &mut [u8],
    pos: &mut [usize; 4],
    end: &[usize; 4],
) {
    const SENTINEL: u64 = 1 << 56;
    assert!(end.iter().all(|&e| e <= out.len()), "lanes inside out");
    let dst = out.as_mut_ptr();
    let mut o = *pos;
    loop {
        let mut rounds = usize::MAX;
        for j in 0..4 {
            let by_out = end[j].saturating_sub(o[j]) / 20;
            let by_in = match buf.len().checked_sub((at[j] >> 3) + 8) {
                Some(room) => room / 7 + 1,
                None => 0,
            };
            rounds = rounds.min(by_out).min(by_in);
        }
        if rounds == 0 {
            break;
        }
        for _ in 0..rounds {
            let mut acc = [0u64; 4];
            for j in 0..4 {
                let b = at[j] >> 3;
                let w = u64::from_le_bytes(buf[b..b + 8].try_into().expect("8 bytes"));
                acc[j] = ((w >> (at[j] & 7)) & (SENTINEL - 1)) | SENTINEL;
            }
            for _ in 0..5 {
                for j in 0..4 {
                    let v = t[(acc[j] & (TABLE_SIZE as u64 - 1)) as usize];
                    let syms = ((v >> 16) as u32).to_le_bytes();
                    // SAFETY: `o[j] + 20 <= end[j] <= out.len()` at the
                    // start of the round (the `rounds` bound and the assert
                    // above), and each of its 5 steps advances by an entry's
                    // count, which `build_table` makes 1..=4 for every
                    // entry; so this step starts at most 16 past the round's
                    // start and its 4 bytes stay inside lane j's range of
                    // `out`, which `dst` points to and which is borrowed
                    // mutably here.
                    unsafe {
                        std::ptr::copy_nonoverlapping(syms.as_ptr(), dst.add(o[j]), 4);
                    }
                    acc[j] >>= v & 63;
                    o[j] += (v >> 8) as u8 as usize;
                }
            }
            for j in 0..4 {
                at[j] += acc[j].leading_zeros() as usize - 7;
            }
        }
    }
    // Each lane's rest, one lookup at a time, while it has room for an
    // entry's four symbols and 8 readable bytes: this leaves at most three
    // symbols a lane to the caller's bounded loop (a lane stops the loop
    // above up to 20 symbols early, and a small block never enters it).
    for j in 0..4 {
        let (mut a, mut p) = (at[j], o[j]);
        while p + 4 <= end[j] {
            let b = a >> 3;
            let Some(w) = buf.get(b..b + 8) else { break };
            let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            let v = t[((w >> (a & 7)) & (TABLE_SIZE as u64 - 1)) as usize];
            out[p..p + 4].copy_from_slice(&((v >> 16) as u32).to_le_bytes());
            a += (v & 0xff) as usize;
            p += (v >> 8) as u8 as usize;
        }
        (at[j], o[j]) = (a, p);
    }
    *pos = o;
}

dispatch!(decode_fast, decode_fast_body, (t: &[u64; TABLE_SIZE], buf: &[u8], at: &mut [usize; 4], out: &mut [u8], pos: &mut [usize; 4], end: &[usize; 4]));

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hist(s: &[u8]) -> [u32; 256] {
        let mut h = [0u32; 256];
        for &b in s {
            h[b as usize] += 1;
        }
        h
    }

    fn round_trip(syms: &[u8]) -> usize {
        let h = hist(syms);
        let lens = code_lengths(&h, MAX_BITS);
        let kraft: u64 = lens
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 1u64 << (MAX_BITS - l as u32))
            .sum();
        assert_eq!(kraft, 1 << MAX_BITS);
        let mut out = Vec::new();
        encode(syms, &lens, &mut out, &mut EncodeScratch::default());
        let mut back = vec![0u8; syms.len()];
        let mut t = DecodeTable::default();
        decode(&out, 0, out.len(), &mut back, &mut t).unwrap();
        assert_eq!(back, syms);
        out.len()
    }

    #[test]
    fn skewed_and_geometric_blocks_round_trip() {
        let mut v = Vec::new();
        for i in 0..70000u32 {
            v.push((i.trailing_zeros().min(20)) as u8 + 100);
        }
        let size = round_trip(&v);
        // geometric source: ~2 bits/symbol
        assert!(size < v.len() / 3, "{size}");
        round_trip(&[1, 2]);
        round_trip(&[1, 2, 1, 1, 1, 1, 1, 1, 9]);
    }

    #[test]
    fn deep_trees_are_limited_to_eleven_bits() {
        // Fibonacci counts force a degenerate tree of depth > 11.
        let mut h = [0u32; 256];
        let (mut a, mut b) = (1u32, 1u32);
        for c in h.iter_mut().take(30) {
            *c = a;
            (a, b) = (b, a + b);
        }
        let lens = code_lengths(&h, MAX_BITS);
        assert!(lens.iter().all(|&l| l as u32 <= MAX_BITS));
        let syms: Vec<u8> = (0..30u8)
            .flat_map(|s| std::iter::repeat_n(s, h[s as usize].min(3000) as usize))
            .collect();
        round_trip(&syms);
    }

    /// The multi-symbol table by definition: per entry, up to four codes,
    /// each kept only if it ends within the 11 bits.
    fn naive_multi_table(lens: &[u8; 256]) -> Vec<u64> {
        let codes = canonical_codes(lens);
        let mut single = vec![(0u64, 0u32); TABLE_SIZE];
        for s in 0..256 {
            let l = lens[s] as u32;
            if l > 0 {
                for i in (codes[s] as usize..TABLE_SIZE).step_by(1 << l) {
                    single[i] = (s as u64, l);
                }
            }
        }
        (0..TABLE_SIZE)
            .map(|i| {
                let (mut bits, mut count, mut syms) = (0u32, 0u64, 0u64);
                while count < 4 {
                    let (s, l) = single[(i >> bits) & (TABLE_SIZE - 1)];
                    if bits + l > MAX_BITS {
                        break;
                    }
                    syms |= s << (8 * count);
                    bits += l;
                    count += 1;
                }
                bits as u64 | count << 8 | syms << 16
            })
            .collect()
    }

    fn check_multi_table(syms: &[u8]) {
        let lens = code_lengths(&hist(syms), MAX_BITS);
        let mut t = DecodeTable::default();
        t.build(&lens, true, MAX_BITS);
        assert_eq!(t.entries[..TABLE_SIZE], naive_multi_table(&lens)[..]);
    }

    #[test]
    fn multi_table_matches_naive_on_skewed_codes() {
        let v: Vec<u8> = (0..70000u32)
            .map(|i| i.trailing_zeros().min(20) as u8)
            .collect();
        check_multi_table(&v);
        check_multi_table(&[0, 1]);
        check_multi_table(&[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3]);
        let all: Vec<u8> = (0..=255u8).chain(std::iter::repeat_n(7, 5000)).collect();
        check_multi_table(&all);
    }

    /// A Huffman block's payload as docs/format/codec.md defines it: the
    /// symbol range, the code lengths in nibbles, the byte lengths of
    /// sub-streams 0-2, then each quarter's canonical codes (DEFLATE's:
    /// by length, then symbol) as an LSB-first bit stream, each code's
    /// most significant bit first, zero-padded to a byte.
    fn payload_by_its_definition(syms: &[u8], lens: &[u8; 256]) -> Vec<u8> {
        let lo = lens.iter().position(|&l| l > 0).expect("a symbol");
        let hi = lens.iter().rposition(|&l| l > 0).expect("a symbol");
        let mut out = vec![lo as u8, hi as u8];
        for pair in lens[lo..=hi].chunks(2) {
            out.push(pair[0] | (pair.get(1).copied().unwrap_or(0) << 4));
        }
        let mut order: Vec<usize> = (0..256).filter(|&s| lens[s] > 0).collect();
        order.sort_by_key(|&s| (lens[s], s));
        let mut code = [0u32; 256];
        let (mut next, mut len) = (0u32, lens[order[0]]);
        for &s in &order {
            next <<= lens[s] - len;
            len = lens[s];
            code[s] = next;
            next += 1;
        }
        let q = syms.len().div_ceil(4);
        let streams: Vec<Vec<u8>> = (0..4)
            .map(|j| {
                let run = &syms[(j * q).min(syms.len())..((j + 1) * q).min(syms.len())];
                let (mut bytes, mut at) = (Vec::new(), 0usize);
                for &s in run {
                    for b in (0..lens[s as usize]).rev() {
                        if at % 8 == 0 {
                            bytes.push(0);
                        }
                        bytes[at / 8] |= (((code[s as usize] >> b) & 1) as u8) << (at % 8);
                        at += 1;
                    }
                }
                bytes
            })
            .collect();
        for s in &streams[..3] {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
        for s in &streams {
            out.extend_from_slice(s);
        }
        out
    }

    proptest! {
        /// The encoder writes the payload its format defines, on both of
        /// its paths (codes by pairs for a symbol range under 64 and 2048
        /// symbols or more, else one by one) and whatever the quarters'
        /// lengths; the decoder is checked against the encoder elsewhere,
        /// this pins both to the specification.
        #[test]
        fn a_block_is_coded_as_the_format_defines(
            n in prop_oneof![2usize..40, 40usize..3000, 3000usize..9000],
            span in prop_oneof![Just(2u32), Just(40u32), Just(256u32)],
            seed: u64,
        ) {
            let mut rng = crate::testing::Rng(seed | 1);
            let syms: Vec<u8> = (0..n)
                .map(|i| {
                    // Skewed: small symbols more often, so codes differ in
                    // length; the first two symbols make two present.
                    let r = (rng.next_u64() % span as u64) as u32;
                    if i < 2 { i as u8 } else { (r * r / span) as u8 }
                })
                .collect();
            let lens = code_lengths(&hist(&syms), MAX_BITS);
            let mut out = Vec::new();
            encode(&syms, &lens, &mut out, &mut EncodeScratch::default());
            prop_assert_eq!(out, payload_by_its_definition(&syms, &lens));
        }

        #[test]
        fn multi_table_matches_naive(syms in proptest::collection::vec(0u8..40, 2..3000)) {
            let mut syms = syms;
            syms[0] = 0;
            syms[1] = 1;
            check_multi_table(&syms);
        }

        #[test]
        fn arbitrary_blocks_round_trip(mut syms in proptest::collection::vec(0u8..40, 2..5000)) {
            syms[0] = 0;
            syms[1] = 1;
            round_trip(&syms);
        }
    }
}
