//! One conformance suite, run against every [`Store`] implementation, plus
//! RocksDB-only tests (persistence, locking, readers beside a writer) and a
//! differential proptest of `MemStore` against `RocksStore`.

use std::sync::atomic::{AtomicBool, Ordering};

use proptest::prelude::*;

use super::*;

fn scan(store: &dyn Store, space: Space, prefix: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    store.collect_prefix(space, prefix).expect("scan")
}

fn put1(store: &dyn Store, space: Space, key: &[u8], value: &[u8]) {
    let mut b = Batch::new();
    b.put(space, key, value);
    store.write(b).expect("write");
}

// ---- the conformance suite: each takes any store, empty on entry ----

fn get_put_delete(store: &dyn Store) {
    let mut buf = b"stale".to_vec();
    assert!(!store.get(Space::Objects, b"k", &mut buf).unwrap());
    assert!(buf.is_empty(), "not found leaves the buffer empty");
    assert!(!store.contains(Space::Objects, b"k").unwrap());

    put1(store, Space::Objects, b"k", b"v1");
    assert!(store.get(Space::Objects, b"k", &mut buf).unwrap());
    assert_eq!(buf, b"v1");
    assert!(store.contains(Space::Objects, b"k").unwrap());

    put1(store, Space::Objects, b"k", b"v2-longer");
    assert_eq!(
        store.get_vec(Space::Objects, b"k").unwrap().as_deref(),
        Some(&b"v2-longer"[..])
    );

    let mut b = Batch::new();
    b.delete(Space::Objects, b"k")
        .delete(Space::Objects, b"never");
    store.write(b).unwrap();
    assert_eq!(store.get_vec(Space::Objects, b"k").unwrap(), None);

    // empty values are values, not absence
    put1(store, Space::Meta, b"empty", b"");
    assert_eq!(store.get_vec(Space::Meta, b"empty").unwrap(), Some(vec![]));
    store.flush().unwrap();
}

fn spaces_are_separate(store: &dyn Store) {
    for (i, space) in Space::ALL.into_iter().enumerate() {
        put1(store, space, b"same-key", &[i as u8]);
    }
    for (i, space) in Space::ALL.into_iter().enumerate() {
        assert_eq!(
            store.get_vec(space, b"same-key").unwrap(),
            Some(vec![i as u8])
        );
        assert_eq!(scan(store, space, b"").len(), 1);
    }
}

fn batch_applies_in_order(store: &dyn Store) {
    let mut b = Batch::new();
    b.put(Space::Index, b"a", b"1".to_vec())
        .put(Space::Index, b"a", b"2".to_vec())
        .put(Space::Index, b"b", b"x".to_vec())
        .delete(Space::Index, b"b")
        .put(Space::Refs, b"r", b"y".to_vec());
    assert_eq!(b.len(), 5);
    store.write(b).unwrap();
    assert_eq!(
        store.get_vec(Space::Index, b"a").unwrap(),
        Some(b"2".to_vec())
    );
    assert_eq!(store.get_vec(Space::Index, b"b").unwrap(), None);
    assert_eq!(
        store.get_vec(Space::Refs, b"r").unwrap(),
        Some(b"y".to_vec())
    );
    // an empty batch is fine
    store.write(Batch::new()).unwrap();
}

