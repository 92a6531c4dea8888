//! Delta chains: the one walk down a chunk's bases ([`base_chain`]) and the
//! one way a chunk record becomes raw bytes ([`decode_chain`]).
//!
//! Owns the bound on delta chains: no walk follows more than
//! [`HARD_MAX_CHAIN`] bases or visits a chunk twice, whatever the records
//! say, so a cycle or an absurd chain is corruption, never a hang. Every
//! other module walks chains through [`base_chain`]; none counts hops
//! itself. Decoding (local reads, fetched records) goes through
//! [`decode_chain`], which checks the chunk it returns against its blake3
//! id (and, when that fails, every chunk of the chain, to name the first
//! damaged one): no unchecked byte is ever returned.
//!
//! Must not: read the store (callers say where a chunk's record or bytes
//! come from).

use std::borrow::Cow;
use std::collections::HashSet;

use crate::codec;
use crate::store::ChunkId;

use super::objects::{ChunkRecord, Payload};
use super::pool::{with_scratch, BufPool};
use super::{RepoError, Site, HARD_MAX_CHAIN};

/// Walks a chunk's delta chain: the chunk itself, then its base, its
/// base's base, ... as `base_of` says, until it returns `None`.
///
/// `base_of` is called for a chunk only when the walk goes past it (after
/// it was yielded), so a consumer may stop early at no cost. The walk
/// yields an error (naming the chunk it started from), and then ends,
/// when it would visit a chunk a second time (a cycle of bases) or follow
/// more than [`HARD_MAX_CHAIN`] bases; an error from `base_of` is yielded
/// likewise.
pub(crate) fn base_chain<F>(start: ChunkId, base_of: F) -> BaseChain<F>
where
    F: FnMut(&ChunkId) -> Result<Option<ChunkId>, RepoError>,
{
    BaseChain {
        start,
        next: Some(start),
        last: None,
        seen: HashSet::new(),
        base_of,
    }
}

/// See [`base_chain`].
pub(crate) struct BaseChain<F> {
    start: ChunkId,
    next: Option<ChunkId>,
    /// The chunk yielded last, whose base is not asked for yet.
    last: Option<ChunkId>,
    seen: HashSet<ChunkId>,
    base_of: F,
}

impl<F> Iterator for BaseChain<F>
where
    F: FnMut(&ChunkId) -> Result<Option<ChunkId>, RepoError>,
{
    type Item = Result<ChunkId, RepoError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(last) = self.last.take() {
            match (self.base_of)(&last) {
                Ok(b) => self.next = b,
                Err(e) => return Some(Err(e)),
            }
        }
        let id = self.next.take()?;
        let reason = if self.seen.contains(&id) {
            format!("delta chain loops back to chunk {} (a cycle)", id.short(12))
        } else if self.seen.len() > usize::from(HARD_MAX_CHAIN) {
            format!("delta chain longer than {HARD_MAX_CHAIN} (a cycle?)")
        } else {
            self.seen.insert(id);
            self.last = Some(id);
            return Some(Ok(id));
        };
        Some(Err(RepoError::Corrupt {
            site: Site::chunk(self.start),
            reason,
        }))
    }
}

/// Where a delta base's raw bytes come from while a chain is decoded.
pub(crate) enum Link<'a> {
    /// Bytes verified already (a cache, the local store).
    Raw(Cow<'a, [u8]>),
    /// A record to decode (through its own base) and verify.
    Record(ChunkRecord),
}

