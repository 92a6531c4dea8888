//! A file from memory that a commit reads from its start while a copier
//! thread copies it from its end into a staging buffer, for a caller that
//! must let go of the file's bytes before the commit is done (the Python
//! package's first background save reads the training state where it
//! lives, and training may change it once it is let go).
//!
//! The file is cut into units (at most [`MAX_UNIT`] bytes). Each unit is
//! claimed once, by the commit's reader from the front or by the copier
//! from the back, with one compare-and-swap on the packed pair (units
//! claimed from the front, first unit claimed from the back). The reader
//! copies every byte it reads of its own units into a pooled buffer, so
//! nothing it queued points into the caller's memory; of the copier's
//! units it reads the staging buffer, once each is marked copied. When
//! the two meet and the reader has copied its last unit, no byte of the
//! caller's memory will be read again: the copier calls the caller's
//! `release` then, while the commit goes on from the staging buffer.
//!
//! Owns: the claims, the copied marks and the release. Must not: encode,
//! store, or know the file's format.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::commit::{Parts, Raw};
use super::pool::BufPool;

/// The largest unit. Once reader and copier meet, the reader has at most
/// one unit of its own left to read before the release; at the commit's
/// reading speed of a background save (0.15-0.4 GiB/s), 16 MiB is under
/// 0.1 s.
pub(super) const MAX_UNIT: u64 = 16 << 20;

/// The smallest unit (a small file is cut into about 64 units, so that
/// both ends take part whatever its size).
const MIN_UNIT: u64 = 64 << 10;

/// A file of `len` bytes mirrored into a staging buffer; see the module
/// doc.
pub(super) struct Mirror<'s> {
    staging: *mut u8,
    len: u64,
    unit: u64,
    /// Units claimed from the front (high half) and the first unit claimed
    /// from the back (low half; `units` while none is).
    claims: AtomicU64,
    /// Per unit: the copier has copied it into the staging buffer.
    copied: Vec<AtomicBool>,
    /// The commit is over: the copier stops and releases nothing.
    stop: AtomicBool,
    /// `release` refused (its error is in `State::released`): the reader
    /// fails its next chunk rather than commit the rest for nothing.
    refused: AtomicBool,
    state: Mutex<State>,
    cond: Condvar,
    _staging: PhantomData<&'s mut [u8]>,
}

#[derive(Default)]
struct State {
    /// The reader reads no more of the caller's memory.
    live_done: bool,
    /// What `release` returned, once it ran (or why it never will).
    released: Option<Result<(), String>>,
    /// The copier ended without copying its units (it panicked).
    dead: bool,
}

// SAFETY: the staging buffer is written only by the copier, each unit once
// (after claiming it, which no other thread can), and read only by the
// reader after that unit's `copied` mark, set with `Release` after the
// write and read with `Acquire` before the read. The buffer is borrowed
// mutably for 's, so nothing else touches it meanwhile.
unsafe impl Sync for Mirror<'_> {}

const COPIER_DIED: &str = "the thread copying the file into the staging buffer stopped";
pub(super) const PAST_END: &str = "the file's layout runs past its end";