fn compare_and_swap_refs(store: &dyn Store) {
    let key = b"refs/heads/main";
    let c1 = CommitId::digest(b"c1");
    let c2 = CommitId::digest(b"c2");

    // create: only if absent
    let mut b = Batch::new();
    b.expect(Space::Refs, key, None)
        .put(Space::Refs, key, c1.as_bytes().to_vec());
    store.write(b).unwrap();

    let mut b = Batch::new();
    b.expect(Space::Refs, key, None)
        .put(Space::Refs, key, c2.as_bytes().to_vec());
    assert!(matches!(
        store.write(b),
        Err(StoreError::Conflict {
            space: Space::Refs,
            ..
        })
    ));

    // fast-forward c1 -> c2, together with an object
    let mut b = Batch::new();
    b.put(Space::Objects, c2.as_bytes(), b"commit c2".to_vec())
        .expect(Space::Refs, key, Some(c1.as_bytes()))
        .put(Space::Refs, key, c2.as_bytes().to_vec());
    store.write(b).unwrap();
    assert_eq!(
        store.get_vec(Space::Refs, key).unwrap(),
        Some(c2.as_bytes().to_vec())
    );

    // a stale expectation fails and writes nothing at all, in any space
    let c3 = CommitId::digest(b"c3");
    let mut b = Batch::new();
    b.put(Space::Chunks, &[9; 32], vec![1u8; 5000])
        .put(Space::Objects, c3.as_bytes(), b"commit c3".to_vec())
        .expect(Space::Refs, key, Some(c1.as_bytes()))
        .put(Space::Refs, key, c3.as_bytes().to_vec());
    let err = store.write(b).unwrap_err();
    match err {
        StoreError::Conflict { space, key_hex } => {
            assert_eq!(space, Space::Refs);
            assert_eq!(key_hex, to_hex(key));
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert!(!store.contains(Space::Chunks, &[9; 32]).unwrap());
    assert!(!store.contains(Space::Objects, c3.as_bytes()).unwrap());
    assert_eq!(
        store.get_vec(Space::Refs, key).unwrap(),
        Some(c2.as_bytes().to_vec())
    );

    // delete only if it still points at c2
    let mut b = Batch::new();
    b.expect(Space::Refs, key, Some(c2.as_bytes()))
        .delete(Space::Refs, key);
    store.write(b).unwrap();
    assert!(!store.contains(Space::Refs, key).unwrap());
}

fn prefix_scans_are_ordered(store: &dyn Store) {
    let keys: Vec<Vec<u8>> = vec![
        vec![],
        vec![0],
        vec![0, 0],
        vec![0, 1],
        vec![1],
        b"step/main\x00\x00\x00\x00\x00\x00\x00\x00\x01".to_vec(),
        b"step/main\x00\x00\x00\x00\x00\x00\x00\x01\x00".to_vec(),
        b"step/main\x00\x00\x00\x00\x00\x00\x00\x00\x02".to_vec(),
        b"step/main-2\x00\x00\x00\x00\x00\x00\x00\x00\x01".to_vec(),
        vec![0xfe, 0xff],
        vec![0xff],
        vec![0xff, 0xff],
        vec![0xff, 0xff, 0x00],
    ];
    let mut b = Batch::new();
    // insert in reverse to make sure order comes from the store
    for (i, k) in keys.iter().enumerate().rev() {
        b.put(Space::Index, k, vec![i as u8]);
    }
    store.write(b).unwrap();
    let mut sorted = keys.clone();
    sorted.sort();

    let all: Vec<Vec<u8>> = scan(store, Space::Index, b"")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(all, sorted, "empty prefix scans everything in byte order");

    for prefix in [
        &b"step/main\x00"[..],
        b"step/main",
        b"step/",
        &[0],
        &[0xff],
        &[0xff, 0xff],
        &[0xfe],
        b"nothing-here",
    ] {
        let want: Vec<&Vec<u8>> = sorted.iter().filter(|k| k.starts_with(prefix)).collect();
        let got = scan(store, Space::Index, prefix);
        assert_eq!(
            got.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            want,
            "prefix {prefix:?}"
        );
        for (k, v) in &got {
            let i = keys.iter().position(|x| x == k).unwrap();
            assert_eq!(v, &vec![i as u8]);
        }
    }
    // steps of one branch in numeric order thanks to big-endian u64
    let steps: Vec<u8> = scan(store, Space::Index, b"step/main\x00")
        .iter()
        .map(|(k, _)| k[k.len() - 2] * 16 + k[k.len() - 1])
        .collect();
    assert_eq!(steps, vec![1, 2, 16]);

    // early stop
    let mut seen = 0;
    store
        .scan_prefix(Space::Index, b"", &mut |_, _| {
            seen += 1;
            Ok(seen < 3)
        })
        .unwrap();
    assert_eq!(seen, 3);

    // errors from the callback come back unchanged
    let err = store
        .scan_prefix(Space::Index, b"", &mut |_, _| Err(StoreError::ReadOnly))
        .unwrap_err();
    assert!(matches!(err, StoreError::ReadOnly));

    // other spaces are unaffected
    assert!(scan(store, Space::Objects, b"").is_empty());
}

fn large_values(store: &dyn Store) {
    let big: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let id = ChunkId::digest(&big);
    let mut b = Batch::new();
    b.put(Space::Chunks, id.as_bytes(), big.clone());
    b.put(Space::Chunks, &[0; 32], vec![7u8; 300 << 10]);
    assert!(b.payload_bytes() > 8 << 20);
    store.write(b).unwrap();
    store.flush().unwrap();
    let mut buf = Vec::new();
    assert!(store.get(Space::Chunks, id.as_bytes(), &mut buf).unwrap());
    assert!(buf == big, "8 MiB value round-trips");
    assert_eq!(ChunkId::digest(&buf), id);
    let mut sizes = Vec::new();
    store
        .scan_prefix(Space::Chunks, b"", &mut |_, v| {
            sizes.push(v.len());
            Ok(true)
        })
        .unwrap();
    assert_eq!(sizes, vec![300 << 10, 8 << 20]);
}

fn binary_keys(store: &dyn Store) {
    let keys: [&[u8]; 6] = [b"", b"\x00", b"\x00\x00", b"\xff", b"a\x00b", b"a\xffb"];
    for (i, k) in keys.iter().enumerate() {
        put1(store, Space::Objects, k, &[i as u8; 3]);
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            store.get_vec(Space::Objects, k).unwrap(),
            Some(vec![i as u8; 3]),
            "key {k:?}"
        );
    }
    assert_eq!(scan(store, Space::Objects, b"a").len(), 2);
    assert_eq!(scan(store, Space::Objects, b"\x00").len(), 2);
}

/// A writer rewrites ten keys of two spaces per batch; readers scanning the
/// space must always see all ten with the same generation.
fn readers_never_see_half_a_batch(store: &dyn Store) {
    const KEYS: u8 = 10;
    let write_gen = |g: u32| {
        let mut b = Batch::new();
        for k in 0..KEYS {
            b.put(Space::Objects, &[k], g.to_be_bytes().to_vec());
            b.put(Space::Refs, &[k], g.to_be_bytes().to_vec());
        }
        store.write(b).unwrap();
    };
    write_gen(0);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut scans = 0u32;
            while !done.load(Ordering::Acquire) || scans < 10 {
                for space in [Space::Objects, Space::Refs] {
                    let got = scan(store, space, b"");
                    assert_eq!(got.len(), usize::from(KEYS));
                    assert!(
                        got.iter().all(|(_, v)| *v == got[0].1),
                        "half a batch visible in {space}"
                    );
                }
                scans += 1;
            }
        });
        for g in 1..200 {
            write_gen(g);
        }
        done.store(true, Ordering::Release);
        reader.join().expect("reader thread");
    });
}

