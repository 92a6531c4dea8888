//! Helpers for tests, examples and fuzz seeds; compiled only for the
//! crate's own tests or with the `testing` feature (which `tests/` and
//! `examples/` get through the crate's dev-dependency on itself). Not part
//! of the library's API.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use crate::store::{Batch, ScanFn, Space, Store, StoreError};

/// A deterministic generator (xorshift64*) for synthetic benchmark inputs
/// and randomised test schedules: the same seed gives the same bytes
/// everywhere. Not for anything that needs unpredictability.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits. The seed must not be zero.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Fill `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            c.copy_from_slice(&self.next_u64().to_le_bytes()[..c.len()]);
        }
    }
}

/// `g` quantized to `levels` evenly spaced values (step `0.12 / levels`,
/// clamped to the levels around 0): a quantized weight, for the palette
/// frames' tests and `examples/palette_bound.rs`.
pub fn quantize(g: &[f32], levels: u32) -> Vec<f32> {
    let step = 0.12 / levels as f32;
    let half = levels as f32 / 2.0;
    g.iter()
        .map(|&x| (x / step).round().clamp(-half, half - 1.0) * step)
        .collect()
}

/// A store that forwards to `inner` and lets a test watch or break it:
/// counts reads of the `chunks` space (so a test can say "this read no
/// chunk" without timing anything) and fails every write after
/// `writes_left` writes with "No space left on device" (a full disk); with
/// `panic_on_index` set, panics on a lookup in the `index` space (a bug in
/// whatever asked: a commit's reader asks there first for each chunk).
pub struct Instrumented<S: Store> {
    pub inner: S,
    pub chunk_gets: AtomicU64,
    /// Reads (`get`) and `contains` answering "stored" of chunk records of
    /// at least `HEAD_MIN_RECORD` bytes (the ones kept in blob files).
    pub large_chunk_reads: AtomicU64,
    pub writes_left: AtomicI64,
    pub panic_on_index: AtomicBool,
}

impl<S: Store> Instrumented<S> {
    pub fn new(inner: S) -> Self {
        Instrumented {
            inner,
            chunk_gets: AtomicU64::new(0),
            large_chunk_reads: AtomicU64::new(0),
            writes_left: AtomicI64::new(i64::MAX),
            panic_on_index: AtomicBool::new(false),
        }
    }
}

impl<S: Store> Instrumented<S> {
    fn count_large(&self, record: &[u8]) {
        if record.len() >= crate::repo::objects::HEAD_MIN_RECORD {
            self.large_chunk_reads.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<S: Store> Store for Instrumented<S> {
    fn get(&self, space: Space, key: &[u8], buf: &mut Vec<u8>) -> Result<bool, StoreError> {
        let found = self.inner.get(space, key, buf)?;
        if space == Space::Chunks {
            self.chunk_gets.fetch_add(1, Ordering::Relaxed);
            self.count_large(buf);
        }
        Ok(found)
    }
    fn contains(&self, space: Space, key: &[u8]) -> Result<bool, StoreError> {
        if space == Space::Index && self.panic_on_index.load(Ordering::SeqCst) {
            panic!("a bug in the commit pipeline");
        }
        let found = self.inner.contains(space, key)?;
        if found && space == Space::Chunks {
            let mut v = Vec::new();
            self.inner.get(space, key, &mut v)?;
            self.count_large(&v);
        }
        Ok(found)
    }
    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        if self.writes_left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(StoreError::Io {
                path: "/full".into(),
                source: std::io::Error::from_raw_os_error(28), // ENOSPC
            });
        }
        self.inner.write(batch)
    }
    fn scan_prefix(
        &self,
        space: Space,
        prefix: &[u8],
        f: &mut ScanFn<'_>,
    ) -> Result<(), StoreError> {
        self.inner.scan_prefix(space, prefix, f)
    }
    fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush()
    }
    fn compact(&self) -> Result<(), StoreError> {
        self.inner.compact()
    }
}
