//! A switch that holds a running commit's reading and coding work while
//! the job beside it needs the machine (the Python package's background
//! saves hold it for each `optimizer.step()`, whose threads a commit on the
//! same cores slows through their barriers and the memory bus). A commit
//! given one ([`super::CommitOptions::pause`]) looks at it before each
//! chunk it hashes and each it codes, so a hold takes effect within one
//! chunk's work. Every hold has a deadline: a holder that never resumes
//! (a step that raised before its resume) delays a commit, it cannot hang
//! one.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Holds and their deadline; see the module docs.
#[derive(Debug, Default)]
pub struct Pause {
    state: Mutex<Held>,
    resumed: Condvar,
}

#[derive(Debug, Default)]
struct Held {
    /// Holds not yet resumed (one per holder: two optimizers stepping at
    /// once in two threads hold until both have resumed).
    holds: usize,
    /// When every hold lapses, resumed or not.
    until: Option<Instant>,
}

impl Pause {
    pub fn new() -> Pause {
        Pause::default()
    }

    /// Hold the work of commits given this pause until [`Pause::resume`]
    /// (as many as holds) or [`Pause::clear`], and at most `limit` from
    /// now (a later hold moves that deadline).
    pub fn hold(&self, limit: Duration) {
        let mut s = self.lock();
        s.holds += 1;
        s.until = Instant::now().checked_add(limit);
    }

    /// End one hold; work goes on once none is left.
    pub fn resume(&self) {
        let mut s = self.lock();
        s.holds = s.holds.saturating_sub(1);
        if s.holds == 0 {
            s.until = None;
            self.resumed.notify_all();
        }
    }

    /// End every hold (the caller now waits for the commits itself).
    pub fn clear(&self) {
        let mut s = self.lock();
        *s = Held::default();
        self.resumed.notify_all();
    }

    /// True while a hold is in force.
    pub fn is_held(&self) -> bool {
        let s = self.lock();
        s.holds > 0 && s.until.is_none_or(|u| Instant::now() < u)
    }

    /// Return at once when nothing holds; else when the holds end or lapse.
    pub(crate) fn wait(&self) {
        let mut s = self.lock();
        while s.holds > 0 {
            let left = match s.until {
                Some(u) => u.saturating_duration_since(Instant::now()),
                // A deadline past what an Instant can hold: an hour at a time.
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                // Lapsed: a holder that never resumed holds nothing more.
                *s = Held::default();
                self.resumed.notify_all();
                break;
            }
            s = self
                .resumed
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        // The state is two plain fields: a panic elsewhere cannot leave it
        // half-written.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A pause held for `limit`.
    fn held(limit: Duration) -> Arc<Pause> {
        let p = Arc::new(Pause::new());
        p.hold(limit);
        p
    }

    /// A waiter on `p` in a thread; the flag turns true when it returns.
    fn waiter(p: &Arc<Pause>) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
        let (p, done) = (p.clone(), Arc::new(AtomicBool::new(false)));
        let d = done.clone();
        let h = std::thread::spawn(move || {
            p.wait();
            d.store(true, Ordering::SeqCst);
        });
        (h, done)
    }

    #[test]
    fn an_unheld_pause_lets_work_through_at_once() {
        let p = Pause::new();
        p.wait();
        assert!(!p.is_held());
    }

    #[test]
    fn a_held_pause_stops_work_until_resumed() {
        let p = held(Duration::from_secs(60));
        assert!(p.is_held());
        let (h, done) = waiter(&p);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!done.load(Ordering::SeqCst), "work went on while held");
        p.resume();
        h.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
        assert!(!p.is_held());
    }

    #[test]
    fn two_holds_end_with_the_second_resume() {
        let p = held(Duration::from_secs(60));
        p.hold(Duration::from_secs(60));
        let (h, done) = waiter(&p);
        p.resume();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !done.load(Ordering::SeqCst),
            "one of two holds still stands"
        );
        p.resume();
        h.join().unwrap();
        // more resumes than holds do not bank a credit
        p.resume();
        p.hold(Duration::from_secs(60));
        assert!(p.is_held());
        p.clear();
        assert!(!p.is_held());
    }

    #[test]
    fn a_hold_never_resumed_lapses_at_its_deadline() {
        let p = held(Duration::from_millis(50));
        let t = Instant::now();
        p.wait();
        assert!(t.elapsed() >= Duration::from_millis(40));
        // and it is gone: the next wait does not block again
        assert!(!p.is_held());
        p.wait();
    }

    #[test]
    fn clear_lets_every_waiter_go() {
        let p = held(Duration::from_secs(60));
        p.hold(Duration::from_secs(60));
        let waiters: Vec<_> = (0..3).map(|_| waiter(&p)).collect();
        p.clear();
        for (h, done) in waiters {
            h.join().unwrap();
            assert!(done.load(Ordering::SeqCst));
        }
    }
}