macro_rules! conformance {
    ($name:ident, $make:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn get_put_delete() {
                let (s, _g) = $make;
                super::get_put_delete(&s);
            }
            #[test]
            fn spaces_are_separate() {
                let (s, _g) = $make;
                super::spaces_are_separate(&s);
            }
            #[test]
            fn batch_applies_in_order() {
                let (s, _g) = $make;
                super::batch_applies_in_order(&s);
            }
            #[test]
            fn compare_and_swap_refs() {
                let (s, _g) = $make;
                super::compare_and_swap_refs(&s);
            }
            #[test]
            fn prefix_scans_are_ordered() {
                let (s, _g) = $make;
                super::prefix_scans_are_ordered(&s);
            }
            #[test]
            fn large_values() {
                let (s, _g) = $make;
                super::large_values(&s);
            }
            #[test]
            fn binary_keys() {
                let (s, _g) = $make;
                super::binary_keys(&s);
            }
            #[test]
            fn readers_never_see_half_a_batch() {
                let (s, _g) = $make;
                super::readers_never_see_half_a_batch(&s);
            }
        }
    };
}

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ckvc-store-test")
        .tempdir()
        .expect("temp dir")
}

/// No fsync per write in tests that do not test durability: the suite
/// would otherwise spend its time in fsync.
fn fast() -> RocksOptions {
    RocksOptions {
        sync: false,
        ..RocksOptions::default()
    }
}