/// Faults `buf`'s pages in, writable, before a copy into them (fresh
/// memory: 1.4 GiB copied 16 MiB at a time took 0.83-1.08 s this way
/// against 1.05-1.30 s faulting a page at a time, three alternating runs).
/// Best effort: a kernel without the advice leaves the faults to the copy.
fn populate(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = buf.as_mut_ptr() as usize;
        let from = start / PAGE * PAGE;
        // SAFETY: the advice only faults in the pages `buf` lies on
        // (mapped and writable, as `buf` is); it neither reads nor changes
        // their bytes, so rounding down to the page `buf` starts in (bytes
        // before it another thread may be writing) is harmless.
        unsafe {
            libc::madvise(
                from as *mut libc::c_void,
                start + buf.len() - from,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

const fn pack(front: u32, back: u32) -> u64 {
    ((front as u64) << 32) | back as u64
}

const fn unpack(c: u64) -> (u32, u32) {
    ((c >> 32) as u32, c as u32)
}

impl<'s> Mirror<'s> {
    /// A mirror of a file of `len` bytes into `staging` (`None` when the
    /// buffer is shorter, or the file has more units than fit the claims).
    pub(super) fn new(staging: &'s mut [u8], len: u64) -> Option<Mirror<'s>> {
        if (staging.len() as u64) < len {
            return None;
        }
        let unit = (len / 64).clamp(MIN_UNIT, MAX_UNIT).next_multiple_of(4096);
        let units = u32::try_from(len.div_ceil(unit)).ok()?;
        Some(Mirror {
            staging: staging.as_mut_ptr(),
            len,
            unit,
            claims: AtomicU64::new(pack(0, units)),
            copied: (0..units).map(|_| AtomicBool::new(false)).collect(),
            stop: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            cond: Condvar::new(),
            _staging: PhantomData,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unit_of(&self, at: u64) -> u32 {
        (at / self.unit) as u32
    }

    /// Where unit `u` starts, and where the next one does.
    fn bounds(&self, u: u32) -> (u64, u64) {
        let s = u as u64 * self.unit;
        (s, (s + self.unit).min(self.len))
    }

    /// Claims units from the front up to unit `u` (while the copier has
    /// not); returns how many the reader holds, and whether every unit is
    /// claimed.
    fn claim_front_to(&self, u: u32) -> (u32, bool) {
        let mut c = self.claims.load(Ordering::Acquire);
        loop {
            let (front, back) = unpack(c);
            if front > u || front >= back {
                return (front, front >= back);
            }
            match self.claims.compare_exchange_weak(
                c,
                pack(front + 1, back),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => c = pack(front + 1, back),
                Err(now) => c = now,
            }
        }
    }

    /// Claims the last unit not yet claimed, for the copier.
    fn claim_back(&self) -> Option<u32> {
        let mut c = self.claims.load(Ordering::Acquire);
        loop {
            let (front, back) = unpack(c);
            if back <= front {
                return None;
            }
            match self.claims.compare_exchange_weak(
                c,
                pack(front, back - 1),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(back - 1),
                Err(now) => c = now,
            }
        }
    }

    /// The reader reads no more of the caller's memory.
    fn live_done(&self) {
        let mut st = self.lock();
        if !st.live_done {
            st.live_done = true;
            self.cond.notify_all();
        }
    }

    /// Waits until units `from..=to` are copied into the staging buffer;
    /// an error when the copier died first.
    fn wait_copied(&self, from: u32, to: u32) -> Result<(), String> {
        let ready = |u: u32| self.copied[u as usize].load(Ordering::Acquire);
        if (from..=to).all(ready) {
            return Ok(());
        }
        let mut st = self.lock();
        for u in from..=to {
            while !ready(u) {
                if st.dead {
                    return Err(COPIER_DIED.into());
                }
                st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        Ok(())
    }

    /// Staging bytes `at..end`, all in units the copier has copied.
    fn staged(&self, at: u64, end: u64) -> &'s [u8] {
        // SAFETY: in bounds (`end <= len <= staging.len()`), and written
        // for good (`wait_copied` saw every unit's mark): see `Sync`.
        unsafe { std::slice::from_raw_parts(self.staging.add(at as usize), (end - at) as usize) }
    }

    /// Bytes `at..at + n` of the file (from `parts`, the caller's memory),
    /// for the commit's reader, which reads the file in order from its
    /// start; an error (the reason) when they run past the file's end.
    pub(super) fn chunk(
        &self,
        parts: &Parts<'_>,
        at: u64,
        n: usize,
        pool: &BufPool,
    ) -> Result<Raw<'s>, String> {
        let past = || String::from(PAST_END);
        let end = at
            .checked_add(n as u64)
            .filter(|&e| e <= self.len)
            .ok_or_else(past)?;
        if n == 0 {
            return Ok(Raw::Owned(Vec::new()));
        }
        if self.refused.load(Ordering::Acquire) {
            return Err(self.finish().err().unwrap_or_default());
        }
        let (u0, u1) = (self.unit_of(at), self.unit_of(end - 1));
        let (front, all_claimed) = self.claim_front_to(u1);
        // The reader's bytes: the first `front` units.
        let mine_end = self.bounds(front).0.min(self.len);
        if at >= mine_end {
            // all the copier's (so every unit is claimed)
            self.live_done();
            self.wait_copied(u0, u1)?;
            return Ok(Raw::Borrowed(self.staged(at, end)));
        }
        let mut raw = pool.get(n);
        let k = (mine_end.min(end) - at) as usize;
        if parts.copy_to(at, &mut raw[..k]) != k {
            pool.put(raw);
            return Err(past());
        }
        if k < n {
            self.live_done();
            if let Err(e) = self.wait_copied(self.unit_of(mine_end), u1) {
                pool.put(raw);
                return Err(e);
            }
            raw[k..].copy_from_slice(self.staged(mine_end, end));
        } else if end == mine_end && all_claimed {
            self.live_done();
        }
        Ok(Raw::Owned(raw))
    }

    /// The copier: copies unclaimed units from the back of `parts` into the
    /// staging buffer until it meets the reader, then waits until the
    /// reader is done with the caller's memory and calls `release`, unless
    /// the commit ended first ([`Mirror::stop`]). Should it panic (a bug),
    /// the reader and the commit's end get an error instead of waiting.
    pub(super) fn copy_from_back(
        &self,
        parts: &Parts<'_>,
        release: &(dyn Fn() -> Result<(), String> + Sync),
    ) {
        let run = std::panic::AssertUnwindSafe(|| self.copy_and_release(parts, release));
        if let Err(p) = std::panic::catch_unwind(run) {
            let mut st = self.lock();
            st.dead = true;
            if st.released.is_none() {
                st.released = Some(Err(COPIER_DIED.into()));
            }
            self.cond.notify_all();
            drop(p);
        }
    }

    fn copy_and_release(
        &self,
        parts: &Parts<'_>,
        release: &(dyn Fn() -> Result<(), String> + Sync),
    ) {
        while let Some(u) = self.claim_back() {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let (s, e) = self.bounds(u);
            // SAFETY: unit `u` is this thread's alone (claimed once) and
            // in bounds; nothing reads it before its mark below.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(self.staging.add(s as usize), (e - s) as usize)
            };
            populate(dst);
            // `parts` holds `len` bytes, so the copy is whole.
            parts.copy_to(s, dst);
            let _st = self.lock();
            self.copied[u as usize].store(true, Ordering::Release);
            self.cond.notify_all();
        }
        let mut st = self.lock();
        while !st.live_done && !self.stop.load(Ordering::Relaxed) {
            st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if self.stop.load(Ordering::Relaxed) {
            return;
        }
        drop(st);
        let r = release();
        let mut st = self.lock();
        self.refused.store(r.is_err(), Ordering::Release);
        st.released = Some(r);
        self.cond.notify_all();
    }

    /// Every byte of the file has been read: waits for the copier's
    /// release and returns what it returned.
    pub(super) fn finish(&self) -> Result<(), String> {
        self.live_done();
        let mut st = self.lock();
        loop {
            if let Some(r) = &st.released {
                return r.clone();
            }
            st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The commit is over: the copier stops (at its next unit) and
    /// releases nothing it has not released yet.
    pub(super) fn stop(&self) {
        let _st = self.lock();
        self.stop.store(true, Ordering::Relaxed);
        self.cond.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn units_are_claimed_once_each_from_either_end() {
        let mut staging = vec![0u8; 10 * MIN_UNIT as usize];
        let m = Mirror::new(&mut staging, 10 * MIN_UNIT).expect("mirror");
        assert_eq!(m.claim_front_to(2), (3, false));
        assert_eq!(m.claim_back(), Some(9));
        assert_eq!(m.claim_back(), Some(8));
        assert_eq!(m.claim_front_to(7), (8, true));
        assert_eq!(m.claim_back(), None);
        assert_eq!(m.claim_front_to(9), (8, true));
    }

    #[test]
    fn a_reader_that_meets_the_copier_reads_the_rest_from_the_staging_buffer() {
        // The reader takes the first units, the copier all the others;
        // the release overwrites the caller's memory, and every chunk the
        // reader gets after it holds the bytes from before.
        let len = 64 * MIN_UNIT as usize + 12_345;
        let want: Vec<u8> = (0..len).map(|i| (i * 7 + i / 999) as u8).collect();
        let mut live = want.clone();
        let addr = live.as_mut_ptr() as usize;
        // SAFETY: `live` outlives the parts. They alias the release's
        // writes, as a tensor aliases training's (see `Mirror`).
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(addr as *const u8, 1000),
                std::slice::from_raw_parts((addr + 1000) as *const u8, len - 1000),
            )
        };
        let parts = Parts::new(vec![a, b]);
        let mut staging = vec![0u8; len];
        let m = Mirror::new(&mut staging, len as u64).expect("mirror");
        let pool = BufPool::new(64 << 20);
        let released = AtomicUsize::new(0);
        let release = || {
            released.fetch_add(1, Ordering::SeqCst);
            // SAFETY: as above; in bounds.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len) };
            Ok(())
        };
        let piece = 50_000;
        let mut got = Vec::with_capacity(len);
        let read = |got: &mut Vec<u8>, at: usize| {
            let n = piece.min(len - at);
            let raw = m.chunk(&parts, at as u64, n, &pool).expect("chunk");
            got.extend_from_slice(&raw);
            at + n
        };
        std::thread::scope(|s| {
            let mut at = 0;
            // the reader's first units, read before the copier starts
            while at < 3 * MIN_UNIT as usize {
                at = read(&mut got, at);
            }
            assert!(matches!(m.chunk(&parts, 0, 1, &pool), Ok(Raw::Owned(_))));
            let copier = s.spawn(|| m.copy_from_back(&parts, &release));
            while unpack(m.claims.load(Ordering::Acquire)).1 > 4 {
                std::thread::yield_now();
            }
            assert_eq!(released.load(Ordering::SeqCst), 0, "the reader is not done");
            // a chunk across the meeting point, then only staged ones
            while at < len {
                at = read(&mut got, at);
            }
            assert_eq!(m.finish(), Ok(()));
            copier.join().expect("copier");
        });
        assert_eq!(released.into_inner(), 1);
        assert_eq!(got, want);
        assert!(matches!(
            m.chunk(&parts, len as u64 - 10, 10, &pool),
            Ok(Raw::Borrowed(_))
        ));
        assert!(m.chunk(&parts, len as u64 - 10, 11, &pool).is_err());
    }

    #[test]
    fn every_file_length_and_chunk_size_reads_the_state_at_the_call() {
        let u = MIN_UNIT as usize;
        let lens = [
            0,
            1,
            4095,
            4096,
            u - 1,
            u,
            u + 1,
            2 * u + 3,
            63 * u + 5,
            64 * u - 1,
            64 * u,
            64 * u + 1,
            70 * u + 4097,
            5_000_003,
        ];
        let pool = BufPool::new(64 << 20);
        for len in lens {
            for piece in [1usize, 777, 4096, u, u + 1, 300_000, len.max(1)] {
                if len / piece > 200_000 {
                    continue;
                }
                for round in 0..6 {
                    let want: Vec<u8> = (0..len).map(|i| (i * 31 + i / 251 + 1) as u8).collect();
                    let mut live = want.clone();
                    let addr = live.as_mut_ptr() as usize;
                    let cut = (len / 3).min(len);
                    // SAFETY: as in the test above.
                    let (a, b) = unsafe {
                        (
                            std::slice::from_raw_parts(addr as *const u8, cut),
                            std::slice::from_raw_parts((addr + cut) as *const u8, len - cut),
                        )
                    };
                    let parts = Parts::new(vec![a, b]);
                    let mut staging = vec![0u8; len];
                    let m = Mirror::new(&mut staging, len as u64).expect("mirror");
                    let released = AtomicUsize::new(0);
                    let release = || {
                        released.fetch_add(1, Ordering::SeqCst);
                        if len > 0 {
                            // SAFETY: as above.
                            unsafe { std::ptr::write_bytes(addr as *mut u8, 0xAB, len) };
                        }
                        Ok(())
                    };
                    let mut got = Vec::with_capacity(len);
                    std::thread::scope(|s| {
                        let copier = s.spawn(|| m.copy_from_back(&parts, &release));
                        if round % 2 == 1 {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                        let mut at = 0;
                        while at < len {
                            let n = piece.min(len - at);
                            let raw = m.chunk(&parts, at as u64, n, &pool).expect("chunk");
                            got.extend_from_slice(&raw);
                            at += n;
                        }
                        assert_eq!(m.finish(), Ok(()));
                        copier.join().expect("copier");
                    });
                    assert_eq!(
                        released.load(Ordering::SeqCst),
                        1,
                        "len {len} piece {piece}"
                    );
                    assert!(got == want, "len {len} piece {piece} round {round}");
                    drop(live);
                }
            }
        }
    }

    #[test]
    fn a_refused_release_fails_the_readers_next_chunk() {
        // Once the release refuses (the state changed before it), reading
        // the rest from the staging buffer is for nothing: the next chunk
        // is the release's error, so the commit ends at once.
        let len = 8 * MIN_UNIT as usize;
        let data = vec![5u8; len];
        let parts = Parts::new(vec![&data[..]]);
        let mut staging = vec![0u8; len];
        let m = Mirror::new(&mut staging, len as u64).expect("mirror");
        let pool = BufPool::new(1 << 20);
        let refuse = || Err(String::from("the state changed"));
        std::thread::scope(|s| {
            let copier = s.spawn(|| m.copy_from_back(&parts, &refuse));
            // The copier copies every unit, then the reader's first chunk
            // is all the copier's: the reader is done with live memory.
            while unpack(m.claims.load(Ordering::Acquire)).1 > 0 {
                std::thread::yield_now();
            }
            assert!(m.chunk(&parts, 0, 100, &pool).is_ok());
            copier.join().expect("copier");
            assert_eq!(
                m.chunk(&parts, 100, 100, &pool).err().as_deref(),
                Some("the state changed")
            );
            assert_eq!(m.finish(), Err("the state changed".into()));
        });
    }

    #[test]
    fn a_commit_that_ends_early_stops_the_copier_without_a_release() {
        let len = 8 * MIN_UNIT as usize;
        let data = vec![5u8; len];
        let parts = Parts::new(vec![&data[..]]);
        let mut staging = vec![0u8; len];
        let m = Mirror::new(&mut staging, len as u64).expect("mirror");
        let released = AtomicUsize::new(0);
        let release = || {
            released.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        std::thread::scope(|s| {
            let copier = s.spawn(|| m.copy_from_back(&parts, &release));
            // the copier copies everything, then waits for the reader,
            // which never comes: the commit failed
            while unpack(m.claims.load(Ordering::Acquire)).1 > 0 {
                std::thread::yield_now();
            }
            m.stop();
            copier.join().expect("copier");
        });
        assert_eq!(released.into_inner(), 0);
    }
}
