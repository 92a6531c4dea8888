//! The conformance suite every [`Remote`] must pass, run by the unit tests
//! (memory, directory) and the integration tests (S3 servers on
//! 127.0.0.1). Test support: it asserts (panics) on a failed expectation.
// A test suite: an unexpected error is a failed test, so it unwraps.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Remote, RemoteError};

/// Plain files, listing, compare-and-swap, bad keys. `remote` must be empty.
pub fn run(remote: &dyn Remote) {
    assert_eq!(remote.get("missing").unwrap(), None);
    assert_eq!(remote.get_versioned("refs/heads/x").unwrap(), None);
    assert!(remote.list("packs/").unwrap().is_empty());

    // put / get / overwrite, empty and large values.
    remote.put("packs/a.pack", b"alpha".to_vec()).unwrap();
    assert_eq!(remote.get("packs/a.pack").unwrap().unwrap(), b"alpha");
    remote.put("packs/a.pack", b"beta".to_vec()).unwrap();
    assert_eq!(remote.get("packs/a.pack").unwrap().unwrap(), b"beta");
    remote.put("packs/empty", Vec::new()).unwrap();
    assert_eq!(remote.get("packs/empty").unwrap().unwrap(), b"");
    let big: Vec<u8> = (0..(40u32 << 20) / 4)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    remote.put("packs/big.pack", big.clone()).unwrap();
    assert!(
        remote.get("packs/big.pack").unwrap().unwrap() == big,
        "40 MiB round trip"
    );

    // Range reads: exactly the bytes asked for; past the end is an error,
    // a missing file `None`.
    let r = |start: u64, len: u64| remote.get_range("packs/big.pack", start, len);
    assert_eq!(r(0, 5).unwrap().unwrap(), &big[..5]);
    assert!(r(12_345_677, 3 << 20).unwrap().unwrap() == big[12_345_677..][..3 << 20]);
    let end = big.len() as u64;
    assert_eq!(r(end - 7, 7).unwrap().unwrap(), &big[big.len() - 7..]);
    assert!(r(end - 7, 8).is_err(), "a range past the end");
    assert!(r(end + 10, 1).is_err(), "a range after the end");
    assert_eq!(remote.get_range("packs/nope.pack", 0, 4).unwrap(), None);

    // list: by prefix, sorted, nested, nothing else.
    remote.put("packs/b.idx", b"i".to_vec()).unwrap();
    remote.put("refs/heads/main", b"1".to_vec()).unwrap();
    remote.put("refs/heads/team/x", b"2".to_vec()).unwrap();
    assert_eq!(
        remote.list("packs/").unwrap(),
        [
            "packs/a.pack",
            "packs/b.idx",
            "packs/big.pack",
            "packs/empty"
        ]
    );
    assert_eq!(
        remote.list("refs/heads/").unwrap(),
        ["refs/heads/main", "refs/heads/team/x"]
    );
    assert!(remote.list("nothing/").unwrap().is_empty());

    // delete
    remote.delete("packs/big.pack").unwrap();
    remote.delete("packs/never-was").unwrap();
    assert_eq!(remote.get("packs/big.pack").unwrap(), None);

    // compare-and-swap
    let key = "refs/heads/cas";
    remote.put_if(key, b"v1".to_vec(), None).unwrap();
    assert!(matches!(
        remote.put_if(key, b"again".to_vec(), None),
        Err(RemoteError::Conflict { .. })
    ));
    let (data, v1) = remote.get_versioned(key).unwrap().unwrap();
    assert_eq!(data, b"v1");
    remote.put_if(key, b"v2".to_vec(), Some(&v1)).unwrap();
    assert!(
        matches!(
            remote.put_if(key, b"stale".to_vec(), Some(&v1)),
            Err(RemoteError::Conflict { .. })
        ),
        "a stale version must not win"
    );
    let (data, v2) = remote.get_versioned(key).unwrap().unwrap();
    assert_eq!(data, b"v2");
    remote.put_if(key, b"v3".to_vec(), Some(&v2)).unwrap();
    assert_eq!(remote.get(key).unwrap().unwrap(), b"v3");
    // An update of a file that is gone conflicts.
    remote.delete(key).unwrap();
    assert!(matches!(
        remote.put_if(key, b"v4".to_vec(), Some(&v2)),
        Err(RemoteError::Conflict { .. })
    ));

    // Keys that could escape are refused before any I/O.
    for bad in [
        "../x",
        "a/../../b",
        "/etc/passwd",
        "refs/./x",
        ".hidden",
        "a//b",
    ] {
        assert!(
            matches!(remote.get(bad), Err(RemoteError::BadPath { .. })),
            "{bad}"
        );
        assert!(
            matches!(remote.put(bad, vec![1]), Err(RemoteError::BadPath { .. })),
            "{bad}"
        );
        assert!(
            matches!(
                remote.put_if(bad, vec![1], None),
                Err(RemoteError::BadPath { .. })
            ),
            "{bad}"
        );
    }
}