fn rocks(options: &RocksOptions) -> (RocksStore, tempfile::TempDir) {
    let dir = tmp();
    let s = RocksStore::open_with(dir.path().join("db"), Mode::ReadWrite, options).expect("open");
    (s, dir)
}

conformance!(mem, (MemStore::new(), ()));
conformance!(rocks_blob, rocks(&fast()));
conformance!(
    rocks_plain_sst,
    rocks(&RocksOptions {
        blob_files: false,
        ..fast()
    })
);
conformance!(
    rocks_synced,
    rocks(&RocksOptions {
        sync: true,
        ..RocksOptions::default()
    })
);

// ---- RocksDB only ----

#[test]
fn rocks_checksums_blob_records_with_ckvcs_crc32c() {
    // `store::crc` takes the place of librocksdb's table-loop CRC32C
    // (build.rs exports it): a flush of a blob-sized value must have
    // called it, and the value must read back (RocksDB checks the CRCs
    // it wrote with ours when it reads the table and the WAL).
    let dir = tmp();
    let path = dir.path().join("db");
    let value: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    {
        let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
        let before = crate::store::rocksdb_crc_calls();
        let mut b = Batch::new();
        b.put(Space::Chunks, &[3; 32], value.clone());
        s.write(b).unwrap();
        s.flush().unwrap();
        assert!(
            crate::store::rocksdb_crc_calls() > before,
            "RocksDB checksummed without ckvc's CRC32C"
        );
    }
    let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
    assert_eq!(s.get_vec(Space::Chunks, &[3; 32]).unwrap(), Some(value));
}

#[test]
fn rocks_unlogged_batches_are_visible_at_once_and_durable_after_flush() {
    let dir = tmp();
    let path = dir.path().join("db");
    {
        let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
        let mut b = Batch::new();
        b.unlogged();
        b.put(Space::Chunks, &[7; 32], vec![9u8; 50_000]);
        b.put(Space::Chunks, &[8; 32], vec![1u8; 10]);
        s.write(b).unwrap();
        assert_eq!(
            s.get_vec(Space::Chunks, &[8; 32]).unwrap(),
            Some(vec![1u8; 10])
        );
        s.flush().unwrap();
        // then a logged batch that depends on them, as a commit does
        put1(&s, Space::Refs, b"refs/heads/main", b"c");
    }
    let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
    assert_eq!(
        s.get_vec(Space::Chunks, &[7; 32]).unwrap(),
        Some(vec![9u8; 50_000])
    );
    assert_eq!(
        s.get_vec(Space::Refs, b"refs/heads/main").unwrap(),
        Some(b"c".to_vec())
    );
}

#[test]
fn rocks_reopen_persists() {
    let dir = tmp();
    let path = dir.path().join("db");
    {
        let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
        put1(&s, Space::Refs, b"HEAD", b"ref: refs/heads/main");
        put1(&s, Space::Chunks, &[1; 32], &vec![3u8; 100_000]);
        // no flush: the synced WAL alone must carry the data across a close
    }
    {
        let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
        assert_eq!(
            s.get_vec(Space::Refs, b"HEAD").unwrap().as_deref(),
            Some(&b"ref: refs/heads/main"[..])
        );
        assert_eq!(
            s.get_vec(Space::Chunks, &[1; 32]).unwrap(),
            Some(vec![3u8; 100_000])
        );
        s.flush().unwrap();
    }
    let s = RocksStore::open(&path, Mode::ReadWrite).unwrap();
    assert_eq!(scan(&s, Space::Chunks, b"").len(), 1);
    assert!(s.size_on_disk().unwrap() > 100_000);
}

