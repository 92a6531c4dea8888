//! Chunk-sized buffers reused across the chunks of a commit or checkout.
//!
//! Every stage of the commit and checkout pipelines handles multi-MiB
//! buffers (raw chunks, delta bases, encoded frames, stored records,
//! decoded chunks), one or more per chunk. Freed, such buffers stay in
//! glibc's per-thread arenas (its mmap threshold rises after the first
//! frees), so a process that allocates one per chunk ends with a resident
//! size well above the data it holds live. Buffers handed back here are
//! given out again instead: the allocator's footprint stays near the live
//! data, and no page is faulted in afresh for each chunk.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::codec::Scratch;

thread_local! {
    /// The codec's scratch buffers of this thread, kept from chunk to
    /// chunk (a few chunk sizes per thread that codes).
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// Runs `f` with this thread's codec scratch (a fresh one when a caller
/// further up the stack holds it).
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    let mut s = SCRATCH.with(Cell::take);
    let out = f(&mut s);
    SCRATCH.with(|c| c.set(s));
    out
}

/// Idle buffers, bounded in bytes (a share of the memory budget, see
/// [`pool_bytes`]): a buffer handed back past the bound is freed.
#[derive(Debug)]
pub(crate) struct BufPool {
    inner: Mutex<Idle>,
    /// Buffers [`BufPool::take`] had to allocate or grow.
    fresh: AtomicU64,
}

#[derive(Debug, Default)]
struct Idle {
    bufs: Vec<Vec<u8>>,
    /// Capacity of `bufs`, summed.
    bytes: u64,
    cap: u64,
}

/// The bytes of idle buffers a pool keeps for a memory budget. Idle
/// buffers are what the pipelines held live a moment ago, so keeping them
/// adds nothing to the peak; the bound only keeps a burst (a large window,
/// a deep chain) from being held for the rest of the process.
pub(crate) fn pool_bytes(budget: u64) -> u64 {
    // At least what the pipelines' floors keep in flight whatever the
    // budget (checkout: three windows of at least 8 MiB; commit: a store
    // batch of at least 4 MiB), or a small budget would free and allocate
    // a window's buffers every window.
    (budget / 4).max(32 << 20)
}

/// The capacity given to a pooled buffer asked to hold `n` bytes: a
/// little more, rounded up, so the buffers of one pipeline (a raw chunk,
/// its frame, which may exceed it by the block table, its record, 53
/// bytes more) come in one size and any idle one serves any request.
fn class(n: usize) -> usize {
    (n + n / 64).next_multiple_of(SMALL)
}

/// Buffers smaller than this are not pooled: malloc serves them from its
/// small bins without faulting in pages, and a small request must not
/// take (and pin) a chunk-sized buffer.
const SMALL: usize = 64 << 10;