/// Decode chunk `id` from its record `rec`, through its delta chain:
/// `link` says, for each base, whether its bytes are at hand or which
/// record to decode. Records are decoded keyframe first; the result is
/// checked against `id` (a damaged base shows there; on any failure the
/// chain is decoded again checking each chunk, and the error names the
/// first damaged one). `max_raw` bounds
/// what any record may declare (and so every allocation); `from` is added
/// to the name of every chunk decoded here (`"received from the remote"`).
/// Returns the raw bytes and `rec`. `wrap` is applied to errors about the
/// records decoded here (not to `link`'s). The buffers it decodes into,
/// and the payloads of the records it decodes below `id`, come from and go
/// back to `pool` (the returned bytes and `rec` are the caller's).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_chain<'a, E>(
    id: &ChunkId,
    rec: ChunkRecord,
    max_raw: u64,
    from: &str,
    pool: &BufPool,
    wrap: impl Fn(RepoError) -> RepoError,
    mut link: impl FnMut(&ChunkId) -> Result<Link<'a>, E>,
) -> Result<(Vec<u8>, ChunkRecord), E>
where
    E: From<RepoError>,
{
    // Down the chain to a keyframe or to bytes at hand.
    let mut records: Vec<(ChunkId, ChunkRecord)> = Vec::new();
    let mut bottom: Option<Cow<'a, [u8]>> = None;
    let mut first = Some(rec);
    let mut failed: Option<E> = None;
    let walk = base_chain(*id, |c| {
        let rec = match first.take() {
            Some(r) => r,
            None => match link(c) {
                Ok(Link::Record(r)) => r,
                Ok(Link::Raw(raw)) => {
                    bottom = Some(raw);
                    return Ok(None);
                }
                Err(e) => {
                    failed = Some(e);
                    return Ok(None);
                }
            },
        };
        let base = rec.base;
        records.push((*c, rec));
        Ok(base)
    });
    for step in walk {
        step.map_err(&wrap)?;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // Up again: each record against its base's bytes. Only `id` itself is
    // checked against its blake3 id on the way up: its bytes depend on its
    // bases' (a damaged base shows in them), and they are what is returned.
    // If anything fails, the chain is decoded again checking every chunk,
    // so that the error names the first damaged one, as a walk checking
    // each would have. Intermediate bases go back to `pool` as they are
    // used up.
    let up = |check_all: bool| {
        with_scratch(|scratch| {
            let mut base: Option<Vec<u8>> = None;
            for (i, (c, rec)) in records.iter().enumerate().rev() {
                let b = base.as_deref().or(bottom.as_deref());
                let check = check_all || i == 0;
                let raw = decode_one(c, rec, b, max_raw, from, check, pool, scratch);
                if let Some(old) = base.take() {
                    pool.put(old);
                }
                base = Some(raw?);
            }
            // The walk records `id` itself before anything else.
            base.ok_or_else(|| RepoError::Corrupt {
                site: Site::chunk(*id),
                reason: "no record to decode".into(),
            })
        })
    };
    let raw = match up(false) {
        Ok(raw) => raw,
        Err(_) if records.len() > 1 => up(true).map_err(&wrap)?,
        Err(e) => return Err(wrap(e).into()),
    };
    if let Some(Cow::Owned(b)) = bottom {
        pool.put(b);
    }
    let mut records = records.into_iter();
    let Some((_, rec)) = records.next() else {
        // Not reached: `up` decoded at least `id` itself.
        return Err(wrap(RepoError::Corrupt {
            site: Site::chunk(*id),
            reason: "no record to decode".into(),
        })
        .into());
    };
    for (_, below) in records {
        pool.put(below.data);
    }
    Ok((raw, rec))
}

thread_local! {
    /// This thread's zstd context for opaque chunks (one per chunk
    /// allocated its tables every time; `ZSTD_createDCtx` alone was 1.2% of
    /// the small corpora's repo-bench).
    static UNZSTD: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Decode one record against its base's raw bytes and, with `check`,
/// check that the result hashes to `id` (its length is always checked).
#[allow(clippy::too_many_arguments)]
fn decode_one(
    id: &ChunkId,
    rec: &ChunkRecord,
    base: Option<&[u8]>,
    max_raw: u64,
    from: &str,
    check: bool,
    pool: &BufPool,
    scratch: &mut codec::Scratch,
) -> Result<Vec<u8>, RepoError> {
    let site = || Site::chunk(*id).received(from);
    let corrupt = |reason: String| RepoError::Corrupt {
        site: site(),
        reason,
    };
    let limit = max_raw.min(codec::HARD_MAX_RAW_LEN);
    // Every allocation below is bounded by this: a crafted record cannot
    // make a reader allocate gigabytes.
    if rec.raw_len > limit {
        return Err(corrupt(format!(
            "declares {} raw bytes, more than the {limit} a chunk may hold",
            rec.raw_len
        )));
    }
    let raw = match rec.payload {
        Payload::Zstd => {
            if rec.base.is_some() {
                return Err(corrupt("a zstd chunk with a delta base".into()));
            }
            // At most the buffer's capacity, at least `raw_len`: more than
            // `raw_len` is refused below.
            let mut out = pool.take(rec.raw_len as usize);
            UNZSTD
                .with_borrow_mut(|d| {
                    let d = match d {
                        Some(d) => d,
                        None => d.insert(zstd::bulk::Decompressor::new()?),
                    };
                    d.decompress_to_buffer(&rec.data, &mut out)
                })
                .map_err(|e| corrupt(format!("zstd: {e}")))?;
            out
        }
        Payload::Codec => {
            let mut out = pool.take(rec.raw_len as usize);
            codec::decode_into(&rec.data, base, rec.raw_len, &mut out, scratch).map_err(
                |source| RepoError::Decode {
                    site: site(),
                    source,
                },
            )?;
            out
        }
    };
    if raw.len() as u64 != rec.raw_len || (check && ChunkId::digest(&raw) != *id) {
        return Err(corrupt(
            "decoded bytes do not match the chunk id (blake3)".into(),
        ));
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn id(n: u8) -> ChunkId {
        ChunkId::from_bytes([n; 32])
    }

    /// Records of a three-chunk chain: `c` (delta) on `b` (delta) on `a`
    /// (keyframe), and the raw bytes of each.
    fn three_chunk_chain() -> (Vec<(ChunkId, ChunkRecord)>, Vec<Vec<u8>>) {
        let raws: Vec<Vec<u8>> = (0..3u32)
            .map(|k| {
                (0..4096u32)
                    .flat_map(|i| ((i as f32).sin() + k as f32 * 1e-3).to_le_bytes())
                    .collect()
            })
            .collect();
        let ids: Vec<ChunkId> = raws.iter().map(|r| ChunkId::digest(r)).collect();
        let opts = codec::Options::default();
        let recs = (0..3)
            .map(|k| {
                let base = (k > 0).then(|| raws[k - 1].as_slice());
                let rec = ChunkRecord {
                    payload: Payload::Codec,
                    raw_len: raws[k].len() as u64,
                    base: (k > 0).then(|| ids[k - 1]),
                    depth: k as u16,
                    written: 0,
                    data: codec::encode(&raws[k], base, crate::codec::DType::F32, &opts),
                };
                (ids[k], rec)
            })
            .collect();
        (recs, raws)
    }

    fn decode(recs: &[(ChunkId, ChunkRecord)], top: usize) -> Result<Vec<u8>, RepoError> {
        let by_id: HashMap<ChunkId, ChunkRecord> = recs.iter().cloned().collect();
        let (id, rec) = recs[top].clone();
        let pool = BufPool::new(64 << 20);
        decode_chain(
            &id,
            rec,
            1 << 30,
            "",
            &pool,
            |e| e,
            |c: &ChunkId| Ok::<_, RepoError>(Link::Record(by_id[c].clone())),
        )
        .map(|(raw, _)| raw)
    }

    #[test]
    fn a_chain_decodes_to_its_chunk_checking_the_result() {
        let (recs, raws) = three_chunk_chain();
        for (top, raw) in raws.iter().enumerate() {
            assert_eq!(&decode(&recs, top).unwrap(), raw);
        }
    }

    /// Only the chunk returned is hashed on the way up; a base that
    /// decodes cleanly to wrong bytes must still be named as the damage.
    #[test]
    fn a_base_decoding_to_wrong_bytes_is_named_not_the_chunk_on_top() {
        let (mut recs, raws) = three_chunk_chain();
        // The middle record replaced by a sound frame of other bytes.
        let mut other = raws[1].clone();
        other[100] ^= 0x40;
        recs[1].1.data = codec::encode(
            &other,
            Some(&raws[0]),
            crate::codec::DType::F32,
            &Default::default(),
        );
        let e = decode(&recs, 2).unwrap_err();
        assert!(e.is_corruption(), "{e}");
        assert_eq!(
            e.site().map(|s| s.to_string()),
            Some(Site::chunk(recs[1].0).to_string())
        );
        // The top chunk's own damage is named as its own.
        let (mut recs, _) = three_chunk_chain();
        recs[2].1.data = recs[1].1.data.clone();
        let e = decode(&recs, 2).unwrap_err();
        assert_eq!(
            e.site().map(|s| s.to_string()),
            Some(Site::chunk(recs[2].0).to_string())
        );
    }

    #[test]
    fn a_chain_is_walked_to_its_keyframe() {
        let bases: HashMap<ChunkId, ChunkId> = [(id(1), id(2)), (id(2), id(3))].into();
        let walked: Vec<ChunkId> = base_chain(id(1), |c| Ok(bases.get(c).copied()))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(walked, [id(1), id(2), id(3)]);
    }

    #[test]
    fn a_cycle_or_an_endless_chain_ends_in_an_error() {
        let cycle: HashMap<ChunkId, ChunkId> = [(id(1), id(2)), (id(2), id(1))].into();
        let steps: Vec<_> = base_chain(id(1), |c| Ok(cycle.get(c).copied())).collect();
        assert_eq!(steps.len(), 3);
        let e = steps[2].as_ref().unwrap_err();
        assert!(
            e.is_corruption() && e.to_string().contains("delta chain"),
            "{e}"
        );
        // Each chunk its own id + 1: an endless chain of distinct chunks.
        let next = |c: &ChunkId| {
            let n = u16::from_le_bytes([c.0[0], c.0[1]]) + 1;
            let mut b = [0u8; 32];
            b[..2].copy_from_slice(&n.to_le_bytes());
            Ok(Some(ChunkId::from_bytes(b)))
        };
        let steps: Vec<_> = base_chain(ChunkId::from_bytes([0; 32]), next).collect();
        assert_eq!(steps.len(), usize::from(HARD_MAX_CHAIN) + 2);
        assert!(steps[..steps.len() - 1].iter().all(Result::is_ok));
        assert!(steps.last().unwrap().is_err());
    }
}