#[test]
fn rocks_second_writer_is_locked() {
    let dir = tmp();
    let path = dir.path().join("db");
    let first = RocksStore::open(&path, Mode::ReadWrite).unwrap();
    match RocksStore::open(&path, Mode::ReadWrite) {
        Err(StoreError::Locked { path: p }) => assert_eq!(p, path),
        other => panic!("expected Locked, got {other:?}"),
    }
    let msg = StoreError::Locked { path: path.clone() }.to_string();
    assert!(msg.contains("locked by another writer"), "{msg}");
    drop(first);
    // the lock goes with the writer
    RocksStore::open(&path, Mode::ReadWrite).unwrap();
}

#[test]
fn rocks_reader_beside_writer() {
    let dir = tmp();
    let path = dir.path().join("db");
    let writer = RocksStore::open(&path, Mode::ReadWrite).unwrap();
    put1(&writer, Space::Refs, b"refs/heads/main", b"c1");
    put1(&writer, Space::Chunks, &[5; 32], &vec![5u8; 64 << 10]);
    writer.flush().unwrap();
    put1(&writer, Space::Index, b"unflushed", b"in the WAL only");

    let reader = RocksStore::open(&path, Mode::ReadOnly).unwrap();
    assert_eq!(reader.mode(), Mode::ReadOnly);
    assert_eq!(
        reader.get_vec(Space::Refs, b"refs/heads/main").unwrap(),
        Some(b"c1".to_vec())
    );
    assert_eq!(
        reader.get_vec(Space::Chunks, &[5; 32]).unwrap(),
        Some(vec![5u8; 64 << 10])
    );
    assert_eq!(
        reader.get_vec(Space::Index, b"unflushed").unwrap(),
        Some(b"in the WAL only".to_vec()),
        "a reader sees the writer's WAL as of its open"
    );
    assert!(matches!(
        reader.write(Batch::new()),
        Err(StoreError::ReadOnly)
    ));
    reader.flush().unwrap();

    // A reader sees the store as of its open; a new reader sees later
    // writes, flushed or not.
    put1(&writer, Space::Refs, b"refs/heads/main", b"c2");
    writer.flush().unwrap();
    put1(&writer, Space::Refs, b"refs/heads/dev", b"d1");
    assert_eq!(
        reader.get_vec(Space::Refs, b"refs/heads/main").unwrap(),
        Some(b"c1".to_vec())
    );
    let later = RocksStore::open(&path, Mode::ReadOnly).unwrap();
    assert_eq!(
        later.get_vec(Space::Refs, b"refs/heads/main").unwrap(),
        Some(b"c2".to_vec())
    );
    assert_eq!(
        later.get_vec(Space::Refs, b"refs/heads/dev").unwrap(),
        Some(b"d1".to_vec())
    );

    // several readers at once, and a reader outliving the writer
    let reader2 = RocksStore::open(&path, Mode::ReadOnly).unwrap();
    drop(writer);
    assert_eq!(scan(&reader2, Space::Refs, b"refs/").len(), 2);
    assert_eq!(scan(&reader, Space::Refs, b"refs/").len(), 1);
}

#[test]
fn rocks_reader_needs_a_store() {
    let dir = tmp();
    let path = dir.path().join("missing");
    match RocksStore::open(&path, Mode::ReadOnly) {
        Err(StoreError::NotFound { path: p }) => assert_eq!(p, path),
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(!path.exists(), "a reader creates nothing");
}

#[test]
fn rocks_open_on_a_file_is_an_error() {
    let dir = tmp();
    let path = dir.path().join("file");
    std::fs::write(&path, b"not a directory").unwrap();
    assert!(matches!(
        RocksStore::open(&path, Mode::ReadWrite),
        Err(StoreError::Io { .. })
    ));
}

// ---- differential: MemStore and RocksStore agree on random batches ----

#[derive(Debug, Clone)]
struct RandomBatch {
    ops: Vec<(usize, Vec<u8>, Option<Vec<u8>>)>,
    expect: Option<(usize, Vec<u8>, Option<Vec<u8>>)>,
}

fn small_key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(vec![0u8, 1, b'a', 0xff]), 0..4)
}

fn small_value() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop::option::weighted(0.8, prop::collection::vec(any::<u8>(), 0..40))
}

