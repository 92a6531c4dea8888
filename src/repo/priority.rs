//! The CPU priority of the threads that commit beside a training job on
//! the same cores (`ckvc watch`, the Python package's background saves):
//! their nice value is raised, so that the job's threads come first when
//! they compete for a core. Best effort: where the system refuses, the
//! work runs as it is.

/// Make the calling thread's nice value `by` above the process's (its main
/// thread's, at most 19), unless it is that or more already: a thread asked
/// again (one that commits again and again) stays where it is, and one
/// already lower is not raised. Threads it starts afterwards inherit the
/// value (Linux). On other Unix systems, where a nice value is the
/// process's, the process's is raised by `by`; elsewhere nothing happens.
/// `by` of 0 or less does nothing.
pub fn lower_thread_priority(by: i32) {
    if by <= 0 {
        return;
    }
    imp::lower(by);
}

#[cfg(target_os = "linux")]
mod imp {
    pub(super) fn lower(by: i32) {
        // SAFETY: getpid and gettid take no arguments; getpriority reads the
        // priority of the process's main thread and of the calling thread,
        // setpriority sets the calling thread's (its id) only. No memory is
        // passed.
        unsafe {
            let main = libc::getpriority(libc::PRIO_PROCESS, libc::getpid() as libc::id_t);
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            let target = (main + by).min(19);
            if libc::getpriority(libc::PRIO_PROCESS, tid) < target {
                libc::setpriority(libc::PRIO_PROCESS, tid, target);
            }
        }
    }
}

#[cfg(all(unix, not(target_os = "linux")))]
mod imp {
    pub(super) fn lower(by: i32) {
        // SAFETY: getpriority and setpriority with `who` 0 read and set the
        // process's priority; no memory is passed.
        unsafe {
            let now = libc::getpriority(libc::PRIO_PROCESS, 0);
            libc::setpriority(libc::PRIO_PROCESS, 0, (now + by).min(19));
        }
    }
}

#[cfg(not(unix))]
mod imp {
    pub(super) fn lower(_: i32) {}
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::lower_thread_priority;

    fn nice_of(tid: libc::id_t) -> i32 {
        // SAFETY: getpriority reads a priority; no memory is passed.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }
    }

    fn this_thread() -> libc::id_t {
        // SAFETY: gettid takes no arguments.
        unsafe { libc::syscall(libc::SYS_gettid) as libc::id_t }
    }

    /// The watcher's and the Python package's background threads: raised
    /// once above the process's main thread, not again when asked again,
    /// and the process's main thread untouched.
    #[test]
    fn a_thread_is_lowered_once_above_the_main_thread_and_no_further() {
        // SAFETY: getpid takes no arguments.
        let main = nice_of(unsafe { libc::getpid() } as libc::id_t);
        let got = std::thread::spawn(|| {
            lower_thread_priority(3);
            let once = nice_of(this_thread());
            lower_thread_priority(3);
            let twice = nice_of(this_thread());
            lower_thread_priority(0);
            (once, twice, nice_of(this_thread()))
        })
        .join()
        .expect("the thread ends");
        let want = (main + 3).min(19);
        assert_eq!(got, (want, want, want));
        // SAFETY: getpid takes no arguments.
        assert_eq!(nice_of(unsafe { libc::getpid() } as libc::id_t), main);
    }
}
