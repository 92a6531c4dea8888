//! Delta chains: the one walk down a chunk's bases ([`base_chain`]) and the
//! one way a chunk record becomes raw bytes ([`decode_chain`]).
//!
//! Owns the bound on delta chains: no walk follows more than
//! [`HARD_MAX_CHAIN`] bases or visits a chunk twice, whatever the records
//! say, so a cycle or an absurd chain is corruption, never a hang. Every
//! other module walks chains through [`base_chain`]; none counts hops
//! itself. Decoding (local reads, fetched records) goes through
//! [`decode_chain`], which checks every decoded chunk against its blake3
//! id before its bytes are used as a base or returned.
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
/// record to decode. Records are decoded keyframe first; each decoded
/// chunk is checked against its id before it is used. `max_raw` bounds
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
    // Up again: each record against its base's verified bytes.
    let mut base = bottom;
    while let Some((c, rec)) = records.pop() {
        let raw = with_scratch(|scratch| {
            decode_one(&c, &rec, base.as_deref(), max_raw, from, pool, scratch)
        })
        .map_err(&wrap)?;
        if let Some(Cow::Owned(old)) = base.take() {
            pool.put(old);
        }
        if records.is_empty() {
            return Ok((raw, rec));
        }
        pool.put(rec.data);
        base = Some(Cow::Owned(raw));
    }
    // Not reached: the walk records `id` itself before anything else.
    Err(wrap(RepoError::Corrupt {
        site: Site::chunk(*id),
        reason: "no record to decode".into(),
    })
    .into())
}

/// Decode one record against its base's raw bytes and check that the
/// result hashes to `id`.
fn decode_one(
    id: &ChunkId,
    rec: &ChunkRecord,
    base: Option<&[u8]>,
    max_raw: u64,
    from: &str,
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
            zstd::bulk::Decompressor::new()
                .and_then(|mut d| d.decompress_to_buffer(&rec.data, &mut out))
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
    if raw.len() as u64 != rec.raw_len || ChunkId::digest(&raw) != *id {
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