fn random_batch() -> impl Strategy<Value = RandomBatch> {
    let op = (0..5usize, small_key(), small_value());
    (
        prop::collection::vec(op, 0..12),
        prop::option::weighted(0.3, (0..5usize, small_key(), small_value())),
    )
        .prop_map(|(ops, expect)| RandomBatch { ops, expect })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn mem_and_rocks_agree(batches in prop::collection::vec(random_batch(), 1..24)) {
        let mem = MemStore::new();
        let (rocks, _dir) = rocks(&fast());
        for rb in &batches {
            let mut b = Batch::new();
            for (s, k, v) in &rb.ops {
                match v {
                    Some(v) => b.put(Space::ALL[*s], k, v.clone()),
                    None => b.delete(Space::ALL[*s], k),
                };
            }
            if let Some((s, k, v)) = &rb.expect {
                b.expect(Space::ALL[*s], k, v.as_deref());
            }
            let a = mem.write(b.clone()).map_err(|e| e.to_string());
            let r = rocks.write(b).map_err(|e| e.to_string());
            prop_assert_eq!(a, r);
        }
        let prefixes: [&[u8]; 6] = [b"", b"\x00", b"\x01", b"a", b"\xff", b"\xff\xff"];
        for space in Space::ALL {
            for p in prefixes {
                prop_assert_eq!(scan(&mem, space, p), scan(&rocks, space, p));
            }
        }
    }
}

// ---- the lock across processes: this test binary re-runs itself ----

const LOCK_CHILD_ENV: &str = "CKVC_STORE_LOCK_CHILD";

/// The file the child creates once it holds the store open.
fn ready_marker(db: &std::path::Path) -> std::path::PathBuf {
    db.with_extension("child-ready")
}

/// Does nothing unless started by `rocks_writer_in_another_process`: then it
/// is the other process, holding the writer open until its stdin closes.
/// It says it is ready by creating a marker file beside the store.
#[test]
fn rocks_lock_holder_child() {
    let Some(path) = std::env::var_os(LOCK_CHILD_ENV) else {
        return;
    };
    let path = std::path::PathBuf::from(path);
    let s = RocksStore::open(&path, Mode::ReadWrite).expect("child opens");
    put1(&s, Space::Refs, b"from-child", b"1");
    std::fs::write(ready_marker(&path), b"").expect("child writes its marker");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
}

#[test]
fn rocks_writer_in_another_process() {
    use std::process::{Command, Stdio};
    let dir = tmp();
    let path = dir.path().join("db");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "store::tests::rocks_lock_holder_child",
            "--test-threads=1",
        ])
        .env(LOCK_CHILD_ENV, &path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child");
    let start = std::time::Instant::now();
    while !ready_marker(&path).exists() {
        if let Some(status) = child.try_wait().expect("child status") {
            panic!("child exited before opening the store: {status}");
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(120),
            "child never opened the store"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }

    let second = RocksStore::open(&path, Mode::ReadWrite);
    let reader = RocksStore::open(&path, Mode::ReadOnly);
    drop(child.stdin.take()); // let the child close and exit
    let status = child.wait().expect("child exits");
    assert!(status.success());

    assert!(
        matches!(second, Err(StoreError::Locked { .. })),
        "expected Locked, got {second:?}"
    );
    let reader = reader.expect("reader opens beside another process's writer");
    assert_eq!(
        reader.get_vec(Space::Refs, b"from-child").unwrap(),
        Some(b"1".to_vec())
    );
    drop(reader);
    RocksStore::open(&path, Mode::ReadWrite).expect("lock released with the process");
}

/// Blob garbage collection runs only in `compact` (routine compactions
/// leave blob files alone): deleted chunks' space comes back there, with
/// table and blob files written directly or through the page cache, and
/// the direct-I/O probe leaves nothing behind.
#[test]
fn rocks_compact_reclaims_deleted_blobs_direct_or_buffered() {
    for direct in [true, false] {
        let dir = tmp();
        let path = dir.path().join("db");
        let opts = RocksOptions {
            direct_writes: direct,
            ..fast()
        };
        let s = RocksStore::open_with(&path, Mode::ReadWrite, &opts).unwrap();
        let value = |i: u8| vec![i; 200_000];
        for i in 0..40u8 {
            put1(&s, Space::Chunks, &[i; 32], &value(i));
        }
        s.flush().unwrap();
        let full = s.size_on_disk().unwrap();
        assert!(full > 40 * 200_000, "direct {direct}: {full}");
        let mut b = Batch::new();
        for i in 0..30u8 {
            b.delete(Space::Chunks, &[i; 32]);
        }
        s.write(b).unwrap();
        s.flush().unwrap();
        s.compact().unwrap();
        let after = s.size_on_disk().unwrap();
        assert!(after < full / 2, "direct {direct}: {full} -> {after}");
        for i in 30..40u8 {
            assert_eq!(s.get_vec(Space::Chunks, &[i; 32]).unwrap(), Some(value(i)));
        }
        drop(s);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().all(|n| !n.contains("probe")),
            "direct {direct}: {names:?}"
        );
    }
}