/// `writers` threads race `rounds` times to create, then to update, one
/// ref: at least one wins each round, and with `strict` exactly one. `open`
/// gives each thread its own client (as separate processes would have).
/// Returns the number of races with more than one winner.
pub fn race(
    open: &(dyn Fn() -> Box<dyn Remote> + Sync),
    writers: usize,
    rounds: usize,
    strict: bool,
) -> usize {
    let mut double = 0;
    let clients: Vec<Box<dyn Remote>> = (0..writers).map(|_| open()).collect();
    for round in 0..rounds {
        let key = format!("refs/heads/race-{round}");
        // Creates.
        let wins = AtomicUsize::new(0);
        let barrier = std::sync::Barrier::new(writers);
        std::thread::scope(|s| {
            for (i, c) in clients.iter().enumerate() {
                let (key, wins, barrier) = (&key, &wins, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    match c.put_if(key, format!("{i}").into_bytes(), None) {
                        Ok(()) => {
                            wins.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(RemoteError::Conflict { .. }) => {}
                        Err(e) => panic!("writer {i}: {e}"),
                    }
                });
            }
        });
        let w = wins.load(Ordering::SeqCst);
        assert!(w >= 1, "round {round}: no create won");
        assert!(!strict || w == 1, "round {round}: {w} creates won");
        double += usize::from(w > 1);
        // Updates from the same version.
        let (_, v) = clients[0].get_versioned(&key).unwrap().unwrap();
        let wins = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for (i, c) in clients.iter().enumerate() {
                let (key, wins, barrier, v) = (&key, &wins, &barrier, &v);
                s.spawn(move || {
                    barrier.wait();
                    match c.put_if(key, format!("u{i}").into_bytes(), Some(v)) {
                        Ok(()) => {
                            wins.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(RemoteError::Conflict { .. }) => {}
                        Err(e) => panic!("writer {i}: {e}"),
                    }
                });
            }
        });
        let w = wins.load(Ordering::SeqCst);
        assert!(w >= 1, "round {round}: no update won");
        assert!(!strict || w == 1, "round {round}: {w} updates won");
        double += usize::from(w > 1);
    }
    double
}

#[cfg(test)]
mod tests {
    use super::super::{DirRemote, MemRemote};
    use super::*;

    #[test]
    fn memory_remote_conforms() {
        run(&MemRemote::new());
        let shared = std::sync::Arc::new(MemRemote::new());
        struct Shared(std::sync::Arc<MemRemote>);
        impl Remote for Shared {
            fn url(&self) -> String {
                self.0.url()
            }
            fn get(&self, k: &str) -> Result<Option<Vec<u8>>, RemoteError> {
                self.0.get(k)
            }
            fn get_versioned(
                &self,
                k: &str,
            ) -> Result<Option<(Vec<u8>, super::super::Version)>, RemoteError> {
                self.0.get_versioned(k)
            }
            fn put(&self, k: &str, d: Vec<u8>) -> Result<(), RemoteError> {
                self.0.put(k, d)
            }
            fn put_if(
                &self,
                k: &str,
                d: Vec<u8>,
                e: Option<&super::super::Version>,
            ) -> Result<(), RemoteError> {
                self.0.put_if(k, d, e)
            }
            fn list(&self, p: &str) -> Result<Vec<String>, RemoteError> {
                self.0.list(p)
            }
            fn delete(&self, k: &str) -> Result<(), RemoteError> {
                self.0.delete(k)
            }
        }
        race(&|| Box::new(Shared(shared.clone())), 8, 30, true);
    }

    #[test]
    fn directory_remote_conforms_and_its_compare_and_swap_is_atomic() {
        let tmp = tempfile::tempdir().unwrap();
        run(&DirRemote::new(tmp.path().join("r")));
        let root = tmp.path().join("race");
        race(&|| Box::new(DirRemote::new(root.clone())), 8, 30, true);
        // No temporary or lock files are left behind or listed.
        let left: Vec<_> = std::fs::read_dir(root.join("refs/heads"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
