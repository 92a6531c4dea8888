//! Decoded delta bases kept between the chunks of one process's commits
//! and checkouts, so a chunk whose base was decoded (or committed) a moment
//! ago is not decoded again through its whole chain.
//!
//! Owns the bytes cap: the cache never holds more than its share of the
//! memory budget. Entries are raw chunk bytes already verified against
//! their blake3 id (decoded and checked, or hashed when committed), keyed
//! by that id, so a hit is as good as a decode.
//!
//! The policy fits how bases are used: chunk `k` of a tensor at one step is
//! the base of chunk `k` at the next step. A new entry is admitted while
//! there is room; one that replaces its own delta base (the next step of
//! that chain) is always admitted, in the base's place. So a sweep over a
//! checkpoint larger than the cache keeps the same prefix of its chains
//! from step to step instead of evicting everything before it is used
//! again (what least-recently-used would do), and when the cap shrinks
//! the oldest entries go first.
//!
//! Entries are buffers of the repository's [`BufPool`]: one given up by
//! the cache (evicted, replaced, refused) goes back to the pool once no
//! reader holds it, so caching a chunk allocates nothing.
//!
//! [`SharedBases`] lets one cache outlive the handle that filled it: the
//! Python package opens the repository anew for each save, and keeps the
//! chunks one save committed as the next save's bases.
//!
//! Must not: read the store.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::store::ChunkId;

use super::pool::BufPool;

/// A base cache for the handles one process opens on after another
/// ([`Repository::use_bases`](super::Repository::use_bases)): what one
/// commit decoded or committed is there for the next. Entries are keyed by
/// chunk id (blake3 of the raw bytes), so a cache is never stale, whatever
/// repository or commit filled it. Cloning shares the cache.
#[derive(Debug, Clone)]
pub struct SharedBases(pub(crate) Arc<BaseCache>);

impl SharedBases {
    /// An empty cache; it holds nothing until a handle sets its cap.
    pub fn new() -> Self {
        SharedBases(Arc::new(BaseCache::new(0)))
    }

    /// Bytes of chunks held now.
    pub fn held_bytes(&self) -> u64 {
        self.0.lock().bytes
    }

    /// Drop every entry (the cap stays).
    pub fn clear(&self) {
        let gone: Vec<_> = {
            let mut g = self.0.lock();
            g.bytes = 0;
            g.order.clear();
            g.map.drain().map(|(_, raw)| raw).collect()
        };
        drop(gone);
    }
}

impl Default for SharedBases {
    fn default() -> Self {
        Self::new()
    }
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct BaseCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    cap: u64,
    bytes: u64,
    map: HashMap<ChunkId, Arc<Vec<u8>>>,
    /// Insertion order (ids no longer in `map` are skipped when evicting).
    order: VecDeque<ChunkId>,
}