/// Pages of the file at `path` the page cache holds (`mincore` over a
/// read-only mapping, which reads nothing in).
#[cfg(target_os = "linux")]
fn resident_pages(path: &std::path::Path) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0;
    }
    // SAFETY: sysconf takes no pointers.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut flags = vec![0u8; len.div_ceil(page)];
    // SAFETY: a fresh shared read-only mapping of `len` bytes of an open
    // file; mincore writes one byte per page of it into `flags`, which
    // has that many; the mapping is unmapped before `f` closes.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap {}", path.display());
        let rc = libc::mincore(p, len, flags.as_mut_ptr());
        libc::munmap(p, len);
        assert_eq!(rc, 0, "mincore {}", path.display());
    }
    flags.iter().filter(|&&b| b & 1 != 0).count()
}

/// A writer keeps its newest `keep_cached` flushes' blob files in the page
/// cache and drops older ones after each flush that wrote blob files; a
/// flush that wrote none ends nothing; and the next writer (a new handle,
/// as each Python save opens) goes on from the epochs the last one left
/// in `<store>.cached`.
#[cfg(target_os = "linux")]
#[test]
fn rocks_writer_keeps_its_newest_flushes_blob_files_in_the_page_cache() {
    let dir = tmp();
    let path = dir.path().join("db");
    // tmpfs has no backing store to drop pages to: only the bookkeeping
    // is checked there.
    let evicts = {
        let c = std::ffi::CString::new(dir.path().as_os_str().to_str().unwrap()).unwrap();
        let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: a NUL-terminated path and a statfs-sized buffer.
        let rc = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
        assert_eq!(rc, 0);
        // SAFETY: statfs returned 0, so it filled the struct.
        unsafe { st.assume_init() }.f_type != libc::TMPFS_MAGIC
    };
    let blobs = || {
        let mut v = super::rocks::blob_files(&path);
        v.sort();
        v
    };
    let newest = || blobs().last().map_or(0, |b| b.0);
    // One epoch: chunks in blob files, then the flush that ends it.
    let epoch = |s: &RocksStore, i: u8| {
        for k in 0..4u8 {
            put1(s, Space::Chunks, &[i, k, 0, 0], &vec![i ^ k; 300_000]);
        }
        s.flush().unwrap();
        newest()
    };
    let cached = |from: u64, through: u64| -> Vec<bool> {
        blobs()
            .into_iter()
            .filter(|b| b.0 > from && b.0 <= through)
            .map(|b| resident_pages(&b.1) > 0)
            .collect()
    };
    let s = RocksStore::open_with(&path, Mode::ReadWrite, &fast()).unwrap();
    s.keep_cached(2);
    let e1 = epoch(&s, 1);
    let e2 = epoch(&s, 2);
    assert!(0 < e1 && e1 < e2, "{e1} {e2}");
    assert!(cached(0, e2).iter().all(|&c| c), "both epochs kept");
    let e3 = epoch(&s, 3);
    if evicts {
        assert!(cached(0, e1).iter().all(|&c| !c), "the first epoch dropped");
    }
    assert!(cached(e1, e3).iter().all(|&c| c), "the newest two kept");
    // No blob file written: the epoch goes on.
    put1(&s, Space::Refs, b"HEAD", b"x");
    s.flush().unwrap();
    assert!(cached(e1, e3).iter().all(|&c| c));
    drop(s);
    let s = RocksStore::open_with(&path, Mode::ReadWrite, &fast()).unwrap();
    s.keep_cached(2);
    let e4 = epoch(&s, 4);
    if evicts {
        assert!(
            cached(0, e2).iter().all(|&c| !c),
            "the next handle drops the second"
        );
    }
    assert!(cached(e2, e4).iter().all(|&c| c));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("db.cached")).unwrap(),
        format!("ckvc-cached 1\n{e2}\n{e3}\n{e4}\n")
    );
    for i in 1..=4u8 {
        for k in 0..4u8 {
            assert_eq!(
                s.get_vec(Space::Chunks, &[i, k, 0, 0]).unwrap(),
                Some(vec![i ^ k; 300_000])
            );
        }
    }
}