impl BufPool {
    pub(crate) fn new(cap: u64) -> Self {
        BufPool {
            inner: Mutex::new(Idle {
                cap,
                ..Idle::default()
            }),
            fresh: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_cap(&self, cap: u64) {
        let mut g = self.lock();
        g.cap = cap;
        while g.bytes > g.cap {
            let Some(b) = g.bufs.pop() else { break };
            g.bytes -= b.capacity() as u64;
        }
    }

    /// An empty buffer with room for at least `n` bytes: the smallest idle
    /// one that fits, else the largest (grown), else a new one. A request
    /// below [`SMALL`] gets a new buffer of its own size, except `n == 0`
    /// (a size not known yet: a value read from the store), which takes
    /// the largest idle buffer; hand it back soon, or [`BufPool::fit`] it.
    pub(crate) fn take(&self, n: usize) -> Vec<u8> {
        let mut b = self.pick(n);
        b.clear();
        self.ensure(&mut b, n);
        b
    }

    /// The buffer [`BufPool::take`] would hand out, as it was handed back:
    /// its length is how many of its bytes hold data (initialised).
    fn pick(&self, n: usize) -> Vec<u8> {
        if n > 0 && n < SMALL {
            return Vec::with_capacity(n);
        }
        let mut g = self.lock();
        let fits = g
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| n > 0 && b.capacity() >= n)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let pick = fits.or_else(|| {
            g.bufs
                .iter()
                .enumerate()
                .max_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)
        });
        match pick {
            Some(i) => {
                let b = g.bufs.swap_remove(i);
                g.bytes -= b.capacity() as u64;
                b
            }
            // A value of a size not known yet, chunk-sized on the hot
            // paths: it will allocate.
            None if n == 0 => {
                drop(g);
                self.fresh.fetch_add(1, Ordering::Relaxed);
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    /// Room for `n` bytes in `b`, emptied first if it has too little.
    fn ensure(&self, b: &mut Vec<u8>, n: usize) {
        if b.capacity() < n {
            b.clear();
            self.fresh.fetch_add(1, Ordering::Relaxed);
            b.reserve_exact(class(n));
        }
    }

    /// A buffer of `n` bytes (contents unspecified): the bytes a reused
    /// buffer already holds are left as they are, only the rest zeroed (a
    /// chunk-sized memset per buffer was 4-6% of a delta commit's CPU).
    pub(crate) fn get(&self, n: usize) -> Vec<u8> {
        let mut b = self.pick(n);
        self.ensure(&mut b, n);
        if b.len() >= n {
            b.truncate(n);
        } else {
            b.resize(n, 0);
        }
        b
    }

    /// Hands `b` back for reuse (freed when the pool is full).
    pub(crate) fn put(&self, b: Vec<u8>) {
        let cap = b.capacity() as u64;
        if b.capacity() < SMALL {
            return;
        }
        let mut g = self.lock();
        if g.bytes + cap <= g.cap {
            g.bytes += cap;
            g.bufs.push(b);
        }
    }

    /// `b`, or a copy of its bytes in a buffer of their size (`b` handed
    /// back) when `b` is much larger than what it holds: for bytes kept for
    /// long, which must not pin a chunk-sized buffer.
    pub(crate) fn fit(&self, b: Vec<u8>) -> Vec<u8> {
        if b.capacity() <= 2 * b.len().max(SMALL) {
            return b;
        }
        let mut small = self.take(b.len().max(1));
        small.extend_from_slice(&b);
        self.put(b);
        small
    }

    /// How many buffers [`BufPool::take`] allocated or grew so far (an
    /// empty pool's buffer of unknown size included): with
    /// the pool doing its job, a number that stops growing once the
    /// pipeline is full, whatever the number of chunks.
    #[cfg(test)]
    pub(crate) fn fresh(&self) -> u64 {
        self.fresh.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_back_what_fits_and_stays_within_its_cap() {
        const K: usize = SMALL;
        let p = BufPool::new(10 * K as u64);
        let a = p.get(4 * K);
        assert_eq!(a.len(), 4 * K);
        assert_eq!(p.fresh(), 1);
        p.put(a);
        let b = p.take(2 * K);
        assert!(b.is_empty() && b.capacity() >= 4 * K);
        assert_eq!(p.fresh(), 1);
        p.put(b);
        // Too small: the idle buffer is grown, which counts.
        let c = p.get(8 * K);
        assert_eq!(p.fresh(), 2);
        let d = p.get(8 * K);
        p.put(c);
        p.put(d);
        assert!(p.lock().bytes <= 10 * K as u64);
        assert_eq!(p.lock().bufs.len(), 1);
        // A small request never takes (and pins) a pooled buffer.
        let e = p.take(100);
        assert!(e.capacity() < K);
        assert_eq!(p.lock().bufs.len(), 1);
        // Few bytes in a big buffer: copied out, the buffer kept.
        let mut f = p.take(0);
        f.extend_from_slice(b"abc");
        let f = p.fit(f);
        assert_eq!(f, b"abc");
        assert!(f.capacity() < K);
        assert_eq!(p.lock().bufs.len(), 1);
        p.set_cap(0);
        assert_eq!(p.lock().bytes, 0);
    }

    /// `get` hands a reused buffer out with the bytes it held (no memset
    /// of a chunk per read), zeroing only what it never held: its length
    /// is always the one asked.
    #[test]
    fn get_leaves_the_bytes_a_reused_buffer_held() {
        const K: usize = SMALL;
        let p = BufPool::new(10 * K as u64);
        let mut a = Vec::with_capacity(8 * K);
        a.resize(4 * K, 7u8);
        p.put(a);
        let b = p.get(2 * K);
        assert_eq!(b.len(), 2 * K);
        assert!(b.iter().all(|&x| x == 7));
        p.put(b);
        let c = p.get(6 * K);
        assert_eq!(c.len(), 6 * K);
        assert!(c[..2 * K].iter().all(|&x| x == 7) && c[2 * K..].iter().all(|&x| x == 0));
        assert_eq!(p.fresh(), 0);
    }

    /// A safetensors file of one F32 tensor of `n` elements, `phase`
    /// shifting its values (a training step).
    fn safetensors(n: usize, phase: f32) -> Vec<u8> {
        let bytes = n * 4;
        let mut h =
            format!(r#"{{"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{bytes}]}}}}"#)
                .into_bytes();
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        for i in 0..n {
            let x = (i as f32 * 0.001 + phase).sin() * (1.0 + (i % 7) as f32);
            out.extend_from_slice(&x.to_le_bytes());
        }
        out
    }

    /// Buffers the pool allocated over two commits (the second a delta)
    /// and two checkouts of a checkpoint of `chunks` chunks.
    fn fresh_buffers(chunks: usize) -> u64 {
        use crate::repo::{CheckoutOptions, CommitOptions, Config, Repository};
        let dir = tempfile::tempdir().expect("tempdir");
        let chunk = 4 * SMALL;
        let config = Config {
            chunk_bytes: chunk as u64,
            memory_budget: 64 * chunk as u64,
            ..Config::default()
        };
        let repo = Repository::init(&dir.path().join("repo"), config).expect("init");
        let mut ids = Vec::new();
        for step in 1..=2u64 {
            let ck = dir.path().join(format!("checkpoint-{step}"));
            std::fs::create_dir_all(&ck).expect("mkdir");
            let file = safetensors(chunks * chunk / 4, step as f32 * 1e-3);
            std::fs::write(ck.join("model.safetensors"), &file).expect("write");
            let opts = CommitOptions {
                step: Some(step),
                code: Some(dir.path().to_path_buf()),
                ..CommitOptions::default()
            };
            ids.push(repo.commit(&ck, &opts).expect("commit").id);
        }
        for (n, id) in ids.iter().enumerate() {
            let out = dir.path().join(format!("out-{n}"));
            repo.checkout(id, &out, &CheckoutOptions::default())
                .expect("checkout");
            let want = std::fs::read(
                dir.path()
                    .join(format!("checkpoint-{}/model.safetensors", n + 1)),
            );
            let got = std::fs::read(out.join("model.safetensors"));
            assert_eq!(got.expect("read"), want.expect("read"));
        }
        repo.pool.fresh()
    }

    /// The pipelines reuse their chunk buffers: the buffers allocated
    /// depend on how many chunks are in flight at once (queues, windows,
    /// threads: it varies with scheduling, 50-106 seen here), not on how
    /// many chunks the checkpoint has. Two commits and two checkouts
    /// handle every chunk four times, so a buffer allocated per chunk in
    /// any stage would make at least as many buffers as chunks.
    #[test]
    fn commit_and_checkout_allocate_no_buffer_per_chunk() {
        let chunks = 384;
        let fresh = fresh_buffers(chunks);
        assert!(
            fresh < chunks as u64,
            "{chunks} chunks: {fresh} buffers allocated"
        );
    }
}