impl BaseCache {
    /// An empty cache of at most `cap` bytes.
    pub(crate) fn new(cap: u64) -> Self {
        BaseCache {
            inner: Mutex::new(Inner {
                cap,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new cap; entries over it are evicted, oldest first.
    pub(crate) fn set_cap(&self, cap: u64, pool: &BufPool) {
        let gone = {
            let mut g = self.lock();
            g.cap = cap;
            g.evict()
        };
        recycle(gone, pool);
    }

    /// The verified bytes of chunk `id`, if cached.
    pub(crate) fn get(&self, id: &ChunkId) -> Option<Arc<Vec<u8>>> {
        self.lock().map.get(id).cloned()
    }

    /// Keep `raw`, the verified bytes of chunk `id`, whose delta base is
    /// `base` (if any): in that base's place when it is cached, else only
    /// if it fits beside what is held.
    ///
    /// Borrowed bytes are copied into a pool buffer only when kept; owned
    /// ones move in (or go back to `pool`).
    pub(crate) fn insert(
        &self,
        id: ChunkId,
        raw: Cow<'_, [u8]>,
        base: Option<&ChunkId>,
        pool: &BufPool,
    ) {
        let len = raw.len() as u64;
        let give_back = |raw: Cow<'_, [u8]>| {
            if let Cow::Owned(v) = raw {
                pool.put(v);
            }
        };
        let mut gone = Vec::new();
        {
            let mut g = self.lock();
            if len > g.cap || g.map.contains_key(&id) {
                drop(g);
                give_back(raw);
                return;
            }
            let replaced = base.and_then(|b| g.map.remove(b));
            if let Some(old) = &replaced {
                g.bytes -= old.len() as u64;
            }
            if replaced.is_none() && g.bytes + len > g.cap {
                drop(g);
                give_back(raw);
                return;
            }
            gone.extend(replaced);
            g.bytes += len;
            let raw = match raw {
                Cow::Owned(v) => pool.fit(v),
                Cow::Borrowed(b) => {
                    let mut v = pool.take(b.len());
                    v.extend_from_slice(b);
                    pool.fit(v)
                }
            };
            g.map.insert(id, Arc::new(raw));
            g.order.push_back(id);
            gone.extend(g.evict());
        }
        recycle(gone, pool);
    }

    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    pub(crate) fn cap(&self) -> u64 {
        self.lock().cap
    }
}

impl Inner {
    /// Drops the oldest entries past the cap; returns them.
    fn evict(&mut self) -> Vec<Arc<Vec<u8>>> {
        let mut gone = Vec::new();
        while self.bytes > self.cap {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(raw) = self.map.remove(&old) {
                self.bytes -= raw.len() as u64;
                gone.push(raw);
            }
        }
        // Ids of entries replaced in place pile up in `order`: drop them
        // once they outnumber the live entries.
        if self.order.len() > 2 * self.map.len() + 16 {
            let map = &self.map;
            self.order.retain(|id| map.contains_key(id));
        }
        gone
    }
}

/// Gives the buffers of entries the cache let go back to `pool`; one a
/// reader still holds is freed by that reader instead.
fn recycle(gone: Vec<Arc<Vec<u8>>>, pool: &BufPool) {
    for raw in gone {
        if let Ok(raw) = Arc::try_unwrap(raw) {
            pool.put(raw);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> BufPool {
        BufPool::new(1 << 20)
    }

    fn chunk(n: u8, len: usize) -> (ChunkId, Vec<u8>) {
        let raw = vec![n; len];
        (ChunkId::digest(&raw), raw)
    }

    #[test]
    fn a_cleared_shared_cache_holds_nothing_and_keeps_its_cap() {
        let shared = SharedBases::new();
        shared.0.set_cap(1 << 20, &pool());
        let (id, raw) = chunk(1, 1000);
        shared.0.insert(id, raw.as_slice().into(), None, &pool());
        assert_eq!(shared.held_bytes(), 1000);
        shared.clear();
        assert_eq!(shared.held_bytes(), 0);
        assert!(shared.0.get(&id).is_none());
        assert_eq!(shared.0.cap(), 1 << 20);
        shared.0.insert(id, raw.as_slice().into(), None, &pool());
        assert_eq!(shared.held_bytes(), 1000);
    }

    #[test]
    fn gives_back_the_same_bytes() {
        let c = BaseCache::new(1000);
        let (id, raw) = chunk(1, 100);
        assert!(c.get(&id).is_none());
        c.insert(id, raw.as_slice().into(), None, &pool());
        assert_eq!(
            c.get(&id).as_deref().map(Vec::as_slice),
            Some(raw.as_slice())
        );
    }

    #[test]
    fn never_holds_more_than_its_cap() {
        let c = BaseCache::new(250);
        let chunks: Vec<_> = (0..5).map(|n| chunk(n, 100)).collect();
        for (id, raw) in &chunks {
            c.insert(*id, raw.as_slice().into(), None, &pool());
            assert!(c.bytes() <= 250);
        }
        // Admitted while there was room; later ones were not.
        assert!(c.get(&chunks[0].0).is_some() && c.get(&chunks[1].0).is_some());
        assert!(c.get(&chunks[2].0).is_none());
        // An entry bigger than the cap is never kept.
        let (big, raw) = chunk(9, 300);
        c.insert(big, raw.as_slice().into(), None, &pool());
        assert!(c.get(&big).is_none());
        // The next step of a cached chain takes its base's place.
        let (next, raw) = chunk(7, 100);
        c.insert(next, raw.as_slice().into(), Some(&chunks[0].0), &pool());
        assert!(c.get(&chunks[0].0).is_none());
        assert_eq!(
            c.get(&next).as_deref().map(Vec::as_slice),
            Some(raw.as_slice())
        );
        assert_eq!(c.bytes(), 200);
        // A smaller cap evicts the oldest first.
        c.set_cap(100, &pool());
        assert!(c.get(&chunks[1].0).is_none());
        assert!(c.get(&next).is_some());
        assert!(c.bytes() <= 100);
        c.set_cap(0, &pool());
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn replacing_in_place_forever_stays_bounded() {
        let c = BaseCache::new(1000);
        let (mut prev, raw) = chunk(0, 10);
        c.insert(prev, raw.as_slice().into(), None, &pool());
        for n in 1..=255u8 {
            let (id, raw) = chunk(n, 10);
            c.insert(id, raw.as_slice().into(), Some(&prev), &pool());
            prev = id;
        }
        assert_eq!(c.bytes(), 10);
        let g = c.lock();
        assert!(g.order.len() <= 2 * g.map.len() + 16);
    }
}