/// Bug (CI, stop 25): `gc` failed with "No such file or directory" on an
/// SST that RocksDB's background compaction deleted between the store's
/// directory listing and the size read. Files (and directories) vanishing
/// during the walk count as nothing.
#[test]
fn size_on_disk_ignores_files_deleted_while_it_walks() {
    let dir = tmp();
    let path = dir.path().join("db");
    let s = RocksStore::open_with(&path, Mode::ReadWrite, &fast()).unwrap();
    put1(&s, Space::Chunks, &[1; 32], &[7; 100_000]);
    s.flush().unwrap();
    let floor = s.size_on_disk().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let f = path.join(format!("churn-{}", i % 64));
                let d = path.join(format!("churn-dir-{}", i % 8));
                let _ = std::fs::write(&f, b"x");
                let _ = std::fs::create_dir(&d);
                let _ = std::fs::remove_file(&f);
                let _ = std::fs::remove_dir(&d);
                i += 1;
            }
        });
        // Stop the churn before asserting, so that a failure cannot hang
        // the scope.
        let sizes: Vec<_> = (0..2000).map(|_| s.size_on_disk()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for size in sizes {
            let size = size.unwrap();
            assert!(size >= floor, "{size} < {floor}");
        }
    });
}

/// A writer asked for direct reads reads its table and blob files with
/// `O_DIRECT` where the file system takes it (RocksDB's OPTIONS file says
/// which), and reads back every value, before and after a flush and a
/// compaction.
#[test]
fn rocks_writer_with_direct_reads_reads_back_every_value() {
    let dir = tmp();
    let path = dir.path().join("db");
    let value = |i: u8| vec![i; 100_000 + usize::from(i)];
    {
        let s = RocksStore::open_with(&path, Mode::ReadWrite, &fast()).unwrap();
        for i in 0..20u8 {
            put1(&s, Space::Chunks, &[i; 32], &value(i));
        }
        put1(&s, Space::Refs, b"HEAD", b"ref: refs/heads/main");
        s.flush().unwrap();
    }
    let opts = RocksOptions {
        direct_reads: true,
        ..fast()
    };
    let s = RocksStore::open_with(&path, Mode::ReadWrite, &opts).unwrap();
    let newest_options = std::fs::read_dir(&path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("OPTIONS-"))
        .max_by_key(|n| n[8..].parse::<u64>().unwrap_or(0))
        .expect("an OPTIONS file");
    let text = std::fs::read_to_string(path.join(newest_options)).unwrap();
    let direct = super::rocks::direct_reads_work(&path);
    assert!(
        text.contains(&format!("use_direct_reads={direct}")),
        "direct reads work here: {direct}"
    );
    let check = |s: &RocksStore, n: u8| {
        for i in 0..n {
            assert_eq!(s.get_vec(Space::Chunks, &[i; 32]).unwrap(), Some(value(i)));
        }
        assert_eq!(
            s.get_vec(Space::Refs, b"HEAD").unwrap().as_deref(),
            Some(&b"ref: refs/heads/main"[..])
        );
    };
    check(&s, 20);
    for i in 20..30u8 {
        put1(&s, Space::Chunks, &[i; 32], &value(i));
    }
    check(&s, 30);
    s.flush().unwrap();
    check(&s, 30);
    s.compact().unwrap();
    check(&s, 30);
}
